"""The fake kernels' checks; they live in ``opforge.ops.rules`` with the messages they share."""

from opforge.ops.rules import expect_2d, expect_floating, expect_like, expect_out, expect_same, expect_shape

__all__ = ["expect_2d", "expect_floating", "expect_like", "expect_out", "expect_same", "expect_shape"]
