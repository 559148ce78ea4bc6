"""The staged copy and its NaN/Inf proof in one pass on a CUDA device: a Triton kernel.

:class:`~speculators_v016.worker.staging.StagingCopier` copies a step's rows
into a staging buffer and, for the proof, sums them in float32. As two torch
operations that reads the rows twice: the copy reads and writes them, and the
sum reads the staged copy again (at hidden 7168, 8192 rows and 4 layers a
step, 448 MiB more read a step, ~0.15 ms of an H100's ~50 ms step, on the
compute stream). Here one program per row reads the row once, stores it
unchanged (the loaded values, no conversion: the staged bytes are the aux
state's bytes) and adds the row's float32 sum atomically into one of
the partial sums it is given (row modulo their count: spread, so that rows running at once do not wait
on one address); a last reduction of the partials writes the proof.

The proof keeps its meaning: a NaN anywhere makes its row's sum NaN and every
sum it is added to; an infinity makes it infinite or, met by its opposite,
NaN. So a finite proof still proves every staged value finite. The order of
the additions differs from ``torch.sum``'s, which can only move a step whose
finite values sum near float32's limit between proven and unproven; an
unproven step's bytes are tested by the writers, as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speculators_v016.triton_rows import row_launch

#: Widest row one program holds (elements); wider rows take the torch path.
MAX_BLOCK = 32768


@triton.jit
def _copy_rows_and_sum(src, src_stride, dst, dst_stride, partials, hidden, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < hidden
    x = tl.load(src + row * src_stride + offsets, mask=inside, other=0.0)
    tl.store(dst + row * dst_stride + offsets, x, mask=inside)
    tl.atomic_add(partials + row % SLOTS, tl.sum(x.to(tl.float32), axis=0))


def usable(rows: torch.Tensor, staged: torch.Tensor, partials: torch.Tensor) -> bool:
    """The kernel's layout: 2-D rows and staged rows of one shape and float dtype with contiguous rows, contiguous float32
    partials (row ``i`` adds into ``partials[i % len(partials)]``), one CUDA device."""
    return (
        rows.is_cuda
        and rows.dim() == 2
        and staged.dim() == 2
        and rows.shape == staged.shape
        and rows.dtype == staged.dtype
        and rows.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and rows.stride(-1) == 1
        and staged.stride(-1) == 1
        and rows.shape[1] <= MAX_BLOCK
        and partials.dtype == torch.float32
        and partials.is_contiguous()
        and partials.numel() >= 1
        and rows.device == staged.device == partials.device
    )


def copy_and_add(rows: torch.Tensor, staged: torch.Tensor, partials: torch.Tensor) -> None:
    """``staged[:] = rows`` (bit for bit) and each row's float32 sum added into ``partials`` (see :func:`usable`)."""
    count, hidden = rows.shape
    if count == 0:
        return
    block, warps = row_launch(hidden)
    _copy_rows_and_sum[(count,)](
        rows,
        rows.stride(0),
        staged,
        staged.stride(0),
        partials,
        hidden,
        SLOTS=partials.numel(),
        BLOCK=block,
        num_warps=warps,
    )
