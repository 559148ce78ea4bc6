"""The same prompts through differently configured engines give the same states."""

import pytest
import torch

from helpers.layer_rows import same_bits
from helpers.reference import NUM_LAYERS, TOLERANCE, hf_layer_outputs, max_abs_error, random_prompts
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.worker.held_states import ReusedStateError

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


def test_states_read_by_reference_equal_the_ring_s_bit_for_bit(model_dir, prompts, chunked_async, monkeypatch):
    """In process on CPU the worker's own states are read (no ring); through a ring as before: the same bits."""
    monkeypatch.setattr("speculators_v016.engine.core.by_reference", lambda *args: False)
    ringed, engine, _ = run(model_dir, prompts, enforce_eager=True, max_num_batched_tokens=128)
    assert not engine.by_reference and engine.capture_info[0]["copy_path"] == "host"
    for a, b in zip(chunked_async, ringed):
        assert all(torch.equal(x, y) for x, y in zip(a["hidden_states"], b["hidden_states"]))


@pytest.mark.parametrize(
    "dtype, storage, row_copies",
    [
        ("bfloat16", "auto", "inline"),
        ("float32", "auto", "thread"),
        ("bfloat16", "fp8_e4m3", "inline"),
        ("float32", "fp8_e4m3", "thread"),
    ],
)
def test_rows_placed_by_the_worker_equal_the_slot_s_bit_for_bit(
    model_dir, prompts, dtype, storage, row_copies, monkeypatch
):
    """Prompts' rows the in-process worker copies straight into their tensors equal those copied out of the slot."""
    monkeypatch.setattr("speculators_v016.engine.core.by_reference", lambda *args: False)
    options = dict(
        enforce_eager=True, max_num_batched_tokens=128, dtype=dtype, hidden_states_dtype=storage, row_copies=row_copies
    )
    placed, engine, _ = run(model_dir, prompts, **options)  # the default: placed
    assert engine.stats.placed_rows == sum(LENGTHS)
    monkeypatch.setattr("speculators_v016.engine.core.PLACE_ROWS", False)
    slotted, engine, _ = run(model_dir, prompts, **options)  # through the slot
    assert engine.can_place and engine.stats.placed_rows == 0
    for a, b in zip(placed, slotted):
        assert all(same_bits(x, y) for x, y in zip(a["hidden_states"], b["hidden_states"]))


def test_a_model_reusing_its_state_buffers_is_refused_when_read_by_reference(model_dir, prompts):
    """States left in a buffer the next forward overwrites, before the engine copied them: refused, naming both steps."""
    with VllmHiddenStatesGenerator(model_dir, **BASE, enforce_eager=True, max_num_batched_tokens=128) as gen:
        capture = gen.engine.executor.driver_worker.worker._speculators_capture
        real, kept = capture._aux, {}

        def kept_across_forwards(runner, step):  # what a model with a persistent output buffer would return
            out = []
            for j, layer in enumerate(real(runner, step)):
                buffer = kept.setdefault(j, torch.empty(256, layer.shape[1], dtype=layer.dtype))
                out.append(buffer[: layer.shape[0]].copy_(layer))
            return out

        capture._aux = kept_across_forwards
        with pytest.raises(ReusedStateError, match=r"step \d+: the aux state of captured layer 0 lies in the memory "
                           r"of step \d+'s layer 0, which the engine has not copied out yet"):  # fmt: skip
            gen.generate(prompts)
