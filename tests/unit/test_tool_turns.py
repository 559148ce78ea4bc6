"""--regenerate with tools, pure logic: rows with tool turns, the target's calls read from its text and matched
against the source's, the plan, the stop and its record, the chat template's refusal by rendering."""

import json

import pytest

from speculators_v016.engine.generation import Generated
from speculators_v016.run.dataset import BadRowError, load_rows
from speculators_v016.run.regenerate import Regeneration, Sampling, plan, records_by_conversation
from speculators_v016.run.tool_turns import (
    MAX_DEPTH,
    CallsUnreadable,
    called_names,
    mismatch,
    read_chat,
    template_refusal,
)
from speculators_v016.store import regenerated
from speculators_v016.testing.tiny_models import train_tokenizer

TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


@pytest.fixture(scope="module")
def tokenizer():
    """A tokenizer whose template renders tools (the tiny models' own ignores them)."""
    tok = train_tokenizer(["hello there how are you", "fine thanks", '{"name": "get_weather"}'], 300)
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def chat(called: str | None) -> dict:
    calls = [{"id": "c", "function": {"name": called, "arguments": "{}"}}] if called else None
    return {
        "tools": [WEATHER],
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None if calls else "no call", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"},
            {"role": "assistant", "content": "it is sunny"},
        ],
    }


def test_called_names_are_the_json_objects_with_name_and_arguments():
    """Calls in any markup: <tool_call> tags, a JSON list, an OpenAI function object, Llama's "parameters"."""
    assert called_names('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>') == ["a"]
    assert called_names('[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": "{}"}]') == ["a", "b"]
    assert called_names('{"type": "function", "function": {"name": "f", "arguments": {}}}') == ["f"]
    assert called_names('{"name": "g", "parameters": {"name": "inner", "arguments": {}}}') == ["g"]  # args not searched
    assert called_names('text {"name": "not a call"} {broken {"name": "c", "arguments": {}}') == ["c"]
    assert called_names("no call here { [ }") == []


def test_a_mismatch_is_other_names_or_counts_in_any_order():
    """Same names as many times each match in any order; a missing, extra or other call does not."""
    assert mismatch(["a", "b"], ["b", "a"]) is None and mismatch([], []) is None
    assert mismatch(["a"], []) == {"reason": "tool_call_mismatch", "expected": ["a"], "got": []}
    assert mismatch([], ["a"])["got"] == ["a"] and mismatch(["a"], ["a", "a"]) is not None
    assert mismatch(["a"], ["b"]) == {"reason": "tool_call_mismatch", "expected": ["a"], "got": ["b"]}


def test_rows_with_tools_in_both_forms_are_read(tmp_path):
    """OpenAI messages (content None beside tool_calls) and ShareGPT function_call / observation, tools as text."""
    sharegpt = {
        "tools": json.dumps([WEATHER]),
        "conversations": [
            {"from": "human", "value": "weather?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "x"}}'},
            {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "it is sunny"},
        ],
    }
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(chat("get_weather")) + "\n" + json.dumps(sharegpt) + "\n")
    _, rows, _, _ = load_rows([str(data)], False, None, reader=read_chat)
    convs, skipped = plan(rows, False)
    assert skipped == {} and [c.answers for c in convs] == [2, 2] and convs[1].tools == [WEATHER]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "x"}}}
    assert convs[1].turns[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert convs[1].turns[2] == {"role": "tool", "content": "sunny"}
    assert convs[0].turns[2]["content"] == "" and convs[0].turns[3]["tool_call_id"] == "c"
    with pytest.raises(BadRowError, match="r:1: turn 0 has a tool call without a string 'name'"):
        read_chat("r:1", {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]})
    with pytest.raises(BadRowError, match="r:2: 'tools' is a string that is not JSON"):
        read_chat("r:2", {"tools": "[oops", "messages": []})


def test_trailing_tool_results_get_one_answer(tokenizer):
    """A conversation ending on tool results gets them answered once, as a trailing user turn is."""
    row = read_chat("t:1", chat("get_weather"))
    row.turns = row.turns[:4]  # up to the tool result
    (conv,), _ = plan([("t:1", row)], False, tokenizer)
    assert [t["role"] for t in conv.turns] == ["system", "user", "assistant", "tool", "assistant"]
    assert conv.answers == 2 and conv.turns[-1]["content"] is None


def test_a_template_that_cannot_render_tools_is_named_by_rendering(tokenizer):
    """Ignored tools=, a template that raises on a tool turn, one that drops tool results: each a reason."""
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]
    tool = [*turns, {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "ok"}]
    assert template_refusal(tokenizer, tool, [WEATHER]) is None
    plain = train_tokenizer(["hello there"], 300)  # the tiny models' template: no tools
    assert "renders nothing for its tool definitions" in template_refusal(plain, turns, [WEATHER])
    assert template_refusal(plain, tool, None) is None  # tool turns it renders as any role
    plain.chat_template = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}" + (
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    assert "raises on its tools or tool turns (TemplateError: no tools)" in template_refusal(plain, tool, None)
    plain.chat_template = "{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{% endif %}{% endfor %}"
    assert "drops its tool results" in template_refusal(plain, tool, None)
    rows = [("a:1", read_chat("a:1", chat("get_weather")))]
    with pytest.raises(BadRowError, match="a:1: the chat template renders nothing for its tool definitions"):
        plan(rows, False, train_tokenizer(["hello"], 300))
    assert plan(rows, True, train_tokenizer(["hello"], 300)) == (
        [],
        {"the chat template cannot render its tools or tool turns": 1},
    )


