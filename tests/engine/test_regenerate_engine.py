"""Generating requests on the engine: vLLM's own tokens, and decode-time states equal to a prefill capture."""

import pytest
import torch

from helpers.llm_reference import llm_generate
from helpers.reference import TOLERANCE, hf_layer_outputs, random_prompts
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.engine.assembly import expected_rows
from speculators_v016.engine.core import PromptError
from speculators_v016.engine.generation import Generation, sample_seed
from speculators_v016.generator import VllmHiddenStatesGenerator

LAYERS = 4
# max_num_batched_tokens 48 < the longest prompt: chunked prefill, and decode rows beside prefill chunks
ENGINE = dict(max_model_len=256, dtype="float32", enforce_eager=True, max_num_batched_tokens=48, max_num_seqs=4)
LENGTHS = [5, 70, 17, 33, 3, 120, 9, 41]
NEW = 24


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def family(request, tiny_model):
    """Llama: vLLM's built-in aux outputs; Mixtral: our taps."""
    return request.param, tiny_model(request.param, LAYERS)


@pytest.fixture(scope="module")
def generator(family):
    gen = VllmHiddenStatesGenerator(family[1], layer_ids=list(range(LAYERS)), **ENGINE)
    assert bool(gen.engine.capture_info[0]["builtin_ids"]) == (family[0] == "llama")
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, vocab=300, seed=4)


@pytest.fixture(scope="module")
def stop_ids(generator, prompts):
    """EOS, and a token that greedy decoding of prompt 0 produces mid-way (so that turns stop early)."""
    eos = 2
    first = regenerate(generator, prompts, Generation(NEW, stop_token_ids=frozenset({eos})))
    tokens = first[0]["generated"].token_ids
    return frozenset({eos, tokens[min(5, len(tokens) - 1)]})


def regenerate(generator, prompts, generation, order=None, window=None, logprobs=False):
    """Each prompt generated (and captured) through the engine; results by prompt index."""
    engine, out = generator.engine, {}
    order = order or list(range(len(prompts)))
    feed = ((i, prompts[i], generation) for i in order)
    want = (lambda key: True) if logprobs else None
    for key, ids, states in engine.stream(feed, window=window, prompt_logprobs=want):
        out[key] = {
            "ids": ids,
            "states": states,
            "generated": engine.generated.pop(key),
            "prompt_logprobs": engine.prompt_logprobs.pop(key, None),
        }
    assert not engine.generated
    return out


def recorded(generator, run):
    """``run()``'s result and the steps the scheduler made meanwhile: which kinds of rows each held, and its batch
    (prompt length, first position, rows) of each request (the prompts' lengths differ: a request's name)."""
    steps = []
    scheduler = generator.engine.scheduler
    schedule = scheduler.schedule

    def recording():
        so = schedule()
        rows = expected_rows(so)  # request -> (first position, rows)
        prompt = {rid: scheduler.requests[rid].num_prompt_tokens for rid in rows}
        steps.append(
            {
                "prefill": any(start < prompt[rid] for rid, (start, _) in rows.items()),
                "decode": any(start >= prompt[rid] for rid, (start, _) in rows.items()),
                "batch": sorted((prompt[rid], start, n) for rid, (start, n) in rows.items()),
            }
        )
        return so

    scheduler.schedule = recording
    try:
        return run(), steps
    finally:
        del scheduler.schedule


@pytest.fixture(scope="module")
def greedy(generator, prompts, stop_ids):
    return recorded(
        generator,
        lambda: regenerate(generator, prompts, Generation(NEW, stop_token_ids=stop_ids, logprobs=True), logprobs=True),
    )


@pytest.fixture(scope="module")
def vllm_tokens(family, prompts, stop_ids, tmp_path_factory):
    """LLM.generate's greedy tokens for the same prompts and engine settings, in a process of its own."""
    where = tmp_path_factory.mktemp("llm")
    args = {
        "model": family[1],
        "prompts": prompts,
        "engine": ENGINE,
        "sampling": {"max_tokens": NEW, "temperature": 0.0, "stop_token_ids": sorted(stop_ids)},
    }
    return llm_generate(args, where)


def test_greedy_regeneration_is_llm_generate_token_for_token(greedy, vllm_tokens, stop_ids):
    """Greedy generating requests sample exactly LLM.generate's tokens, stops and caps alike."""
    results, _ = greedy
    reasons = set()
    for i, theirs in enumerate(vllm_tokens):
        g = results[i]["generated"]
        assert g.token_ids == theirs, f"prompt {i}"
        reasons.add(g.finish_reason)
        assert g.finish_reason == ("stop" if theirs[-1] in stop_ids else "length")
    assert reasons == {"stop", "length"}


def test_a_sample_is_the_prompt_and_every_sampled_token_with_a_state_each(greedy, prompts):
    """input_ids = prompt + sampled ids (the stop included); every layer has a row per position."""
    results, _ = greedy
    for i, r in results.items():
        assert r["ids"] == prompts[i] + r["generated"].token_ids
        assert all(s.shape == (len(r["ids"]), s.shape[1]) for s in r["states"])


def test_decode_states_equal_a_prefill_capture_of_the_same_sequences(generator, greedy, family):
    """States captured while generating (mixed prefill/decode steps) equal a prefill of the final sequences."""
    results, steps = greedy
    assert any(s["prefill"] and s["decode"] for s in steps), "no step mixed prefill and decode rows"
    finals = [results[i]["ids"] for i in sorted(results)]
    prefilled = {key: states for key, _, states in generator.engine.stream(enumerate(finals))}
    for i in sorted(results):
        for layer, (a, b) in enumerate(zip(results[i]["states"], prefilled[i])):
            assert (a - b).abs().max().item() < TOLERANCE, f"{family[0]} prompt {i} layer {layer}"
    reference = hf_layer_outputs(family[1], finals)
    for i, ref in enumerate(reference):
        for layer in range(LAYERS):
            assert (results[i]["states"][layer] - ref[layer]).abs().max().item() < TOLERANCE


