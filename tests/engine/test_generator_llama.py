"""The vLLM 0.16 generator on a tiny Llama: exact states, attribution, contract, errors."""

import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.reference import NUM_LAYERS, TOLERANCE, hf_layer_outputs, max_abs_error, random_prompts
from speculators_v016.engine.core import PromptError
from speculators_v016.generator import num_decoder_layers
from speculators_v016.layers import LayerIdError, LayerPlan

ALL_LAYERS = list(range(NUM_LAYERS))
# 700 > max_num_batched_tokens: split by chunked prefill; 10 prompts > max_num_seqs.
LENGTHS = [5, 33, 200, 700, 64, 129, 1, 17, 300, 90]
ENGINE = dict(max_model_len=1024, dtype="float32", enforce_eager=True, max_num_batched_tokens=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def generator(model_dir):
    from speculators.data_generation import (  # noqa: PLC0415 - upstream: slow to import, this test only
        VllmHiddenStatesGenerator,
    )

    gen = VllmHiddenStatesGenerator(model_dir, layer_ids=ALL_LAYERS, **ENGINE)
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS)


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    return hf_layer_outputs(model_dir, prompts)


@pytest.fixture(scope="module")
def results(generator, prompts):
    return generator.generate(prompts)


def test_runs_async_with_two_steps_in_flight(generator, results):
    """Async scheduling is on, on CPU, with two steps in flight."""
    assert generator.engine.async_scheduling
    assert generator.engine.capture_info[0]["async_scheduling"]
    assert generator.engine.capture_info[0]["cpu_async_output"]
    assert generator.engine.stats.max_in_flight == 2


def test_the_next_step_is_launched_before_rows_are_copied(generator, results):
    """In process on CPU the worker's states are read as they are (no ring); the next step goes before their copy."""
    engine = generator.engine
    assert engine.ring is None and engine.by_reference
    assert [info["copy_path"] for info in engine.capture_info] == ["reference"]
    assert engine.stats.launched_before_copy >= engine.stats.steps // 2


def test_each_stream_s_end_is_timed_apart(generator, prompts, results):
    """The time from the last step (every prompt fed, none in flight) to the stream's end is counted, once a call."""
    stats = generator.engine.stats
    before = stats.drained
    began = time.perf_counter()
    generator.generate(prompts)
    wall = time.perf_counter() - began
    assert 0 < stats.drained - before < wall / 3  # 7+ steps of forward before it, none in it
    assert (stats.prefault_hits, stats.prefault_misses) == (0, 0)  # prompts' memory is made ahead on GPU engines only


def rpcs_per_step(generator, prompts) -> tuple[dict, int]:
    """The executor's RPCs (by method) while ``prompts`` stream, and the steps they took."""
    executor, methods = generator.engine.executor, {}
    original = executor.collective_rpc

    def counting(method, *args, **kwargs):
        methods[method] = methods.get(method, 0) + 1
        return original(method, *args, **kwargs)

    steps = generator.engine.stats.steps
    executor.collective_rpc = counting
    try:
        for _ in generator.engine.stream(enumerate(prompts)):
            pass
    finally:
        del executor.collective_rpc
    return methods, generator.engine.stats.steps - steps


def test_a_step_is_two_rpcs_as_in_vllm(generator, prompts, results):
    """Each step is execute_model plus one RPC that captures and samples (no separate capture or sample_tokens)."""
    methods, steps = rpcs_per_step(generator, prompts[:4])
    assert steps > 1
    assert methods.pop("speculators_capture_sample") == steps
    assert methods.pop("execute_model") >= steps  # steps without tokens run execute_model alone
    assert methods in ({}, {"speculators_capture_flush": 1}), methods  # the last capture, once, at the end


def test_every_layer_matches_transformers(results, reference, generator, record_architecture):
    """fp32 states of layers 0..n-1 equal transformers' layer outputs within 1e-5."""
    worst = max_abs_error(results, reference, ALL_LAYERS)
    record_architecture(
        "llama",
        generator.engine.capture_info[0]["model_class"],
        "built-in",
        "engine (CPU, fp32; eager, compiled, TP=2, mp)",
        worst,
        TOLERANCE,
    )
    assert worst < TOLERANCE


def test_last_layer_is_before_the_final_norm(results, reference, model_dir):
    """Layer n-1 is the pre-norm output; normed, it equals transformers' last hidden state."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([random_prompts(LENGTHS)[2]])
    with torch.no_grad():
        normed = hf(ids, output_hidden_states=True).hidden_states[-1][0]
        ours = hf.model.norm(results[2]["hidden_states"][-1])
    assert (ours - normed).abs().max().item() < TOLERANCE
    assert (results[2]["hidden_states"][-1] - normed).abs().max().item() > 1e-2


def test_upstream_result_contract(results, prompts):
    """generate() returns upstream's dicts in input order: input_ids, hidden_states per layer, loss_mask."""
    assert len(results) == len(prompts)
    for res, ids in zip(results, prompts):
        assert set(res) == {"input_ids", "hidden_states", "loss_mask"}
        assert res["input_ids"].dtype == torch.long and res["input_ids"].tolist() == ids
        assert res["loss_mask"] is None
        assert [h.shape for h in res["hidden_states"]] == [(len(ids), 128)] * NUM_LAYERS
        assert all(h.dtype == torch.float32 and h.is_contiguous() for h in res["hidden_states"])


