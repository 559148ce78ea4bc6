"""The launch of a Triton kernel that gives each row one program: the row's block and the warps that read it.

Used by :mod:`speculators_v016.fp8_triton` and :mod:`speculators_v016.worker.staged_sum` (Triton, CUDA only).
"""

from __future__ import annotations

import triton


def row_launch(hidden: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for one program per row of ``hidden`` elements: the power of two that holds the row,
    and 4 warps up to 2,048 elements, 8 up to 8,192, 16 beyond."""
    block = triton.next_power_of_2(hidden)
    return block, 4 if block <= 2048 else 8 if block <= 8192 else 16
