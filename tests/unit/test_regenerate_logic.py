"""--regenerate's pure logic: stops, growing requests, the turn plan and feed, sampling, the journal."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_assembly import capture, rows

from speculators_v016.engine.assembly import Assembler, AttributionError
from speculators_v016.engine.generation import Decoding, Generated, Generation
from speculators_v016.protocol import StepCapture
from speculators_v016.run.dataset import BadRowError
from speculators_v016.run.regenerate import (
    Regeneration,
    Sampling,
    answer_slots,
    check_generation_prompt,
    end_of_turn_ids,
    plan,
    records_by_conversation,
    resolve_sampling,
    sample_seed,
)
from speculators_v016.store import regenerated
from speculators_v016.target import GenerationSetupError
from speculators_v016.testing.tiny_models import train_tokenizer
from speculators_v016.worker.cpu_seeds import ScratchGenerator, discarded_generators_aside


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["hello there how are you", "fine thanks and you", "the quick brown fox"], 300)


class Logprobs:
    def __init__(self, tokens, values):
        self.logprob_token_ids = np.array(tokens)[:, None]
        self.logprobs = np.array(values)[:, None]


def test_decoding_ends_at_a_stop_token_and_drops_the_step_past_it():
    """A stop token ends the sample (kept in it); tokens after it are dropped."""
    d = Decoding(5, Generation(max_new_tokens=10, stop_token_ids=frozenset({2})))
    assert d.add([7]) is False
    assert d.add([2]) is True
    assert d.add([9]) is False
    assert d.result.token_ids == [7, 2] and d.result.finish_reason == "stop" and d.result.length == 7


def test_decoding_ends_at_the_cap_marked_length():
    """A turn that reaches max_new_tokens ends there, marked 'length'."""
    d = Decoding(3, Generation(max_new_tokens=2))
    assert not d.add([4]) and d.add([5])
    assert d.result.finish_reason == "length" and d.result.token_ids == [4, 5]


def test_decoding_checks_vllms_logprobs_name_the_sampled_token():
    """Logprobs that name another token than the sampled one are refused."""
    d = Decoding(3, Generation(max_new_tokens=4, logprobs=True))
    d.add([4], Logprobs([4], [-0.5]))
    assert d.result.logprobs == [-0.5]
    with pytest.raises(RuntimeError, match="name token 8 for sampled token 5"):
        d.add([5], Logprobs([8], [-0.1]))


def test_sampling_params_run_one_step_past_the_cap_with_the_stop_ours():
    """vLLM is asked for one token past the cap, EOS ignored; top_k 0 is vLLM's -1."""
    params = Generation(max_new_tokens=6, temperature=0.7, top_p=0.9, seed=3, logprobs=True).sampling_params(True)
    assert params.max_tokens == 7 and params.ignore_eos and params.top_k == -1 and params.seed == 3
    assert params.logprobs == 0 and params.prompt_logprobs == 0


def test_a_growing_request_is_whole_once_its_length_is_final():
    """Prefill then decode rows of a generating request become one tensor per layer; rows past the end drop."""
    asm = Assembler((1, 0))
    asm.add_request("g", "G", 3, generating=True)
    asm.expect(1, {"g": (0, 3)})
    asm.add(capture(1, [("g", 0, 3)]))
    assert asm.pop_complete() == []
    asm.grow("g", 4, final=False)  # first sampled token known
    asm.expect(2, {"g": (3, 1)})
    asm.add(capture(2, [("g", 3, 1)]))
    asm.grow("g", 5, final=True)  # second token was the stop
    asm.expect(3, {"g": (4, 1)})
    asm.add(capture(3, [("g", 4, 1)]))
    [(key, states)] = asm.pop_complete()
    assert key == "G" and states[1][:, 0].tolist() == [0, 1, 2, 3, 4]
    assert states[0][:, 0].tolist() == [1000, 1001, 1002, 1003, 1004]
    asm.expect(4, {"g": (5, 1)})
    asm.add(capture(4, [("g", 5, 1)]))  # the step past the end, already in flight: dropped
    assert asm.pop_complete() == []


def test_a_row_ahead_of_the_sampled_tokens_is_refused():
    """A decode row for a position whose token was not sampled yet is an attribution error."""
    asm = Assembler((0,))
    asm.add_request("g", "G", 2, generating=True)
    asm.expect(1, {"g": (0, 3)})
    with pytest.raises(AttributionError, match="before its token there was sampled"):
        asm.add(StepCapture(1, ["g"], [0], [3], states=rows(0, 3, layers=1)))


