"""Tool use under ``--regenerate``: a row's tool definitions, tool calls and tool results, and the calls the
target's regenerated turns make.

Rows (:func:`read_chat`): OpenAI-style ``messages`` (a row-level ``tools`` list of definitions, assistant turns
with ``tool_calls`` and possibly no ``content``, ``tool`` turns with ``tool_call_id``/``name``) and the ShareGPT
``conversations`` form (``from: function_call`` whose ``value`` is the call as JSON, ``from: observation`` /
``tool`` / ``function`` for its result, ``tools`` as a list or as a JSON string of one).

A target's call (:func:`called_names`) is read from the text of its turn decoded with its special tokens, so
whatever markup the template wraps calls in (``<tool_call>``, ``[TOOL_CALLS]``, a code fence or none): every
JSON object in the text with a string ``"name"`` and an ``"arguments"`` or ``"parameters"`` member is a call of
that name (at any depth: ``{"function": {"name": ..., "arguments": ...}}`` counts, a call's own arguments are
not searched). A regenerated turn matches its source turn (:func:`mismatch`) when both call the same names, as
many times each, in any order (no call on both sides included).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from speculators_v016.run.dataset import BadRowError, raw_turns

#: turn roles (ShareGPT's ``from`` or the chat format's ``role``) that hold a tool's result
RESULT_ROLES = frozenset({"tool", "observation", "function", "function_response"})
#: the ShareGPT role of an assistant turn that is a call, its ``value`` the call as JSON
CALL_ROLE = "function_call"
#: why a conversation stopped, as regenerated.jsonl and the journal say it
MISMATCH = "tool_call_mismatch"

_DECODER = json.JSONDecoder()


@dataclass
class ChatRow:
    """A row's turns (``from``/``value`` dicts, with ``tool_calls``, ``tool_call_id``, ``name`` where given) and
    its tool definitions (None: none)."""

    turns: list[dict]
    tools: list[dict] | None = None


def _tools(where: str, row: dict) -> list[dict] | None:
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError:
            raise BadRowError(f"{where}: 'tools' is a string that is not JSON") from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRowError(f"{where}: 'tools' must be a list of tool definitions (objects)")
    return tools


def _call(where: str, i: int, call) -> dict:
    """One call as the chat format holds it: ``{"type": "function", "function": {"name", "arguments"}}``."""
    function = call.get("function", call) if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise BadRowError(f"{where}: turn {i} has a tool call without a string 'name'")
    arguments = function.get("arguments", function.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # kept as the source wrote it
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call, dict) and isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _calls(where: str, i: int, turn: dict, role: str, content) -> list[dict] | None:
    calls = turn.get("tool_calls")
    if role == CALL_ROLE and calls is None:
        try:
            calls = json.loads(content)
        except (TypeError, ValueError):
            raise BadRowError(f"{where}: turn {i} ({CALL_ROLE}) does not hold its call as JSON") from None
        calls = calls if isinstance(calls, list) else [calls]
    if calls is None:
        return None
    if not isinstance(calls, list) or not calls:
        raise BadRowError(f"{where}: turn {i} has 'tool_calls' that is not a non-empty list")
    return [_call(where, i, c) for c in calls]


def read_chat(where: str, row) -> ChatRow:
    """The row's turns and tool definitions, or BadRowError naming the row and turn."""
    out = []
    for i, (turn, role, content) in enumerate(raw_turns(where, row)):
        calls = _calls(where, i, turn, role.lower(), content)
        if role.lower() == CALL_ROLE:
            content = ""  # the call is its tool_calls
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise BadRowError(f"{where}: turn {i} needs string 'from'/'role' and 'value'/'content' (or 'tool_calls')")
        read = {"from": role, "value": content}
        if calls:
            read["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if role.lower() in RESULT_ROLES and isinstance(turn.get(key), str):
                read[key] = turn[key]
        out.append(read)
    return ChatRow(out, _tools(where, row))


def expected_names(turn: dict) -> list[str]:
    """The tools a source assistant turn calls (its ``tool_calls``' names, in order)."""
    return [c["function"]["name"] for c in turn.get("tool_calls") or ()]


def called_names(text: str) -> list[str]:
    """The tools ``text`` calls, in order: the ``"name"`` of every JSON object in it with a string ``"name"`` and an
    ``"arguments"`` or ``"parameters"`` member (see the module's docstring)."""
    names: list[str] = []
    at = 0
    while True:
        starts = [p for p in (text.find("{", at), text.find("[", at)) if p >= 0]
        if not starts:
            return names
        at = min(starts)
        try:
            value, end = _DECODER.raw_decode(text, at)
        except ValueError:
            at += 1
            continue
        _collect(value, names)
        at = end


def _collect(value, names: list[str]) -> None:
    if isinstance(value, list):
        for item in value:
            _collect(item, names)
    elif isinstance(value, dict):
        if isinstance(value.get("name"), str) and ("arguments" in value or "parameters" in value):
            names.append(value["name"])
            return
        for item in value.values():
            _collect(item, names)


def mismatch(expected: list[str], got: list[str]) -> dict | None:
    """None where the regenerated turn calls what the source turn called (same names, as many times each, any
    order); else why the conversation stops there."""
    if sorted(expected) == sorted(got):
        return None
    return {"reason": MISMATCH, "expected": list(expected), "got": list(got)}


def uses_tools(turns: list[dict], tools) -> bool:
    """Does a conversation carry tool definitions, tool calls or tool results (only then are calls compared)?"""
    return bool(tools) or any(t.get("tool_calls") or t["role"] == "tool" for t in turns)


def template_refusal(tokenizer, turns: list[dict], tools: list[dict] | None) -> str | None:
    """Why the chat template cannot render this conversation's tools or tool turns, by rendering it (None: it can).

    The history is rendered as regeneration renders it (its assistant turns a placeholder answer): the template
    must not raise, must render something for ``tools=`` (a template that ignores them would hide the
    definitions from the target), and must hold every tool result's text."""
    probe = [
        {"role": "assistant", "content": "probe answer"} if t["role"] == "assistant" else _message(t) for t in turns
    ]
    first = next(i for i, t in enumerate(turns) if t["role"] == "assistant")
    try:
        text = tokenizer.apply_chat_template(probe, tools=tools, tokenize=False)
        if tools:
            with_tools = tokenizer.apply_chat_template(
                probe[:first], tools=tools, tokenize=False, add_generation_prompt=True
            )
            without = tokenizer.apply_chat_template(probe[:first], tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the template's own error names the row
        return f"the chat template raises on its tools or tool turns ({type(exc).__name__}: {str(exc)[:200]})"
    if tools and with_tools == without:
        return "the chat template renders nothing for its tool definitions (tools=): the target would not see them"
    lost = [t for t in turns if t["role"] == "tool" and t["content"] and t["content"] not in text]
    if lost:
        return f"the chat template drops its tool results (e.g. {lost[0]['content'][:60]!r})"
    return None


def _message(turn: dict) -> dict:
    """A source turn as the template takes it in a history (a tool result with its call's id and name)."""
    return {k: v for k, v in turn.items() if k in ("role", "content", "tool_call_id", "name")}
