"""--regenerate on conversations with a system prompt, tool definitions and tool turns, on CPU vLLM.

The tiny Llama gets a chat template of ours that renders tool definitions and tool results. A random tiny
model never writes a tool call, so the runs that need one load a logits processor into the real engine
(speculators_v016/testing/forced_tokens.py) that forces the first tokens of each turn whose prompt holds no
tool result to a call of ``get_weather``: the engine samples those ids itself, and the capture, the stop
decision, the journal and the samples are the run's own. A turn whose prompt holds a tool result is the
model's own (random) text, which calls nothing.
"""

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from helpers.cli import invoke, load_all, write_jsonl
from speculators_v016.run.tool_turns import called_names
from speculators_v016.store.regenerated import STOPPED
from speculators_v016.testing import forced_tokens

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    'Call a tool as <call>{"name": ..., "arguments": ...}</call>. Tools:\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}{% if not (loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL = '<call>{"name": "get_weather", "arguments": {"city": "Paris"}}</call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "the time", "parameters": {}}}
SAMPLING = ["--regenerate", "--temperature", "0", "--max-new-tokens", "64", "--seed", "5"]


def tool_chat(called: str) -> dict:
    """System, tools, a user turn, the source's call of ``called``, its result and a final answer."""
    return {
        "tools": [WEATHER, TIME],
        "messages": [
            {"role": "system", "content": "you can look things up"},
            {"role": "user", "content": "what is the weather in paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": called, "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny and 21 degrees"},
            {"role": "assistant", "content": "it is sunny"},
            {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "you are welcome"},
        ],
    }


@pytest.fixture(scope="module")
def tools_model(model_dir, tmp_path_factory):
    """The tiny Llama with a chat template that renders tools and tool results."""
    out = tmp_path_factory.mktemp("tools-model") / "llama"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def forcing(model) -> dict:
    """The environment forcing CALL (then the end of turn) in each turn whose prompt holds no tool result."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    force = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    unless = tokenizer("<|im_start|>tool", add_special_tokens=False)["input_ids"]
    return {forced_tokens.VARIABLE: json.dumps({"force": force, "unless_prompt_has": unless})}


def run(model, rows, out, *extra, env=None):
    """The real command on ``rows`` (or the data file of that name, where a path is given)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    data = rows if isinstance(rows, Path) else write_jsonl(out.parent / "chats.jsonl", rows)
    engine = json.dumps({"logits_processors": [forced_tokens.SPEC]})
    return invoke("--target-model-path", model, "--train-data-path", data, "--output-dir", out, "--seq-length", 1024,
                  "--token-freq-path", "", "--max-num-seqs", 2, "--engine-args", engine, *SAMPLING, *extra,
                  env=env)  # fmt: skip


@pytest.fixture(scope="module")
def forced_run(tools_model, tmp_path_factory):
    """One run of two conversations: the source calls get_weather (the target's call matches) and get_time."""
    out = tmp_path_factory.mktemp("forced") / "out"
    result = run(tools_model, [tool_chat("get_weather"), tool_chat("get_time")], out, env=forcing(tools_model))
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in (out / "regenerated.jsonl").read_text().splitlines()]
    return {"out": out, "output": result.output, "lines": {line["source"].rsplit(":", 1)[1]: line for line in lines}}