def test_plan_numbers_samples_per_answered_turn(tokenizer):
    """Each assistant turn after a user turn is a sample; leading assistant turns and no-user rows are not."""
    rows_ = [
        ("a.jsonl:1", [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]),
        ("a.jsonl:2", [{"from": "gpt", "value": "lead"}, {"from": "system", "value": "s"}]),
        (
            "a.jsonl:3",
            [{"from": "gpt", "value": "lead"}, {"from": "user", "value": "q"}, {"from": "gpt", "value": "y"}],
        ),
        (
            "a.jsonl:4",
            [{"from": "user", "value": "q1"}, {"from": "gpt", "value": "a1"}]
            + [{"from": "user", "value": "q2"}, {"from": "assistant", "value": "a2"}],
        ),
    ]
    with pytest.raises(BadRowError, match="a.jsonl:2: no user turn"):
        plan(rows_, skip_bad_rows=False)
    convs, skipped = plan(rows_, skip_bad_rows=True)
    assert [(c.where, c.first_index, c.answers) for c in convs] == [
        ("a.jsonl:1", 0, 1),
        ("a.jsonl:3", 1, 1),
        ("a.jsonl:4", 2, 2),
    ]
    assert convs[1].turns[0] == {"role": "user", "content": "q"}  # the leading assistant turn is gone
    assert skipped == {"nothing to regenerate (no user turn answered)": 1}
    with pytest.raises(BadRowError, match="role 'tool'"):
        plan([("b:1", [{"from": "tool", "value": "t"}])], skip_bad_rows=False)


def test_user_turns_without_an_answer_each_get_one(tokenizer):
    """Prompt-only rows and a trailing user turn: one answer slot after each user turn past the last assistant."""
    u = lambda c: {"role": "user", "content": c}  # noqa: E731
    a = {"role": "assistant", "content": None}
    system = {"role": "system", "content": "s"}
    assert answer_slots([system, u("q1"), u("q2")]) == [system, u("q1"), a, u("q2"), a]
    sourced = [u("q1"), u("q2"), {"role": "assistant", "content": "x"}, u("q3")]
    assert answer_slots(sourced) == [*sourced, a]  # consecutive user turns before an answer: one answer, as before
    answered = [u("q"), {"role": "assistant", "content": "x"}]
    assert answer_slots(answered) == answered
    rows_ = [
        ("p:1", [{"from": "system", "value": "s"}, {"from": "human", "value": "q1"}, {"from": "human", "value": "q2"}]),
        ("p:2", [{"from": "user", "value": "q"}]),
        ("p:3", [{"from": "user", "value": "q"}, {"from": "gpt", "value": "x"}, {"from": "user", "value": "more"}]),
    ]
    convs, skipped = plan(rows_, skip_bad_rows=False)
    assert [(c.where, c.first_index, c.answers) for c in convs] == [("p:1", 0, 2), ("p:2", 2, 1), ("p:3", 3, 2)]
    assert skipped == {} and plan(rows_, False)[0] == convs  # derived from the row alone: stable on resume
    regen = Regeneration(tokenizer, convs[:1], sampling(), frozenset({1}), 200, {})
    feed = regen.feed()
    index, prompt, _ = next(feed)
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}]
    assert index == 0 and prompt == tokenizer.apply_chat_template(history, add_generation_prompt=True)
    answer = tokenizer("fine", add_special_tokens=False)["input_ids"]
    regen.complete(0, Generated(len(prompt), answer, "length"))
    index, prompt2, _ = next(feed)
    history += [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "q2"}]
    assert index == 1 and prompt2 == tokenizer.apply_chat_template(history, add_generation_prompt=True)
    resumed = Regeneration(tokenizer, convs[:1], sampling(), frozenset(), 200, {0: {"text": "from the journal"}})
    index, prompt3, _ = next(resumed.feed())  # a resume: turn 0 written, turn 1 asked after its recorded text
    history[2] = {"role": "assistant", "content": "from the journal"}
    assert index == 1 and prompt3 == tokenizer.apply_chat_template(history, add_generation_prompt=True)


