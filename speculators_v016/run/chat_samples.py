"""Conversation rows into token samples: the chat template's text, its tokens, and a loss mask that follows the turns.

Our replacement for upstream's ``build_eagle3_dataset`` (which finds assistant text with a pattern over the
rendered text, so markup inside a user's text was trained as an answer, and which drops turns whose role it does
not spell). For each row (its turns read by :mod:`speculators_v016.run.turns`):

**The text** is the conversation rendered by the target's chat template (``add_generation_prompt=False``; tool
definitions passed as ``tools=``, tool calls and results as the template takes them), tokenized once with token
offsets, no special tokens added, cut to ``seq_length``: for rows without tools, the ids upstream's preprocessing
gives.

**The loss mask** is 1 on the tokens of each assistant turn's own text, found by rendering, never by a pattern
over the text: for assistant turn *i*, the template renders the turns before it with its generation prompt (*P*:
what a server would prompt the target with), and the whole conversation with a plain probe text as turn *i*
(*Q*). *Q* after the probe is the turn's end of turn (what the template writes after an assistant turn's text)
and every later turn; the conversation's own text must begin with *P* and end with that, and what lies between
is the turn's text: what the target writes after its generation prompt (the content, a tool call, and whatever
the template writes before the content, e.g. a reasoning block), up to its end of turn. A token is 1 where it
overlaps a span (upstream's rule; on a clean row of a template whose assistant header is its generation prompt,
e.g. ChatML, Llama 3, Gemma, the mask is upstream's). Every earlier turn is in *P* and every later one in what
follows the probe, so nothing a turn's text holds can make or move a span: a user's text is never trained.
``assistant_pattern`` (--assistant-pattern) narrows the spans to its matches' first group.

**Rows refused** (:class:`BadRowError` naming the row, or with ``--skip-bad-rows`` skipped and counted by
reason): a turn whose role is not read; a turn whose text holds one of the tokenizer's special tokens (the
template's markup: it would be read as such, see :func:`special_tokens`); tools or tool turns the template cannot
render (:func:`speculators_v016.run.tool_turns.template_refusal`); a template that does not render the turns one
after the other (it drops a turn's text, e.g. a system prompt it only places into a last user turn, or renders the
turns before an assistant turn otherwise than with its generation prompt); a template that raises.

**Rows skipped and counted**: a rendered text too long to fit ``seq_length`` by far (:func:`far_past_chars`:
more characters than ``seq_length`` times a bound that no token of this tokenizer can cover, and at least
:data:`FAR_CHARS_PER_TOKEN` characters per token), skipped before it is tokenized; no assistant token within the
first ``seq_length`` tokens.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import re
from dataclasses import dataclass

from speculators_v016.config import ConfigError
from speculators_v016.run import tool_turns
from speculators_v016.run.turns import READ_RULES, BadRowError, ChatRow, messages

#: how conversation rows become samples, as the fingerprint records it (a folder whose record differs, an earlier
#: release's among them, is not resumed: its samples were made otherwise)
READING = (
    "roles read in any case, tool turns rendered (tools=), loss mask on each assistant turn's text found by "
    "rendering turn by turn, special tokens in a turn's text refused, rows far past seq_length skipped unread, "
    f"turn dropout drawn in the run's order; {READ_RULES}"
)

#: a turn's probe text: letters and digits only, which no template trims, splits or escapes
PROBE = "speculatorsv016probe7f3a"

#: skip reasons (the summary's "skipped:" lines)
NO_ASSISTANT = "no assistant (trainable) tokens"
TOO_LONG = "far past --seq-length (not tokenized)"
SPECIAL_TEXT = "special tokens of the chat template in a turn's text"
TURNS_REFUSED = "turns the chat template does not render one after the other"

#: a rendered text is skipped unread where it has more characters than --seq-length times this (or the
#: tokenizer's provable bound, where larger): at least this many characters a token, far past typical text's 3-5
FAR_CHARS_PER_TOKEN = 64

# normalizers that never make a text shorter, and the most that a composing one shrinks it by: NFC(x) is at least
# len(x) / 4 long (4: the longest canonical decomposition), NFKC(x) len(x) / 18 (the longest compatibility one)
_NEVER_SHRINK = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
_COMPOSING = {"NFC": 4, "NFKC": 18}
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})


def _shrink(spec) -> int | None:
    """How many times shorter a text can get under this normalizer (None: unbounded or unknown)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factors = [_shrink(s) for s in spec.get("normalizers", ())]
        return None if None in factors else math.prod(factors)
    if kind in _NEVER_SHRINK:
        return 1
    if kind in _COMPOSING:
        return _COMPOSING[kind]
    if kind == "Replace":  # each match of a literal pattern becomes the content
        pattern, content = spec.get("pattern") or {}, spec.get("content") or ""
        if "String" in pattern and content:
            return max(1, math.ceil(len(pattern["String"]) / len(content)))
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled, a Replace by a regex: text can vanish