def sampling():
    return Sampling(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=64, seed=0)


def test_a_matching_call_keeps_the_tool_result_in_the_next_prompt(tokenizer):
    """The target calls get_weather as the source did: the next prompt holds the tools and the tool result."""
    convs, _ = plan([("a:1", read_chat("a:1", chat("get_weather")))], False, tokenizer)
    regen = Regeneration(tokenizer, convs, sampling(), frozenset(), 512, {})
    feed = regen.feed()
    index, prompt, _ = next(feed)
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "weather?"}]
    assert prompt == tokenizer.apply_chat_template(history, tools=[WEATHER], add_generation_prompt=True)
    call = '{"name": "get_weather", "arguments": {}}'
    record = regen.complete(index, Generated(len(prompt), tokenizer(call)["input_ids"], "stop"))
    assert "stop" not in record and regen.cut == []
    index, prompt, _ = next(feed)
    history += [{"role": "assistant", "content": call}, {"role": "tool", "content": "sunny", "tool_call_id": "c"}]
    assert index == 1 and prompt == tokenizer.apply_chat_template(history, tools=[WEATHER], add_generation_prompt=True)


def test_a_different_call_stops_the_conversation_with_its_record(tokenizer):
    """No call where the source called get_weather: the turn is kept, the rest cut with why, the file says so."""
    convs, _ = plan([("a:1", read_chat("a:1", chat("get_weather")))], False, tokenizer)
    regen = Regeneration(tokenizer, convs, sampling(), frozenset(), 512, {})
    feed = regen.feed()
    index, prompt, _ = next(feed)
    record = regen.complete(index, Generated(len(prompt), tokenizer("fine thanks")["input_ids"], "stop"))
    assert record["stop"] == {"reason": "tool_call_mismatch", "expected": ["get_weather"], "got": [], "turn": 0}
    assert regen.cut == [(1, "tool_call_mismatch: turn 0 of a:1 calls [], the source's ['get_weather']")]
    assert list(feed) == [] and regen.stops == {"tool_call_mismatch": 1} and regen.shapes == {"one turn": 1}
    (line,) = records_by_conversation({0: record}, convs, sampling())
    assert [t["role"] for t in line["turns"]] == ["system", "user", "assistant"]
    assert line["stopped"]["kept_turns"] == 3 and line["tools"] == [WEATHER]
    resumed = Regeneration(tokenizer, convs, sampling(), frozenset(), 512, {0: record})
    assert list(resumed.feed()) == [] and resumed.cut == regen.cut  # a resume stops there again, from the ids


@pytest.mark.parametrize("text", ["[" * 1100, '{"a": ' * 1100, "<call>" + "[" * 1100 + "]" * 1100 + "</call>"])
def test_calls_in_text_nested_past_the_bound_are_unreadable_not_a_crash(text):
    """1,100 nested brackets (closed or not, arrays or objects): CallsUnreadable saying where, never RecursionError;
    nesting within MAX_DEPTH, brackets inside strings included, is read as before."""
    with pytest.raises(CallsUnreadable, match=rf"JSON nested deeper than {MAX_DEPTH} levels at character \d+"):
        called_names(text)
    deep = "[" * (MAX_DEPTH - 2) + '{"name": "a", "arguments": {}}' + "]" * (MAX_DEPTH - 2)  # MAX_DEPTH levels
    assert called_names(deep) == ["a"]
    assert called_names('{"name": "b", "arguments": {"q": "' + "[" * 5000 + '"}}') == ["b"]


def test_a_turn_whose_calls_cannot_be_read_stops_its_conversation_named_and_counted(tokenizer):
    """A generated turn of 1,100 nested brackets in a tool conversation: the conversation stops there (reason
    tool_call_unreadable, the row and turn named), the rest cut and counted; a resume stops there again."""
    convs, _ = plan([("chats.jsonl:7", read_chat("chats.jsonl:7", chat("get_weather")))], False, tokenizer)
    regen = Regeneration(tokenizer, convs, sampling(), frozenset(), 4096, {})
    feed = regen.feed()
    index, prompt, _ = next(feed)
    brackets = tokenizer("[" * 1100, add_special_tokens=False)["input_ids"]
    record = regen.complete(index, Generated(len(prompt), brackets, "stop"))
    assert record["stop"]["reason"] == "tool_call_unreadable" and record["stop"]["turn"] == 0
    assert record["stop"]["expected"] == ["get_weather"] and record["stop"]["got"] is None
    ((cut, why),) = regen.cut
    assert cut == 1 and why.startswith("tool_call_unreadable: turn 0 of chats.jsonl:7: its calls cannot be read")
    assert regenerated.not_generated(why) == regenerated.STOPPED
    assert list(feed) == [] and regen.stops == {"tool_call_unreadable": 1}
    (line,) = records_by_conversation({0: record}, convs, sampling())
    assert line["stopped"]["reason"] == "tool_call_unreadable" and line["stopped"]["kept_turns"] == 3
    resumed = Regeneration(tokenizer, convs, sampling(), frozenset(), 4096, {0: record})
    assert list(resumed.feed()) == [] and resumed.cut == regen.cut
