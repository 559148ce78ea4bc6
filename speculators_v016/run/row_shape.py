"""The plain conversation row, as a type: what the row index reads in bulk, and its content as a hashable key.

Most conversation rows are plain: ``messages`` of ``{"role", "content"}`` (or ``conversations`` of ``{"from",
"value"}``), every role one of :data:`PLAIN_ROLES`, every content a string, no ``tools``, ``system`` or media
fields, no ``input_ids``. Such a row is decoded by ``msgspec`` straight into :class:`PlainRow` (no dict per turn, no Python per turn), and
:func:`speculators_v016.run.turns.read_chat` would read it as it stands (no tool turns, no call to parse: a turn
is ``{"from": role, "value": content}``), so its only facts for the index are its turns' count and its content.

A :class:`PlainRow` is frozen: equal rows are equal objects with equal hashes, and its fields are exactly the
content duplicates are judged by (:data:`speculators_v016.run.sources.CONVERSATION_FIELDS`: other top-level keys
are ignored, a turn with any other key is not plain). Its ``hash()`` is the duplicate check's first key
(:class:`speculators_v016.run.sources.Duplicates`): two rows whose keys differ differ in content; equal keys are
checked by the content's digest. Anything not plain (another role, a tool turn, a number where a string is
expected, ``tools``, both ``conversations`` and ``messages``) is not decoded here: the row is read as before, one
``json.loads`` and :func:`~speculators_v016.run.turns.read_chat`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, UnsetType

from speculators_v016.run.turns import MEDIA_KEYS, SYSTEM_KEY

#: the roles of a plain row (exact spelling): any other, ``function_call`` above all, reads the row as before
PLAIN_ROLES = ("user", "assistant", "system", "human", "gpt", "User", "Assistant", "System", "Human", "GPT")
_Role = Literal[PLAIN_ROLES]
#: a field whose presence makes the row not plain (no JSON value satisfies ``1 <= x <= 0``)
_Absent = Annotated[int, msgspec.Meta(ge=1, le=0)]


class ChatTurn(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """``{"role", "content"}``, both strings, no other key."""

    role: _Role
    content: str


class ShareTurn(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """``{"from", "value"}``, both strings, no other key."""

    from_: _Role = msgspec.field(name="from")
    value: str


class PlainRow(msgspec.Struct, frozen=True, gc=False):
    """A plain conversation row's content: one of ``conversations``/``messages`` (the other absent), no
    ``tools``, no ``input_ids``; other top-level keys are not content and not kept."""

    conversations: tuple[ShareTurn, ...] | UnsetType = UNSET
    messages: tuple[ChatTurn, ...] | UnsetType = UNSET
    tools: _Absent | UnsetType = UNSET
    input_ids: _Absent | UnsetType = UNSET
    system: _Absent | UnsetType = UNSET  # read as the first turn (run/turns.py): not plain
    images: _Absent | UnsetType = UNSET  # media (run/turns.py MEDIA_KEYS): refused
    videos: _Absent | UnsetType = UNSET
    audios: _Absent | UnsetType = UNSET
    image: _Absent | UnsetType = UNSET
    video: _Absent | UnsetType = UNSET
    audio: _Absent | UnsetType = UNSET


#: top-level keys whose presence makes a row not plain (read as before, one json.loads and read_chat)
PLAIN_ABSENT = ("tools", SYSTEM_KEY, *MEDIA_KEYS)

#: a JSON text -> PlainRow (msgspec.ValidationError / DecodeError where it is not one)
DECODER = msgspec.json.Decoder(PlainRow)
#: what a line that is not a plain row raises when decoded
NOT_PLAIN = (msgspec.ValidationError, msgspec.DecodeError, RecursionError)


def turns_of(row: PlainRow):
    """The row's turns (a tuple), or None where it holds both ``conversations`` and ``messages`` (not plain)."""
    if row.conversations is UNSET:
        return None if row.messages is UNSET else row.messages
    return row.conversations if row.messages is UNSET else None


def key_of(row) -> int | None:
    """The duplicate check's first key of a row already parsed (a dict, as ``json.loads`` gives it), where it is
    plain: the hash of its PlainRow, equal to a plain line's (:data:`DECODER`); None where it is not plain."""
    content = {k: row[k] for k in ("conversations", "messages", "input_ids", *PLAIN_ABSENT) if k in row}
    try:
        plain = msgspec.convert(content, PlainRow)
    except msgspec.ValidationError:
        return None
    return hash(plain) if turns_of(plain) is not None else None
