"""Tool use: whether the chat template renders a row's tool definitions and tool turns
(:func:`template_refusal`, for prefilled samples and ``--regenerate``), and the calls the target's regenerated
turns make.

Rows with tools are read by :mod:`speculators_v016.run.turns` (:func:`read_chat`, re-exported here): OpenAI-style
``messages`` (a row-level ``tools`` list of definitions, assistant turns with ``tool_calls`` and possibly no
``content``, ``tool`` turns with ``tool_call_id``/``name``) and the ShareGPT ``conversations`` form
(``from: function_call`` whose ``value`` is the call as JSON, ``from: observation`` / ``tool`` / ``function`` for
its result, ``tools`` as a list or as a JSON string of one).

A target's call (:func:`called_names`) is read from the text of its turn decoded with its special tokens, so
whatever markup the template wraps calls in (``<tool_call>``, ``[TOOL_CALLS]``, a code fence or none): every
JSON object in the text with a string ``"name"`` and an ``"arguments"`` or ``"parameters"`` member is a call of
that name (at any depth: ``{"function": {"name": ..., "arguments": ...}}`` counts, a call's own arguments are
not searched). A regenerated turn matches its source turn (:func:`mismatch`) when both call the same names, as
many times each, in any order (no call on both sides included).

The text is the target's own, so its search is bounded: before a value is decoded, a scan of its brackets
(strings skipped, in the regular-expression engine) measures how deep it nests; a turn whose text nests deeper
than :data:`MAX_DEPTH` (a real call nests a few levels; 1,100 ``[`` would exhaust the JSON decoder's recursion)
raises :class:`CallsUnreadable` instead of being decoded, and its conversation stops there (:data:`UNREADABLE`,
counted as other stops are).
"""

from __future__ import annotations

import json
import re

from speculators_v016.run.turns import CALL_ROLE as CALL_ROLE  # re-exported: the reading of rows is run.turns
from speculators_v016.run.turns import RESULT_ROLES as RESULT_ROLES
from speculators_v016.run.turns import ChatRow as ChatRow
from speculators_v016.run.turns import read_chat as read_chat

#: why a conversation stopped, as regenerated.jsonl and the journal say it
MISMATCH = "tool_call_mismatch"
#: the skip reason of a row whose tools or tool turns the chat template cannot render (--skip-bad-rows)
TOOLS_REFUSED = "the chat template cannot render its tools or tool turns"
UNREADABLE = "tool_call_unreadable"  # its text nests JSON deeper than MAX_DEPTH: its calls are not read
#: the deepest JSON nesting a turn's text may hold for its calls to be read
MAX_DEPTH = 64

_DECODER = json.JSONDecoder()
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a JSON string (skipped whole), or a bracket


class CallsUnreadable(ValueError):
    """A turn's text nests JSON deeper than :data:`MAX_DEPTH`: its calls are not read (the message says where)."""


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
        if _nests_deeper(text, at, MAX_DEPTH):
            raise CallsUnreadable(f"JSON nested deeper than {MAX_DEPTH} levels at character {at} of {len(text)}")
        try:
            value, end = _DECODER.raw_decode(text, at)
        except ValueError:
            at += 1
            continue
        except RecursionError:  # not reached after the scan above; never a crash if it were
            raise CallsUnreadable(f"JSON nested too deeply to decode at character {at} of {len(text)}") from None
        _collect(value, names)
        at = end


def _nests_deeper(text: str, start: int, limit: int) -> bool:
    """Does the bracket at ``start`` open more than ``limit`` levels before it closes (JSON strings skipped)? Stops
    at the first level past ``limit``, or where it closes: a decode from ``start`` reads no deeper than this."""
    depth = 0
    for match in _STRUCTURE.finditer(text, start):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return True
        elif token in "]}":
            depth -= 1
            if depth == 0:
                return False
    return False


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
