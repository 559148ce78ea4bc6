"""Rows the worker copies from the device straight into a pinned pool's blocks (the CLI's path on a GPU) against
the ring slot's path, on one engine: bit for bit, bf16 and FP8 storage, the staged and the direct copy, prompts
over several steps. Skipped where vLLM's CUDA platform does not load."""

from __future__ import annotations

import pytest

from helpers.gpu import GPU_MEMORY, engine_args, requires_vllm_gpu, save_figures
from helpers.layer_rows import same_bits
from helpers.reference import random_prompts
from speculators_v016.engine.buffer_pool import BufferPool
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.store.sample_format import DATA_ALIGN
from speculators_v016.worker.capture import Capture
from speculators_v016.worker.staging import StagingPlan

pytestmark = requires_vllm_gpu

LAYERS = 4
LENGTHS = [40, 200, 3, 90, 700, 17, 513]
PROMPTS = random_prompts(LENGTHS, seed=5)


@pytest.mark.parametrize("copy_path", ["staged", "direct"])
@pytest.mark.parametrize("storage", ["auto", "fp8_e4m3"])
def test_rows_placed_in_pinned_blocks_equal_the_slot_s(tiny_model, storage, copy_path, monkeypatch):
    """One engine, two passes: into a pinned shared pool (placed by the worker) and into fresh tensors (the slot)."""
    monkeypatch.setattr("speculators_v016.engine.core.PLACE_ROWS", True)
    if copy_path == "direct":
        monkeypatch.setattr(Capture, "_plan_staging", staticmethod(lambda *a, **k: StagingPlan(False, 1, 0, "test")))
    with VllmHiddenStatesGenerator(
        tiny_model("llama", LAYERS), dtype="bfloat16", layer_ids=list(range(LAYERS)), hidden_states_dtype=storage,
        max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4, gpu_memory_utilization=GPU_MEMORY,
        enforce_eager=True, extra_engine_args=engine_args(),
    ) as gen:  # fmt: skip
        engine = gen.engine
        assert engine.can_place and engine.capture_info[0]["copy_path"] == copy_path
        slotted = {key: states for key, _, states in engine.stream(enumerate(PROMPTS))}
        assert engine.stats.placed_rows == 0
        pool = BufferPool(align=DATA_ALIGN, shared=True, pin=True)
        try:
            stream = engine.stream(enumerate(PROMPTS), allocate=pool.take, pinned=True)
            placed = {key: states for key, _, states in stream}
            assert engine.stats.placed_rows == sum(LENGTHS)
            assert pool.allocated >= 1
            save_figures(f"placed-{storage}-{copy_path}", {"rows": engine.stats.placed_rows, "blocks": pool.allocated})
            for key, states in slotted.items():
                assert all(same_bits(a, b) for a, b in zip(placed[key], states)), f"prompt {key}"
        finally:
            pool.close()
