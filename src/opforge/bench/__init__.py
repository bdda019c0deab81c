"""``opforge bench``: each operator timed against its PyTorch reference and the
machine's ceilings. ``Timer`` and ``time_fn`` are the harness for scripts of one's own."""

from opforge.bench.results import BenchReport, BenchRow
from opforge.bench.run import BENCH_DTYPES, bench_op
from opforge.bench.timing import Timer, Timing, input_sets, repeat_until_stable, time_fn

__all__ = ["BENCH_DTYPES", "BenchReport", "BenchRow", "Timer", "Timing", "bench_op", "input_sets", "repeat_until_stable", "time_fn"]
