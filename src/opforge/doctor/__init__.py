"""``opforge doctor``: the toolchain, GPUs, build cache and op library, probed and reported."""

from opforge.doctor.report import DoctorReport, collect, run, to_json

__all__ = ["DoctorReport", "collect", "run", "to_json"]