def _keeps_text(spec) -> bool:
    """Does this pre-tokenizer keep every character (split only, or map one to one or more)?"""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_text(s) for s in spec.get("pretokenizers", ()))
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS  # Whitespace, WhitespaceSplit, BertPreTokenizer drop whitespace


def _no_run_is_one_token(spec) -> bool:
    """Does every token of this model stand for at most its own text (no run of unknown characters as one)?"""
    kind = (spec or {}).get("type")
    if kind == "BPE":
        return bool(spec.get("byte_fallback")) or not spec.get("fuse_unk")
    if kind == "Unigram":  # it fuses unknown characters
        return bool(spec.get("byte_fallback"))
    return False  # WordPiece, WordLevel: a whole unknown word is one token


def chars_per_token_bound(tokenizer) -> int | None:
    """At most how many characters of a text one token of ``tokenizer`` covers, where provable; else None.

    A token covers at most as many characters of the normalized text as its vocabulary string is long (a
    byte-level string has a character per byte, and a character is at least a byte; an added token is its text;
    ``▁`` stands for a space), so ``len(text) <= tokens x longest x shrink``, where ``shrink`` is the most the
    normalizer can shorten a text by. Provable only for a fast tokenizer whose normalizer, pre-tokenizer and
    model never drop text (no Strip, no accents stripped, no whitespace split away, no run of unknown characters
    as one token) and whose added tokens do not take in the whitespace around them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_text(spec.get("pre_tokenizer")) or not _no_run_is_one_token(spec.get("model")):
        return None
    added = list(tokenizer.added_tokens_decoder.values())
    if any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False) for t in added):
        return None
    longest = max([len(t) for t in tokenizer.get_vocab()] + [len(t.content) for t in added] + [1])
    return longest * shrink


def far_past_chars(tokenizer, seq_length: int) -> int | None:
    """More characters than this in a rendered text: more than ``seq_length`` tokens, by far (None: no bound)."""
    bound = chars_per_token_bound(tokenizer)
    return None if bound is None else seq_length * max(bound, FAR_CHARS_PER_TOKEN)


def special_tokens(tokenizer) -> list[str]:
    """The texts of the tokenizer's special tokens (the chat template's markup), longest first."""
    texts = set(tokenizer.all_special_tokens)
    texts |= {t.content for t in tokenizer.added_tokens_decoder.values() if getattr(t, "special", False)}
    return sorted((t for t in texts if t), key=lambda t: (-len(t), t))


@dataclass(frozen=True)
class Settings:
    """What every row is built with."""

    seq_length: int
    far_chars: int | None  # a rendered text longer than this is skipped unread (None: never)
    special: re.Pattern | None  # any of the tokenizer's special tokens
    assistant_pattern: re.Pattern | None = None

    @classmethod
    def of(cls, tokenizer, seq_length: int, assistant_pattern: str | None = None) -> Settings:
        specials = special_tokens(tokenizer)
        pattern = None
        if assistant_pattern is not None:
            try:
                pattern = re.compile(assistant_pattern, re.DOTALL)
            except re.error as exc:
                raise ConfigError(f"not a regular expression ({exc})", "--assistant-pattern") from None
            if pattern.groups < 1:
                raise ConfigError("needs a group: its first group is the assistant's text", "--assistant-pattern")
        return cls(
            seq_length,
            far_past_chars(tokenizer, seq_length),
            re.compile("|".join(map(re.escape, specials))) if specials else None,
            pattern,
        )


@dataclass
class Built:
    """One row's sample, or why it has none: ``skip`` (counted) or ``bad`` (a BadRowError's message, its
    ``reason`` what --skip-bad-rows counts it as, ``log`` what the log says of it)."""

    ids: list[int] | None = None
    mask: list[int] | None = None
    cut: bool = False
    skip: str = ""
    bad: str = ""
    reason: str = ""
    log: str = ""


def render(tokenizer, turns: list[dict], tools, generation_prompt: bool) -> str:
    """``turns`` (possibly none) rendered by the chat template, with ``tools`` where given."""
    extra = {"tools": tools} if tools else {}
    if not turns:  # apply_chat_template reads conversation[0]: an empty one goes in as a batch of one
        return tokenizer.apply_chat_template([[]], tokenize=False, add_generation_prompt=generation_prompt, **extra)[0]
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt, **extra)


def kept_turns(turns: list[dict], keep: int | None) -> list[dict]:
    """Turn dropout: the turns up to the first assistant turn at or after turn ``keep`` (all: None)."""
    if keep is None:
        return turns
    for i, turn in enumerate(turns):
        if i + 1 >= keep and turn["role"] == "assistant":
            return turns[: i + 1]
    return turns


def _strings(turn: dict) -> list[str]:
    out = [turn["content"]]
    if turn.get("tool_calls"):
        out.append(json.dumps(turn["tool_calls"], ensure_ascii=False))
    out += [turn[k] for k in ("tool_call_id", "name") if isinstance(turn.get(k), str)]
    return out


def _check_special(where: str, turns: list[dict], tools, special: re.Pattern | None) -> None:
    if special is None:
        return
    texts = [(f"turn {i} ({t['role']})", s) for i, t in enumerate(turns) for s in _strings(t)]
    if tools:
        texts.append(("its tool definitions", json.dumps(tools, ensure_ascii=False)))
    for what, text in texts:
        found = special.search(text)
        if found:
            raise BadRowError(
                f"{where}: {what} holds {found.group()!r}, a special token of the target's tokenizer: the chat "
                "template's markup, which its text would be read as",
                SPECIAL_TEXT,
            )


def assistant_spans(where: str, tokenizer, turns: list[dict], tools, text: str) -> list[tuple[int, int]]:
    """The character spans of the assistant turns' own text in ``text`` (the rendered conversation), found turn
    by turn (see the module's docstring), or BadRowError where the template does not render them so."""
    spans: list[tuple[int, int]] = []
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        probed = [*turns[:i], {"role": "assistant", "content": PROBE}, *turns[i + 1 :]]
        try:
            prompt = render(tokenizer, turns[:i], tools, True)
            probe = render(tokenizer, probed, tools, False)
        except Exception as exc:  # noqa: BLE001 - the template's own error names the row
            raise BadRowError(
                f"{where}: the chat template cannot render the turns before turn {i} (assistant) with its "
                f"generation prompt, or the conversation with a plain text as that turn ({type(exc).__name__}: "
                f"{str(exc)[:200]})",
                TURNS_REFUSED,
            ) from None
        at = probe.find(PROBE, len(prompt))
        after = probe[at + len(PROBE) :]  # the turn's end, then the turns after it
        end = len(text) - len(after)
        if not (
            at >= 0
            and probe.startswith(prompt)
            and text.startswith(prompt)
            and text.endswith(after)
            and len(prompt) <= end
            and (not spans or spans[-1][1] <= len(prompt))
        ):
            raise BadRowError(
                f"{where}: the chat template does not render turn {i} (assistant) between its generation prompt "
                "for the turns before it and the turns after it, as the whole conversation holds them",
                TURNS_REFUSED,
            )
        spans.append((len(prompt), end))
    return spans


def _check_kept(where: str, turns: list[dict], text: str) -> None:
    """Every non-assistant turn's text is in the rendering (the template drops none)."""
    for i, turn in enumerate(turns):
        content = turn["content"].strip()
        if turn["role"] != "assistant" and content and content not in text:
            raise BadRowError(
                f"{where}: the chat template drops the text of turn {i} ({turn['role']}): {content[:60]!r}",
                TURNS_REFUSED,
            )


def _narrowed(spans: list[tuple[int, int]], pattern: re.Pattern, text: str) -> list[tuple[int, int]]:
    """``spans`` cut to the first groups of ``pattern``'s matches in ``text``."""
    matches = [(m.start(1), m.end(1)) for m in pattern.finditer(text) if m.start(1) >= 0]
    out = [(max(a, c), min(b, d)) for a, b in spans for c, d in matches if max(a, c) < min(b, d)]
    return sorted(out)


def mask_of(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (upstream's rule: from the token before the first one
    starting at or after the span's start, up to the first one starting at or after its end), else 0."""
    mask, starts = [0] * len(offsets), [start for start, _ in offsets]
    for a, b in spans:
        for t in range(max(0, bisect.bisect_left(starts, a) - 1), len(offsets)):
            start, stop = offsets[t]
            if start >= b:
                break
            if stop > a and start < b:
                mask[t] = 1
    return mask


def build(where: str, chat: ChatRow, keep: int | None, tokenizer, settings: Settings) -> Built:
    """One row's sample (see the module's docstring); BadRowError for a row refused."""
    turns = kept_turns(messages(where, chat.turns), keep)
    tools = chat.tools
    try:
        text = render(tokenizer, turns, tools, False)
    except Exception as exc:  # noqa: BLE001 - whatever the template raises names the row
        reason = f"{type(exc).__name__}: {str(exc)[:200]}"
        return Built(
            bad=f"{where}: rejected by the chat template of the target's tokenizer ({reason})",
            reason="bad row",
            log=f"rejected by the chat template ({reason})",
        )
    if settings.far_chars is not None and len(text) > settings.far_chars:
        return Built(skip=TOO_LONG, log=f"{len(text):,} characters, more than {settings.far_chars:,}")
    _check_special(where, turns, tools, settings.special)
    if not any(t["role"] == "assistant" for t in turns):
        return Built(skip=NO_ASSISTANT)
    if tool_turns.uses_tools(turns, tools):
        refusal = tool_turns.template_refusal(tokenizer, turns, tools)
        if refusal:
            raise BadRowError(f"{where}: {refusal}", tool_turns.TOOLS_REFUSED)
    _check_kept(where, turns, text)
    spans = assistant_spans(where, tokenizer, turns, tools, text)
    if settings.assistant_pattern is not None:
        spans = _narrowed(spans, settings.assistant_pattern, text)
    # the tokenizer's own truncation only where it cuts the end: one set to cut from the left (truncation_side)
    # would drop the conversation's head; then the whole text (bounded: rows far past seq_length were skipped
    # unread) and the cut below, always at the end, as for pre-tokenized rows
    right = getattr(tokenizer, "truncation_side", "right") == "right"
    try:
        encoding = tokenizer(
            text,
            add_special_tokens=False,
            return_offsets_mapping=True,
            truncation=right,
            max_length=settings.seq_length + 1 if right else None,  # one more: whether it was cut
        )
    except Exception as exc:  # noqa: BLE001 - e.g. text that is not valid Unicode (a lone surrogate)
        reason = f"{type(exc).__name__}: {str(exc)[:200]}"
        return Built(bad=f"{where}: the tokenizer cannot read its text ({reason})", reason="bad row", log=reason)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    cut = len(ids) > settings.seq_length
    ids, offsets = ids[: settings.seq_length], offsets[: settings.seq_length]
    return Built(list(ids), mask_of(offsets, spans), cut)


def build_row(where: str, chat: ChatRow, keep: int | None, tokenizer, settings: Settings) -> Built:
    """:func:`build`, a row refused as a :class:`Built` with its message and reason (never raised)."""
    try:
        return build(where, chat, keep, tokenizer, settings)
    except BadRowError as exc:
        return Built(bad=str(exc), reason=exc.reason, log=str(exc).removeprefix(f"{where}: "))


def build_batch(batch: dict, tokenizer, settings: Settings) -> dict:
    """``datasets.map``'s function: rows (``where``, ``row`` as :meth:`ChatRow.as_json`, ``keep``: 0 for all) in,
    one :class:`Built` per row out, as columns."""
    out: dict[str, list] = {k: [] for k in ("ids", "mask", "cut", "skip", "bad", "reason", "log")}
    for where, row, keep in zip(batch["where"], batch["row"], batch["keep"], strict=True):
        built = build_row(where, ChatRow.from_json(row), keep or None, tokenizer, settings)
        out["ids"].append(built.ids or [])
        out["mask"].append(built.mask or [])
        out["cut"].append(built.cut)
        for key in ("skip", "bad", "reason", "log"):
            out[key].append(getattr(built, key))
    return out


def build_all(rows: list[tuple[str, ChatRow]], keeps: list[int | None], tokenizer, settings: Settings, num_proc: int):
    """:func:`build` over ``rows`` (``keeps``: each row's turn dropout, None: all), in ``num_proc`` processes;
    a :class:`Built` per row, in order."""
    import datasets  # noqa: PLC0415 - datasets is slow to import; only a run needs it

    if not rows:
        return []
    table = datasets.Dataset.from_dict(
        {
            "where": [where for where, _ in rows],
            "row": [chat.as_json() for _, chat in rows],
            "keep": [keep or 0 for keep in keeps],
        }
    )
    environ, parallelism = os.environ, os.environ.get("TOKENIZERS_PARALLELISM")
    try:
        done = table.map(
            functools.partial(build_batch, tokenizer=tokenizer, settings=settings),
            batched=True,
            batch_size=1000,
            num_proc=num_proc if num_proc > 1 else None,
            remove_columns=table.column_names,
        )
    finally:  # with workers, datasets leaves a copy of os.environ in its place (and TOKENIZERS_PARALLELISM set):
        os.environ = environ  # noqa: B003 - the process's own object back: holders of it (a default argument) see changes
        if parallelism is None:
            environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            environ["TOKENIZERS_PARALLELISM"] = parallelism
    columns = {k: done[k] for k in ("ids", "mask", "cut", "skip", "bad", "reason", "log")}
    return [
        Built(ids or None, mask or None, cut, skip, bad, reason, log)
        for ids, mask, cut, skip, bad, reason, log in zip(*columns.values(), strict=True)
    ]
