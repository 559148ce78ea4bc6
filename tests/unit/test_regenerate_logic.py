"""--regenerate's pure logic: stops, growing requests, the turn plan and feed, sampling, the journal."""

import copy
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_assembly import capture, rows

from speculators_v016.checks.self_check import HoldBack
from speculators_v016.engine.assembly import Assembler, AttributionError
from speculators_v016.engine.generation import Decoding, Generated, Generation
from speculators_v016.protocol import StepCapture
from speculators_v016.run.dataset import BadRowError
from speculators_v016.run.regenerate import (
    Regeneration,
    Sampling,
    Written,
    answer_slots,
    check_generation_prompt,
    end_of_turn_ids,
    plan,
    prompt_digest,
    records_by_conversation,
    resolve_sampling,
    sample_seed,
)
from speculators_v016.store import regenerated
from speculators_v016.store.atomic_files import write_atomic
from speculators_v016.store.sample_format import encode_parts
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
    with pytest.raises(BadRowError, match="role 'narrator'"):  # tool turns are known: tests/unit/test_tool_turns.py
        plan([("b:1", [{"from": "user", "value": "q"}, {"from": "narrator", "value": "t"}])], skip_bad_rows=False)


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


def exchange(count: int) -> list[tuple[str, list[dict]]]:
    """One conversation of ``count`` exchanges (the source's answers never shown)."""
    turns = []
    for i in range(count):
        turns += [{"from": "human", "value": f"hello there {i}"}, {"from": "gpt", "value": "SOURCE"}]
    return [("m:1", turns)]


