"""The same prompts through differently configured engines give the same states."""

import pytest
import torch

from helpers.reference import NUM_LAYERS, TOLERANCE, hf_layer_outputs, max_abs_error, random_prompts
from speculators_v016.generator import VllmHiddenStatesGenerator

LAYERS = list(range(NUM_LAYERS))
LENGTHS = [300, 7, 150, 61, 2, 520]
BASE = dict(layer_ids=LAYERS, max_model_len=1024, dtype="float32", max_num_seqs=4)


def run(model_dir, prompts, **options):
    """(states, the shut-down engine, the class name of the executor it ran on: a shut-down engine drops it)."""
    with VllmHiddenStatesGenerator(model_dir, **{**BASE, **options}) as gen:
        return gen.generate(prompts), gen.engine, type(gen.engine.executor).__name__


def largest_difference(a, b) -> float:
    return max(
        (x - y).abs().max().item() for ra, rb in zip(a, b) for x, y in zip(ra["hidden_states"], rb["hidden_states"])
    )


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=7)


@pytest.fixture(scope="module")
def chunked_async(model_dir, prompts):
    return run(model_dir, prompts, enforce_eager=True, max_num_batched_tokens=128)[0]


def test_async_on_and_off_are_bit_identical(model_dir, prompts, chunked_async):
    """Async scheduling on vs off, same batches: bit-identical states."""
    sync, engine, _ = run(model_dir, prompts, enforce_eager=True, max_num_batched_tokens=128, async_scheduling=False)
    assert not engine.async_scheduling and engine.depth == 1
    for a, b in zip(chunked_async, sync):
        assert all(torch.equal(x, y) for x, y in zip(a["hidden_states"], b["hidden_states"]))


def test_multiprocess_unchunked_equals_uniprocess_chunked(model_dir, prompts, chunked_async):
    """Multiprocess executor without chunking agrees with uniprocess chunked within 1e-5."""
    unchunked, _, executor = run(model_dir, prompts, enforce_eager=True, max_num_batched_tokens=4096, executor="mp")
    assert executor == "CaptureMultiprocExecutor"
    assert largest_difference(chunked_async, unchunked) < TOLERANCE


def test_compiled_equals_eager_and_transformers(model_dir, prompts, chunked_async):
    """The compiled (torch.compile) path gives the eager states within 1e-5, and transformers'."""
    compiled, _, _ = run(model_dir, prompts, enforce_eager=False, max_num_batched_tokens=128)
    assert largest_difference(chunked_async, compiled) < TOLERANCE
    assert max_abs_error(compiled, hf_layer_outputs(model_dir, prompts), LAYERS) < TOLERANCE


@pytest.mark.parametrize("executor", ["uni", "mp"])
def test_row_copies_on_their_own_thread_are_bit_identical(model_dir, prompts, chunked_async, executor):
    """Rows copied out of the ring on a thread of their own (the GPU default) equal the inline copies bit for bit."""
    threaded, engine, _ = run(
        model_dir, prompts, enforce_eager=True, max_num_batched_tokens=128, row_copies="thread", executor=executor
    )
    assert engine.row_copies_apart and engine.stats.copy_thread > 0
    for a, b in zip(chunked_async, threaded):
        assert all(torch.equal(x, y) for x, y in zip(a["hidden_states"], b["hidden_states"]))
