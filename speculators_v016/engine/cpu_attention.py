"""vLLM 0.16's CPU attention on Intel processors with AMX: the block size it can run bfloat16 at.

On a processor with AMX tiles, vLLM 0.16's CPU attention picks its AMX kernels
for bfloat16 whenever the KV block size is a multiple of 32 (its default is
128), and those kernels then refuse the configuration at the first forward
(``Unsupported CPU attention configuration: head_dim=128 isa=0``; vLLM alone
too). At block size 16 it takes its ``vec16`` kernels, which run. So on such a
processor, for a bfloat16 engine (``auto`` is bfloat16 on CPU) and unless the
caller chose a block size, the engine asks vLLM for block size 16. Nothing else
changes: the block size is where KV pages are cut, not what attention computes.
"""

from __future__ import annotations

import torch
from loguru import logger

#: The block size vLLM 0.16's CPU attention runs bfloat16 at on AMX processors (its vec16 kernels).
AMX_SAFE_BLOCK_SIZE = 16
BF16_NAMES = ("auto", "bfloat16", "bf16")


def amx_tiles() -> bool:
    """Does this processor have AMX tiles (what vLLM's CPU attention asks torch)?"""
    probe = getattr(getattr(torch._C, "_cpu", None), "_is_amx_tile_supported", None)
    return bool(probe and probe())


def on_cpu_platform() -> bool:
    from vllm.platforms import current_platform  # noqa: PLC0415 - vLLM only when an engine starts

    return current_platform.is_cpu()


def attention_overrides(dtype: str, extra_engine_args: dict) -> dict:
    """vLLM engine arguments that keep its CPU attention on kernels that run (empty where nothing is needed)."""
    if "block_size" in extra_engine_args or str(dtype).removeprefix("torch.") not in BF16_NAMES:
        return {}
    if not (on_cpu_platform() and amx_tiles()):
        return {}
    logger.info(
        "CPU with AMX and a bfloat16 engine: KV block size {} (vLLM 0.16's AMX attention refuses its default 128)",
        AMX_SAFE_BLOCK_SIZE,
    )
    return {"block_size": AMX_SAFE_BLOCK_SIZE}
