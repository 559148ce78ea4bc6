"""A conversation row's turns, read one way for every path (prefilled samples and ``--regenerate``).

Rows: ShareGPT ``conversations`` (``from``/``value``) or ``messages`` (``role``/``content``); tool use in either
form (:func:`read_chat`): a row-level ``tools`` list of definitions (or a JSON string of one), assistant turns with
``tool_calls`` (and possibly no ``content``), ShareGPT's ``function_call`` turn whose ``value`` is the call as JSON,
and tool results (``tool``, ``observation``, ``function``, ``function_response``, with ``tool_call_id``/``name``).

A turn's role is read without regard to case (``Human``, ``GPT``, ``USER`` are ``human``, ``gpt``, ``user``) from
:data:`ROLES`: ShareGPT's names, OpenAI's (``developer`` excepted: see :data:`REFUSED_ROLES`), and the assistant
names ShareGPT dumps carry (``model``, ``chatgpt``, ``bing``, ``bard``). Any other role is a :class:`BadRowError`
naming the row, the turn and the role (:func:`chat_role`): a turn is never dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


class BadRowError(ValueError):
    """A dataset row that cannot be used; the message names file and line. ``reason``: what
    ``--skip-bad-rows`` counts it as."""

    def __init__(self, message: str, reason: str = "bad row"):
        super().__init__(message)
        self.reason = reason


#: the ShareGPT role of an assistant turn that is a call, its ``value`` the call as JSON
CALL_ROLE = "function_call"
#: turn roles (ShareGPT's ``from`` or the chat format's ``role``) that hold a tool's result
RESULT_ROLES = frozenset({"tool", "observation", "function", "function_response"})

#: a turn's role (lower case) -> the chat template's
ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
    CALL_ROLE: "assistant",
    **dict.fromkeys(RESULT_ROLES, "tool"),
}

#: roles known but not read, with why (lower case)
REFUSED_ROLES = {
    "developer": "OpenAI's developer role: templates differ on it (some have none, gpt-oss's is not its system "
    "prompt); rename it to 'system' where the target should read it as its system prompt",
}

#: what --skip-bad-rows counts a row with a role that is not read as
UNKNOWN_ROLE = "unknown turn role"
#: what --skip-bad-rows counts a row holding a field that would change the sample and is not read as
UNREAD_FIELD = "a field that is not read"

#: a turn's keys that are read (:func:`read_chat`); any other with a value is refused, never dropped
TURN_KEYS = frozenset({"from", "value", "role", "content", "tool_calls", "tool_call_id", "name"})
#: a turn key read as its default only, on an assistant turn: ``weight`` 1 (FastChat's, axolotl's and SlimOrca's
#: "train on this turn", which every assistant turn here is); another weight there (0: an answer not to train on)
#: is refused; on the other turns, never trained, any weight changes nothing
DEFAULT_ONLY = {"weight": 1}
#: row keys holding media (LLaMA-Factory's plural columns, LLaVA's singular ones): the sample would hold the text
#: alone
MEDIA_KEYS = ("images", "videos", "audios", "image", "video", "audio")
#: how rows are read into turns, for the records that decide whether a folder or a cached index is this reading's
#: (the resume fingerprint, the prepared-rows cache's key): rows read by the rules before it were read otherwise
READ_RULES = "turns-2: a row's system prompt its first turn; fields not read, media and conflicting keys refused"
#: the row key of a system prompt beside the turns (LLaMA-Factory's ShareGPT format): read as the first turn
SYSTEM_KEY = "system"


def _empty(value) -> bool:
    """Null, or an empty string, list or object (what exporters leave in unused fields); any other value is one."""
    return value is None or (isinstance(value, (str, list, tuple, dict)) and len(value) == 0)


def _unread(where: str, i: int, turn: dict, role: str) -> None:
    """BadRowError naming turn ``i``'s keys with a value that :func:`read_chat` does not read (``name`` is read on a
    tool's result only; ``weight`` changes nothing but on an assistant turn); a key left empty (null, "", [], {},
    as exporters write them) is nothing to lose."""
    read = TURN_KEYS if role in RESULT_ROLES else TURN_KEYS - {"name"}
    answer = ROLES.get(role) == "assistant"

    def default(key, value) -> bool:
        return key in DEFAULT_ONLY and (not answer or (type(value) in (int, float) and value == DEFAULT_ONLY[key]))

    unread = sorted(k for k, v in turn.items() if k not in read and not _empty(v) and not default(k, v))
    if unread:
        raise BadRowError(
            f"{where}: turn {i} holds {', '.join(repr(k) for k in unread)}, which is not read: the sample would be "
            "made without it (a turn's fields read: from/role, value/content, tool_calls, and on a tool's result "
            "tool_call_id and name; weight only as 1); fold it into the content as the chat template would render "
            "it, or drop the field",
            UNREAD_FIELD,
        )


def _no_media(where: str, row: dict) -> None:
    """BadRowError where the row holds media (:data:`MEDIA_KEYS`, not empty): the sample would hold its text alone."""
    for key in MEDIA_KEYS:
        if not _empty(row.get(key)):
            raise BadRowError(
                f"{where}: the row holds {key!r}, which is not read: the sample would hold its text alone", UNREAD_FIELD
            )


def _system(where: str, row: dict, turns: list) -> dict | None:
    """The row's ``system`` prompt as its first turn, where given and not empty (None: none, or the same prompt as
    the first turn's); BadRowError where it is not a string or the turns open with another system prompt (which of
    the two is meant cannot be told)."""
    system = row.get(SYSTEM_KEY)
    if _empty(system):
        return None
    if not isinstance(system, str):
        raise BadRowError(f"{where}: 'system' must be a string (the system prompt), got {type(system).__name__}")
    if not (turns and turns[0][1].lower() == "system"):
        return {"from": "system", "value": system}
    if turns[0][2] != system:
        raise BadRowError(
            f"{where}: the row holds both a 'system' prompt and a system turn: which one the target should read "
            "cannot be told; keep one",
            UNREAD_FIELD,
        )
    return None  # the same prompt, given twice: read once


def chat_role(where: str, i: int, given: str) -> str:
    """The chat template's role of turn ``i`` (role ``given``, any case), or BadRowError naming it."""
    role = ROLES.get(given.lower())
    if role is not None:
        return role
    why = REFUSED_ROLES.get(given.lower())
    read = ", ".join(sorted(ROLES))
    raise BadRowError(
        f"{where}: turn {i} has role {given!r}, which is not read ({why}; roles read, in any case: {read})"
        if why
        else f"{where}: turn {i} has role {given!r}, which is not read (roles read, in any case: {read})",
        UNKNOWN_ROLE,
    )


