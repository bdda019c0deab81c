"""``opforge profile``: one operator's kernels under Nsight Compute, or its checks under compute-sanitizer."""

from opforge.profile.run import case_infos, find_tool, profile_op, run_case, sanitize_op, select_case

__all__ = ["case_infos", "find_tool", "profile_op", "run_case", "sanitize_op", "select_case"]