def test_the_logit_check_covers_generated_positions_and_fails_shifted_rows(generator, greedy, family):
    """The last layer reproduces vLLM's logprob of every sampled token; rows shifted by one position fail."""
    results, _ = greedy
    checker = LogitChecker(family[1], torch.float32, LAYERS - 1)
    for i, r in results.items():
        g = r["generated"]
        assert len(g.logprobs) == len(g.token_ids)
        theirs = torch.cat([r["prompt_logprobs"].float(), torch.tensor(g.logprobs)])
        assert theirs.shape[0] == len(r["ids"]) - 1
        ids = torch.tensor(r["ids"])
        checker.add(("ok", i), ids, r["states"], theirs)
        assert checker.last_passed, f"prompt {i}"
        shifted = [torch.roll(s, 1, dims=0) for s in r["states"]]
        checker.add(("shifted", i), ids, shifted, theirs)
        assert not checker.last_passed, f"prompt {i}: rows shifted by one passed"


def test_seeded_sampling_gives_the_same_tokens_in_another_batch(generator, prompts, stop_ids):
    """At temperature 0.7 with per-request seeds, another order and window sample the same tokens."""
    sampling = dict(max_new_tokens=NEW, temperature=0.7, top_p=0.9, stop_token_ids=stop_ids)
    gens = {i: Generation(seed=1000 + i, **sampling) for i in range(len(prompts))}
    first = {k: r["generated"].token_ids for k, r in _seeded(generator, prompts, gens, None, None).items()}
    order = list(reversed(range(len(prompts))))
    again = {k: r["generated"].token_ids for k, r in _seeded(generator, prompts, gens, order, 2).items()}
    assert first == again
    greedy_tokens = regenerate(generator, prompts, Generation(NEW, stop_token_ids=stop_ids))
    assert any(first[i] != greedy_tokens[i]["generated"].token_ids for i in first)  # it did sample


def _seeded(generator, prompts, gens, order, window):
    engine, out = generator.engine, {}
    order = order or list(range(len(prompts)))
    for key, ids, _states in engine.stream(((i, prompts[i], gens[i]) for i in order), window=window):
        out[key] = {"ids": ids, "generated": engine.generated.pop(key)}
    return out


def test_a_prompt_without_room_for_its_new_tokens_is_refused(generator):
    """A generating prompt is never truncated: one that leaves no room is refused, naming it."""
    with pytest.raises(PromptError, match="exceed max_model_len 256"):
        list(generator.engine.stream([("long", list(range(5, 240)), Generation(NEW))]))
    assert regenerate(generator, [[5, 6, 7]], Generation(3))[0]["generated"].finish_reason == "length"


def test_the_generators_stream_regenerates_with_upstreams_dict(generator, prompts, stop_ids):
    """generator.stream(..., generation=) yields upstream's dict: prompt + sampled ids, mask 1 on them."""
    generation = Generation(NEW, temperature=0.7, seed=5, stop_token_ids=stop_ids)
    items = {item["index"]: item for item in generator.stream(prompts[:3], generation=generation)}
    gens = {i: Generation(NEW, temperature=0.7, seed=sample_seed(5, i), stop_token_ids=stop_ids) for i in range(3)}
    direct = _seeded(generator, prompts[:3], gens, None, None)
    for i, item in items.items():
        prompt_len = len(prompts[i])
        assert item["input_ids"].tolist() == direct[i]["ids"]
        assert item["loss_mask"].tolist() == [0] * prompt_len + [1] * (len(direct[i]["ids"]) - prompt_len)
        assert item["finish_reason"] == direct[i]["generated"].finish_reason
        assert len(item["hidden_states"]) == LAYERS


def test_regeneration_with_the_rows_copied_on_a_thread_is_the_same(generator, greedy, prompts, stop_ids):
    """Rows copied on a thread of their own (the GPU default; here with the ring's slots of inline copies, so the
    engine also waits for the copies to free one): the same tokens, and bit-identical states in the same batches.

    Which rows share a step is not fixed: like vLLM's own loop, the engine waits on the oldest step first when
    its output is already there (a busy machine changes that), and a stop seen earlier changes the next batches.
    Where the batches differ, the states agree within the fp32 tolerance of other batchings (chunked against
    unchunked: test_generator_consistency.py)."""
    engine = generator.engine
    engine.row_copies_apart = True
    try:
        threaded, steps = recorded(
            generator,
            lambda: regenerate(
                generator, prompts, Generation(NEW, stop_token_ids=stop_ids, logprobs=True), logprobs=True
            ),
        )
    finally:
        engine.row_copies_apart = False
    assert engine.stats.copy_thread > 0
    results, greedy_steps = greedy
    same_batches = [s["batch"] for s in steps] == [s["batch"] for s in greedy_steps]
    for i, r in results.items():
        assert threaded[i]["ids"] == r["ids"], f"prompt {i}"
        if same_batches:
            assert all(torch.equal(a, b) for a, b in zip(threaded[i]["states"], r["states"])), f"prompt {i}"
        else:
            worst = max(float((a - b).abs().max()) for a, b in zip(threaded[i]["states"], r["states"]))
            assert worst < TOLERANCE, f"prompt {i}: {worst} (other batches than the reference's)"