def canonical(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_turns(regen: Regeneration, answers: list[list[int]]) -> list[dict]:
    """Feed and complete each turn in order with the given sampled ids; the records."""
    records, feed = [], regen.feed()
    for answer in answers:
        index, prompt, _ = next(feed)
        records.append(regen.complete(index, Generated(len(prompt), answer, "stop")))
    assert next(feed, "end") == "end"
    return records


def test_turns_the_template_renders_as_the_next_prompts_start_fold_into_one_sample(tokenizer):
    """ChatML keeps every turn as sampled (canonical ids + <|im_end|>): turns 0 and 1 fold into turn 2's sample,
    whose prompt holds each of them where it was sampled; the conversation counts as one sample."""
    convs, _ = plan(exchange(3), False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = [canonical(tokenizer, "fine thanks") + [end], canonical(tokenizer, "and you") + [end], [end]]
    regen = Regeneration(tokenizer, convs, sampling(), frozenset({end}), 200, {}, per_turn=False)
    records = run_turns(regen, answers)
    assert [r.get("in_later_sample", False) for r in records] == [True, True, False]
    assert records[2]["earlier_turns"] == [0, 1] and "earlier_turns" not in records[0]
    last = records[2]
    history = [{"role": "user", "content": "hello there 0"}, {"role": "assistant", "content": "fine thanks"}]
    history += [{"role": "user", "content": "hello there 1"}, {"role": "assistant", "content": "and you"}]
    history += [{"role": "user", "content": "hello there 2"}]
    final_prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True)
    assert last["prompt_tokens"] == len(final_prompt)
    for record in records[:2]:  # each folded turn's prompt + ids stand at the start of the final prompt
        start, ids = record["prompt_tokens"], record["token_ids"]
        assert final_prompt[start : start + len(ids)] == ids
        assert record["prompt_sha256"] == prompt_digest(final_prompt[:start])
    assert regen.shapes == {"one sample": 1}
    per_turn = Regeneration(tokenizer, convs, sampling(), frozenset({end}), 200, {})
    assert not any(r.get("in_later_sample") for r in run_turns(per_turn, answers))
    assert per_turn.shapes == {"one sample per turn": 1}


def test_ids_the_text_does_not_tokenize_back_to_keep_their_own_sample(tokenizer):
    """A turn sampled as pieces its text re-tokenizes otherwise (a merge across the pieces) is not folded: the
    next prompt would hold other ids than those sampled; the turn after it folds again."""
    convs, _ = plan(exchange(3), False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    whole = canonical(tokenizer, "thanks")
    pieces = [tokenizer.convert_tokens_to_ids(c) for c in "thanks"]
    assert len(whole) < len(pieces) and tokenizer.decode(pieces) == "thanks"
    regen = Regeneration(tokenizer, convs, sampling(), frozenset({end}), 200, {}, per_turn=False)
    records = run_turns(regen, [pieces + [end], canonical(tokenizer, "fine") + [end], [end]])
    assert [r.get("in_later_sample", False) for r in records] == [False, True, False]
    assert records[2]["earlier_turns"] == [1] and regen.shapes == {"split": 1}


def test_a_template_that_drops_earlier_reasoning_keeps_one_sample_per_turn(tokenizer):
    """A template that renders earlier assistant turns without their <think> part: no turn folds; one that keeps
    the reasoning folds them."""
    convs, _ = plan(exchange(2), False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = canonical(tokenizer, "<think>how are you</think>fine") + [end]
    assert tokenizer.decode(answer, skip_special_tokens=True) == "<think>how are you</think>fine"
    dropping = copy.deepcopy(tokenizer)
    dropping.chat_template = tokenizer.chat_template.replace(
        "{{ message['content'] }}",
        "{% if message['role'] == 'assistant' and not loop.last %}"
        "{{ message['content'].split('</think>')[-1] }}{% else %}{{ message['content'] }}{% endif %}",
    )
    for tok, folds in ((dropping, False), (tokenizer, True)):
        regen = Regeneration(tok, convs, sampling(), frozenset({end}), 200, {}, per_turn=False)
        records = run_turns(regen, [answer, [end]])
        assert bool(records[0].get("in_later_sample")) is folds


def test_a_turn_is_folded_only_into_a_turn_with_room_and_a_resume_takes_folded_turns(tokenizer):
    """A next prompt that reaches --seq-length: the turn keeps its sample (the next is cut). A resume takes a
    folded turn's recorded text under the same prompt, and generates it again under another."""
    convs, _ = plan(exchange(3), False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = canonical(tokenizer, "fine thanks") + [end]
    first = tokenizer.apply_chat_template([{"role": "user", "content": "hello there 0"}], add_generation_prompt=True)
    regen = Regeneration(tokenizer, convs, sampling(), frozenset({end}), len(first) + len(answer) + 3, {},
                         per_turn=False)  # fmt: skip
    feed = regen.feed()
    index, prompt, _ = next(feed)
    record = regen.complete(index, Generated(len(prompt), answer, "stop"))
    assert "in_later_sample" not in record and list(feed) == [] and [i for i, _ in regen.cut] == [1, 2]
    regen = Regeneration(tokenizer, convs, sampling(), frozenset({end}), 200, {}, per_turn=False)
    folded = run_turns(regen, [answer, answer, [end]])[0]
    resumed = Regeneration(tokenizer, convs, sampling(), frozenset({end}), 200, {0: folded}, per_turn=False)
    index, prompt, _ = next(resumed.feed())
    assert index == 1 and resumed.complete(1, Generated(len(prompt), answer, "stop"))["in_later_sample"]
    stale = {**folded, "prompt_sha256": "0" * 32}  # generated under a history since regenerated
    again = Regeneration(tokenizer, convs, sampling(), frozenset({end}), 200, {0: stale}, per_turn=False)
    assert next(again.feed())[0] == 0


def test_a_folded_checked_sample_hands_its_check_to_the_turn_holding_it():
    """HoldBack: a checked turn folded into the next one's sample waits for that sample instead."""
    put = []
    hold = HoldBack({3}, SimpleNamespace(release=lambda: None), [0], lambda *a: put.append(a))
    hold.hand_over(3, 4)
    hold.admit(9, 9, {"x": 1})
    assert hold.awaiting == {4} and put == []
    hold.forget([4])
    assert put == [(9, {"x": 1})]


def written_conversation(tokenizer):
    """Three exchanges, per --regenerate-samples auto: turn 0 folded into sample 1 (listed, its own file), turn 2 not
    written yet. Returns the plan, the two records, and sample 1's file ids."""
    convs, _ = plan(exchange(3), False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pieces = [tokenizer.convert_tokens_to_ids(c) for c in "thanks"]  # its text tokenizes otherwise: not folded
    regen = Regeneration(tokenizer, convs, sampling(), frozenset({end}), 200, {}, per_turn=False)
    feed, records, prompts = regen.feed(), [], []
    for answer in (canonical(tokenizer, "fine thanks") + [end], pieces + [end]):
        index, prompt, _ = next(feed)
        prompts.append(prompt)
        records.append(regen.complete(index, Generated(len(prompt), answer, "stop")))
    assert records[0]["in_later_sample"] and records[1]["earlier_turns"] == [0]
    return convs, end, records, prompts[1] + records[1]["token_ids"]


def resumed(tokenizer, convs, end, records, file_ids, holders=None):
    written = Written({1: file_ids}.__getitem__, {0: 1} if holders is None else holders)
    done = {r["index"]: r for r in records}
    return Regeneration(tokenizer, convs, sampling(), frozenset({end}), 200, done, per_turn=False, written=written)


def test_a_resume_takes_written_turns_that_still_match_their_sample(tokenizer):
    """Untouched records: the resume goes on at turn 2, its prompt holding turn 0's and turn 1's text."""
    convs, end, records, file_ids = written_conversation(tokenizer)
    index, prompt, _ = next(resumed(tokenizer, convs, end, records, file_ids).feed())
    start = records[1]["prompt_tokens"]  # turn 1's prompt (turn 0 in it as sampled) starts turn 2's
    assert index == 2 and prompt[:start] == file_ids[:start] and "thanks" in tokenizer.decode(prompt[start:])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r, t: r[0].update(text=r[0]["text"] + " INJECTED"), "sample 0: its text is not what its sampled ids"),
        (lambda r, t: r[0].update(prompt_sha256="0" * 32), "sample 0, a turn folded into listed sample 1, no longer"),
        (
            lambda r, t: r[0].update(text="fine thanks INJECTED", token_ids=canonical(t, "fine thanks INJECTED")),
            "record of sample 0 does not match listed sample 1",
        ),
        (lambda r, t: r[1].update(text="thanks INJECTED"), "sample 1: its text is not what its sampled ids decode to"),
        (lambda r, t: r[0].update(prompt_tokens=r[0]["prompt_tokens"] + 1), "sample 0 does not match listed sample 1"),
    ],
)
def test_a_resume_refuses_a_written_turn_whose_record_was_edited(tokenizer, edit, message):
    """A folded turn held by a listed sample, or a listed turn, whose record was edited (its text, its prompt digest,
    text and ids together, its prompt length): JournalError naming the record, never a next prompt holding it."""
    convs, end, records, file_ids = written_conversation(tokenizer)
    edit(records, tokenizer)
    with pytest.raises(regenerated.JournalError, match=message):
        resumed(tokenizer, convs, end, records, file_ids)


def test_a_resume_refuses_a_listed_sample_that_no_longer_holds_its_history(tokenizer):
    """Sample 1's file holding other prompt ids than the history rendered from the records: refused naming both."""
    convs, end, records, file_ids = written_conversation(tokenizer)
    changed = list(file_ids)
    changed[3] = changed[3] + 1
    with pytest.raises(regenerated.JournalError, match="sample 0 does not match listed sample 1"):
        resumed(tokenizer, convs, end, records, changed)


def test_a_folded_turn_no_listed_sample_holds_is_generated_again_under_another_prompt(tokenizer):
    """A killed run's folded turn (no listed sample holds it) whose prompt digest differs: generated again, as
    before; its text is still checked."""
    convs, end, records, file_ids = written_conversation(tokenizer)
    stale = {**records[0], "prompt_sha256": "0" * 32}
    again = resumed(tokenizer, convs, end, [stale], file_ids, holders={})
    assert next(again.feed())[0] == 0
    with pytest.raises(regenerated.JournalError, match="sample 0: its text is not what"):
        resumed(tokenizer, convs, end, [{**records[0], "text": "edited"}], file_ids, holders={})


def test_verify_names_an_edited_prompt_digest_and_a_prompt_built_on_an_edited_turn(tokenizer, tmp_path):
    """Sample 1 (holding folded turn 0) and sample 2 written as a resume that took turn 0's edited text as history
    would write them: sample_problems names turn 0's edited prompt_sha256; history_problems names sample 2, whose
    prompt (and so its states) holds text the target never wrote, and nothing in the untouched folder."""
    convs, end, records, file_ids = written_conversation(tokenizer)
    edited = "fine thanks INJECTED"
    history = [{"role": "user", "content": "hello there 0"}, {"role": "assistant", "content": edited}]
    history += [{"role": "user", "content": "hello there 1"}, {"role": "assistant", "content": "thanks"}]
    history += [{"role": "user", "content": "hello there 2"}]
    prompt2 = tokenizer.apply_chat_template(history, add_generation_prompt=True)
    third = {**records[1], "index": 2, "turn": 2, "prompt_tokens": len(prompt2), "token_ids": [end], "text": ""}
    third.pop("earlier_turns")
    journal = {0: records[0], 1: records[1], 2: third}
    paths = {}
    for index, ids in ((1, file_ids), (2, prompt2 + [end])):
        mask = torch.zeros(len(ids), dtype=torch.long)
        for record in [journal[index], *(journal[i] for i in journal[index].get("earlier_turns", []))]:
            mask[record["prompt_tokens"] : record["prompt_tokens"] + len(record["token_ids"])] = 1
        sample = {"input_ids": torch.tensor(ids), "loss_mask": mask, "hidden_states": [torch.ones(len(ids), 4)]}
        write_atomic(tmp_path, f"data_{index}.safetensors", encode_parts(sample, "safetensors", [1]))
        paths[index] = tmp_path / f"data_{index}.safetensors"
    lines = records_by_conversation({1: records[1], 0: records[0]}, convs, sampling())
    regenerated.write_conversations(tmp_path, lines)
    assert regenerated.history_problems(tmp_path, journal, {1: paths[1]}, tokenizer) == []
    lines = records_by_conversation({**journal, 0: {**records[0], "text": edited}}, convs, sampling())
    regenerated.write_conversations(tmp_path, lines)
    (problem,) = regenerated.history_problems(tmp_path, journal, paths, tokenizer)
    assert problem.startswith(f"{paths[2]}: the prompt of turn 2 is not its conversation's history as the target")
    assert regenerated.sample_problems(paths[1], records[1], journal) == []
    stale = {**journal, 0: {**records[0], "prompt_sha256": "0" * 32}}
    assert any("turn 0 folded into it: its regenerated.journal.jsonl record's prompt_sha256 is not" in p
               for p in regenerated.sample_problems(paths[1], records[1], stale))  # fmt: skip