def test_chunked_prefill_was_exercised(generator, results):
    """The 700-token prompt ran in several steps (max_num_batched_tokens=256)."""
    assert generator.engine.stats.steps >= 700 // 256 + 1


def test_the_stats_count_the_tokens_the_steps_computed(generator, prompts):
    """EngineStats.computed grows by each step's scheduled tokens: every token of a prompt, once (the mid-run rate's)."""
    before = generator.engine.stats.computed
    generator.generate([prompts[2]])
    assert generator.engine.stats.computed - before == len(prompts[2])


def test_one_by_one_equals_batched(generator, prompts, results):
    """Prompts run alone (repeated generate() calls) give the batched states within 1e-5."""
    for i in (0, 3, 6):
        [alone] = generator.generate([prompts[i]])
        for a, b in zip(alone["hidden_states"], results[i]["hidden_states"]):
            assert (a - b).abs().max().item() < TOLERANCE


def test_stream_yields_each_prompt_once(generator, prompts, results):
    """stream() yields every prompt once, with its index, as it completes."""
    seen = {}
    for item in generator.stream(prompts[:6]):
        seen[item["index"]] = item
    assert sorted(seen) == list(range(6))
    for i, item in seen.items():
        assert torch.equal(item["input_ids"], results[i]["input_ids"])


def test_tensor_input_is_accepted(generator, prompts, results):
    """A 2-D LongTensor of token ids works as upstream's generate() accepts it."""
    batch = torch.tensor([prompts[4][:60], prompts[5][:60]])
    out = generator.generate(batch)
    assert [r["input_ids"].tolist() for r in out] == batch.tolist()


def test_default_layers(model_dir):
    """Default layer ids are upstream's [2, n//2, n-3, n-1] (distinct)."""
    assert LayerPlan.build(num_decoder_layers(model_dir), None).layer_ids == (2, 4, 5, 7)


def test_empty_prompt_is_refused(generator):
    """An empty prompt raises PromptError naming it."""
    with pytest.raises(PromptError, match="prompt 1 is empty"):
        generator.generate([[5, 6], []])


def test_out_of_vocabulary_ids_are_refused(generator):
    """Token ids outside the vocabulary raise PromptError before anything is scheduled."""
    with pytest.raises(PromptError, match="outside the vocabulary"):
        generator.generate([[5, 6, 10**6]])
    assert not generator.engine.scheduler.has_requests()


def test_too_long_prompt_is_truncated_and_counted(generator):
    """A prompt over max_model_len-1 is truncated (as upstream does) and counted."""
    before = generator.engine.stats.truncated
    [res] = generator.generate([[7] * 1100])
    assert res["input_ids"].shape[0] == 1023
    assert res["hidden_states"][0].shape[0] == 1023
    assert generator.engine.stats.truncated == before + 1


def test_invalid_layer_ids_fail_before_the_engine_starts(model_dir):
    """Out-of-range or duplicate layer ids raise LayerIdError before vLLM starts."""
    from speculators.data_generation import (  # noqa: PLC0415 - upstream: slow to import, this test only
        VllmHiddenStatesGenerator,
    )

    with pytest.raises(LayerIdError, match="out of range"):
        VllmHiddenStatesGenerator(model_dir, layer_ids=[0, NUM_LAYERS], **ENGINE)
    with pytest.raises(LayerIdError, match="more than once"):
        VllmHiddenStatesGenerator(model_dir, layer_ids=[3, 3], **ENGINE)


def test_stopping_a_stream_early_leaves_the_engine_usable(generator, prompts, results):
    """Closing a stream after one result aborts the rest; the next call still works."""
    stream = generator.stream(prompts)
    next(stream)
    stream.close()
    assert not generator.engine.scheduler.has_requests()
    [again] = generator.generate([prompts[1]])
    assert (again["hidden_states"][0] - results[1]["hidden_states"][0]).abs().max().item() < TOLERANCE


def test_bad_prompt_mid_stream_aborts_cleanly(generator, prompts):
    """A refused prompt in the middle of a stream raises and leaves nothing scheduled."""
    with pytest.raises(PromptError, match="prompt 2 is empty"):
        list(generator.stream([prompts[0], prompts[1], []]))
    assert not generator.engine.scheduler.has_requests()
    assert len(generator.generate([prompts[0]])) == 1


def test_library_use_leaves_the_callers_descriptors_alone(generator, prompts):
    """A library call never redirects stdout/stderr (only the CLI's console does)."""
    before = [os.fstat(fd) for fd in (1, 2)]
    generator.generate([prompts[1]])
    after = [os.fstat(fd) for fd in (1, 2)]
    assert [(s.st_dev, s.st_ino) for s in before] == [(s.st_dev, s.st_ino) for s in after]