def _one_of(where: str, holder: dict, first: str, second: str, what: str) -> None:
    """BadRowError where ``holder`` gives both keys different values, neither null (an empty one too: ``"value":
    ""`` beside a ``content``): ShareGPT's and OpenAI's names for one thing, of which only ``first`` would be read
    (the other dropped without a word)."""
    a, b = holder.get(first), holder.get(second)
    if a is not None and b is not None and a != b:
        raise BadRowError(
            f"{where}: {what} holds both {first!r} and {second!r}, with different values: which one is meant cannot "
            "be told; keep one",
            UNREAD_FIELD,
        )


def raw_turns(where: str, row) -> list[tuple[dict, str, object]]:
    """(turn, role, content as given) of each of the row's turns (ShareGPT's or OpenAI's keys), or BadRowError
    naming the row and turn; the content is the caller's to judge."""
    if not isinstance(row, dict):
        raise BadRowError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    _one_of(where, row, "conversations", "messages", "the row")
    turns = row.get("conversations", row.get("messages"))
    if not isinstance(turns, list):
        raise BadRowError(f"{where}: no 'conversations' or 'messages' list")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRowError(f"{where}: turn {i} is not an object")
        _one_of(where, turn, "from", "role", f"turn {i}")
        _one_of(where, turn, "value", "content", f"turn {i}")
        role = turn.get("from", turn.get("role"))
        if not isinstance(role, str):
            raise BadRowError(f"{where}: turn {i} needs string 'from'/'role' and 'value'/'content'")
        out.append((turn, role, turn.get("value", turn.get("content"))))
    return out


@dataclass
class ChatRow:
    """A row's turns (``from``/``value`` dicts, with ``tool_calls``, ``tool_call_id``, ``name`` where given) and
    its tool definitions (None: none)."""

    turns: list[dict]
    tools: list[dict] | None = None

    def as_json(self) -> str:
        return json.dumps({"turns": self.turns, "tools": self.tools})

    @classmethod
    def from_json(cls, text: str) -> ChatRow:
        value = json.loads(text)
        return cls(value["turns"], value["tools"])


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
    if calls is None or calls == []:  # exporters write an empty list for no calls
        return None
    if not isinstance(calls, list):
        raise BadRowError(f"{where}: turn {i} has 'tool_calls' that is not a list")
    return [_call(where, i, c) for c in calls]


def read_chat(where: str, row) -> ChatRow:
    """The row's turns and tool definitions, or BadRowError naming the row and turn. A row-level ``system`` prompt
    is its first turn; a field that would change the sample and is not read (a turn's ``reasoning_content``,
    ``weight`` 0, media) refuses the row."""
    given = raw_turns(where, row)
    _no_media(where, row)
    system = _system(where, row, given)
    out = [system] if system else []
    for i, (turn, role, content) in enumerate(given):
        _unread(where, i, turn, role.lower())
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


def messages(where: str, turns: list[dict]) -> list[dict]:
    """``turns`` (as :func:`read_chat` reads them) as the chat template takes them: ``role`` (:func:`chat_role`)
    and ``content``, with ``tool_calls`` on assistant turns and ``tool_call_id``/``name`` on tool results where
    given; or BadRowError naming the first turn whose role is not read."""
    out = []
    for i, turn in enumerate(turns):
        role = chat_role(where, i, turn["from"])
        read = {"role": role, "content": turn["value"]}
        keys = ("tool_calls",) if role == "assistant" else ("tool_call_id", "name") if role == "tool" else ()
        read.update({k: turn[k] for k in keys if k in turn})
        out.append(read)
    return out