def sampling(**kw):
    return Sampling(**({"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 4, "seed": 0} | kw))


def test_the_next_turn_waits_for_this_one_and_sees_only_the_regenerated_text(tokenizer):
    """Turn 2's prompt holds turn 1's regenerated text, never the source's; the feed waits (None) meanwhile."""
    rows_ = [("a:1", [{"from": "user", "value": "hello"}, {"from": "gpt", "value": "SOURCE ANSWER"}] * 2)]
    convs, _ = plan(rows_, False)
    regen = Regeneration(tokenizer, convs, sampling(), frozenset({1}), 200, {})
    feed = regen.feed()
    index, prompt, gen = next(feed)
    assert index == 0 and gen.max_new_tokens == 4 and gen.seed == sample_seed(0, 0)
    assert prompt == tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert next(feed) is None  # turn 2 waits for turn 1
    answer = tokenizer("fine thanks", add_special_tokens=False)["input_ids"]
    record = regen.complete(0, Generated(len(prompt), answer + [1], "stop"))
    assert record["text"] == "fine thanks" and record["finish_reason"] == "stop"
    index, prompt2, _ = next(feed)
    history = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "fine thanks"},
        {"role": "user", "content": "hello"},
    ]
    assert index == 1 and prompt2 == tokenizer.apply_chat_template(history, add_generation_prompt=True)
    assert "SOURCE" not in tokenizer.decode(prompt2)


def test_a_resume_starts_at_the_first_turn_not_written_with_the_written_text(tokenizer):
    """Written turns are not generated again; their recorded text is the history of the next one."""
    rows_ = [("a:1", [{"from": "user", "value": "hello"}, {"from": "gpt", "value": "SOURCE"}] * 2)]
    convs, _ = plan(rows_, False)
    regen = Regeneration(tokenizer, convs, sampling(), frozenset(), 200, {0: {"text": "from the journal"}})
    index, prompt, _ = next(regen.feed())
    assert index == 1 and "from the journal" in tokenizer.decode(prompt)


def test_a_turn_without_room_under_seq_length_is_cut_and_named(tokenizer):
    """A prompt that leaves no room for one new token is not generated; the feed says which and why."""
    convs, _ = plan([("a:1", [{"from": "user", "value": "hello there " * 20}, {"from": "gpt", "value": "x"}])], False)
    regen = Regeneration(tokenizer, convs, sampling(), frozenset(), 8, {})
    assert list(regen.feed()) == []
    assert regen.cut and regen.cut[0][0] == 0 and "--seq-length 8" in regen.cut[0][1]


def test_sampling_comes_from_generation_config_unless_given(tmp_path):
    """generation_config.json fills what is not given; do_sample false is greedy; no file needs --temperature."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    s = resolve_sampling(str(tmp_path), None, None, 5, None, 1)
    assert (s.temperature, s.top_p, s.top_k, s.from_model) == (0.6, 0.95, 5, ("temperature", "top_p"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert resolve_sampling(str(tmp_path), None, None, None, None, 1).temperature == 0.0
    (tmp_path / "generation_config.json").unlink()
    with pytest.raises(GenerationSetupError, match="no generation_config.json.*--temperature"):
        resolve_sampling(str(tmp_path), None, None, None, None, 1)
    assert resolve_sampling(str(tmp_path), 0.7, None, None, None, 1).top_p == 1.0


def test_per_sample_seeds_depend_on_the_run_seed_and_index_only():
    """Seeds are fixed by (seed, index): the same after a resume, distinct across samples."""
    assert sample_seed(3, 10) == sample_seed(3, 10)
    assert len({sample_seed(3, i) for i in range(1000)}) == 1000
    assert sample_seed(3, 10) != sample_seed(4, 10) and 0 <= sample_seed(3, 10) < 2**63


def test_the_templates_end_of_turn_and_generation_prompt(tokenizer):
    """ChatML's end of turn is <|im_end|>; a template without a generation prompt is refused."""
    assert end_of_turn_ids(tokenizer) == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    check_generation_prompt(tokenizer)
    plain = train_tokenizer(["a b c"], 280)
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    with pytest.raises(GenerationSetupError, match="no generation prompt"):
        check_generation_prompt(plain)


def test_the_journal_survives_a_torn_line_and_the_conversations_file_is_in_order(tmp_path):
    """A torn last line is ignored and the next append starts clean; later lines win; the file is sorted."""
    journal = regenerated.Journal(tmp_path)
    journal.append({"index": 1, "text": "b", "finish_reason": "stop"})
    journal.close()
    with (tmp_path / regenerated.JOURNAL).open("ab") as fh:
        fh.write(b'{"index": 0, "te')  # killed mid-line
    assert set(regenerated.read_journal(tmp_path)) == {1}
    journal = regenerated.Journal(tmp_path)
    journal.append({"index": 0, "text": "a", "finish_reason": "length"})
    journal.append({"index": 1, "text": "b2", "finish_reason": "stop"})
    journal.close()
    records = regenerated.read_journal(tmp_path)
    assert {i: r["text"] for i, r in records.items()} == {0: "a", 1: "b2"}
    convs, _ = plan([("x:1", [{"from": "user", "value": "q"}, {"from": "gpt", "value": "s"}] * 2)], False)
    lines = records_by_conversation(records, convs, sampling())
    assert [t["content"] for t in lines[0]["turns"]] == ["q", "a", "q", "b2"]
    assert lines[0]["turns"][1]["finish_reason"] == "length" and lines[0]["turns"][3]["sample"] == 1


def test_a_discarded_rows_generator_draws_nothing_and_the_batch_keeps_its_seeds():
    """CPU: a row whose sample vLLM discards gets a scratch generator (offset calls no-ops); its own comes back."""
    own = [torch.Generator().manual_seed(s) for s in (1, 2)]
    with pytest.raises(RuntimeError, match="does not use offset"):  # vLLM 0.16's wind-back, on a CPU generator
        own[1].set_offset(own[1].get_offset() - 4)
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=2, generators={0: own[0], 1: own[1]}),
        discard_request_mask=SimpleNamespace(np=np.array([False, True])),
    )
    before = own[1].get_state().clone()
    with discarded_generators_aside(runner):
        gens = runner.input_batch.generators
        assert gens[0] is own[0] and isinstance(gens[1], ScratchGenerator) and len(gens) == 2
        torch.empty(8).exponential_(generator=gens[1])
        gens[1].set_offset(gens[1].get_offset() - 4)  # what vLLM then does: nothing
    assert runner.input_batch.generators == {0: own[0], 1: own[1]}
    assert torch.equal(own[1].get_state(), before)