def test_a_matching_tool_call_keeps_the_conversation_whole(forced_run, tools_model):
    """The target calls the tool the source called: every turn generated, the tool result kept in its history."""
    line = forced_run["lines"]["1"]
    assert "stopped" not in line and line["tools"] == [WEATHER, TIME]
    roles = [t["role"] for t in line["turns"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert line["turns"][3] == {"role": "tool", "content": "sunny and 21 degrees", "tool_call_id": "c1"}
    assert CALL in line["turns"][2]["content"] and called_names(line["turns"][2]["content"]) == ["get_weather"]
    assert not any(called_names(t["content"]) for t in line["turns"][4::2])  # the model's own text
    tokenizer = AutoTokenizer.from_pretrained(tools_model)
    samples = load_all(forced_run["out"])
    holder = line["turns"][4]["sample"]  # the sample holding the answer after the tool result
    history = [{k: v for k, v in t.items() if k in ("role", "content", "tool_call_id")} for t in line["turns"][:4]]
    prompt = tokenizer.apply_chat_template(history, tools=line["tools"], add_generation_prompt=True)
    assert samples[holder]["input_ids"][: len(prompt)].tolist() == prompt  # tools and tool result in the prompt
    assert "sunny and 21 degrees" in tokenizer.decode(prompt) and "get_time" in tokenizer.decode(prompt)


def test_a_different_tool_call_stops_the_conversation_there(forced_run):
    """The target calls get_weather where the source called get_time: the turn is kept, the rest not generated."""
    line = forced_run["lines"]["2"]
    assert [t["role"] for t in line["turns"]] == ["system", "user", "assistant"]
    assert line["stopped"] == {
        "reason": "tool_call_mismatch",
        "expected": ["get_time"],
        "got": ["get_weather"],
        "turn": 0,
        "kept_turns": 3,
        "source_turns": 7,
    }
    assert "sunny" not in json.dumps(line["turns"])  # the source's tool result for get_time is not kept
    summary = json.loads((forced_run["out"] / "data_config.json").read_text())["speculators_v016"]["last_run"]
    assert summary["skipped"] == {STOPPED: 2} and summary["stopped"] == {"tool_call_mismatch": 1}
    assert "stopped:    1 conversations at a tool call (1 tool_call_mismatch)" in forced_run["output"]
    assert "verify:     ok" in forced_run["output"], forced_run["output"]


def test_a_finished_run_with_a_stopped_conversation_runs_again_as_a_no_op(forced_run, tools_model, tmp_path):
    """Run again: the turns after the stop are not generated again, nothing for the engine, counted, verified."""
    out = tmp_path / "out"
    shutil.copytree(forced_run["out"], out)
    before = (out / "regenerated.jsonl").read_bytes()
    again = run(tools_model, forced_run["out"].parent / "chats.jsonl", out, env=forcing(tools_model))
    assert again.exit_code == 0, again.output
    assert "nothing to generate: the 2 turns not written follow a tool call other than the source's" in again.output
    assert (out / "regenerated.jsonl").read_bytes() == before
    summary = json.loads((out / "data_config.json").read_text())["speculators_v016"]["last_run"]
    assert summary["skipped"] == {STOPPED: 2} and summary["stopped"] == {"tool_call_mismatch": 1}
    assert "verify:     ok" in again.output, again.output


def test_a_template_that_cannot_render_tools_refuses_the_row(model_dir, tmp_path):
    """The tiny Llama's own template ignores tools=: the row is refused by file:line, or skipped and counted."""
    rows = [{"messages": [{"role": "user", "content": "hello"}]}, tool_chat("get_weather")]
    refused = run(model_dir, rows, tmp_path / "a" / "out")
    assert refused.exit_code == 3, refused.output
    assert "chats.jsonl:2: the chat template renders nothing for its tool definitions (tools=)" in refused.output
    skipped = run(model_dir, rows, tmp_path / "b" / "out", "--skip-bad-rows")
    assert skipped.exit_code == 0, skipped.output
    summary = json.loads((tmp_path / "b" / "out" / "data_config.json").read_text())["speculators_v016"]["last_run"]
    assert summary["skipped"] == {"the chat template cannot render its tools or tool turns": 1}
    assert summary["written"] == 1


def test_a_turn_of_1100_nested_brackets_stops_its_conversation_and_the_run_goes_on(tools_model, tmp_path):
    """The engine forced to write 1,100 nested ``[`` as a tool conversation's first turn: that conversation stops
    there (tool_call_unreadable, its row named in the log and on the terminal, its turns after it counted), the
    plain conversation beside it is written whole, exit 0, verified; the run again is a no-op (no recursion)."""
    tokenizer = AutoTokenizer.from_pretrained(tools_model)
    force = tokenizer("[" * 1100, add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    unless = tokenizer("<|im_start|>tool", add_special_tokens=False)["input_ids"]
    env = {forced_tokens.VARIABLE: json.dumps({"force": force, "unless_prompt_has": unless})}
    plain = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    out, longer = tmp_path / "out", ["--seq-length", 2048, "--max-new-tokens", 1200]
    result = run(tools_model, [tool_chat("get_weather"), plain], out, *longer, env=env)
    assert result.exit_code == 0, result.output
    assert "tool_call_unreadable: turn 0 of " in result.output and "chats.jsonl:1: its calls cannot be read" in (
        result.output
    ), result.output
    assert "stopped:    1 conversations at a tool call (1 tool_call_unreadable)" in result.output
    assert "verify:     ok" in result.output, result.output
    lines = {line["source"].rsplit(":", 1)[1]: line for line in map(json.loads, (out / "regenerated.jsonl").open())}
    assert lines["1"]["stopped"]["reason"] == "tool_call_unreadable" and lines["1"]["stopped"]["turn"] == 0
    assert lines["2"]["turns"][-1]["content"] == "[" * 1100 and "stopped" not in lines["2"]  # no tools: not read
    summary = json.loads((out / "data_config.json").read_text())["speculators_v016"]["last_run"]
    assert summary["skipped"] == {STOPPED: 2} and summary["stopped"] == {"tool_call_unreadable": 1}
    assert len(load_all(out)) == 2  # the plain turn, and the tool conversation's turn 0 (kept, as a stopping turn is)
    again = run(tools_model, out.parent / "chats.jsonl", out, *longer, env=env)
    assert again.exit_code == 0 and "nothing to generate: the 2 turns not written" in again.output, again.output
    assert "verify:     ok" in again.output, again.output
