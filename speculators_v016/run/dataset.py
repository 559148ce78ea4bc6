"""Dataset rows in, token samples out: local JSON/JSONL, hub names, pre-tokenized files.

Conversation rows (ShareGPT ``conversations`` with ``from``/``value``, or ``messages`` with ``role``/``content``,
tool definitions and tool turns in either form) are read here, row by row, so a bad row is reported with its
file and line (:func:`speculators_v016.run.turns.read_chat`); rows are shuffled with the seed and cut to
``max_samples`` as upstream does; then :mod:`speculators_v016.run.chat_samples` turns them into samples (chat
template of the target's tokenizer, a loss mask on the assistant turns' own text, truncation to ``seq_length``).
Pre-tokenized rows (``input_ids`` + ``loss_mask``) skip the template. What is dropped is counted by reason.

Local files are read as a stream (JSON Lines line by line, a ``.json`` array
element by element through a 1 MiB window), so reading needs memory for the
largest row, not for the file; the rows kept are the dataset itself. A line
that is not UTF-8, or nested deeper than Python's recursion limit, is a bad row
like one that is not JSON (named, skippable with ``skip_bad_rows``). What each input may be (compressed JSON
Lines, Parquet, ``datasets`` folders and ids, per-source caps) and duplicate rows: :mod:`speculators_v016.run.sources`.
"""

from __future__ import annotations

import codecs
import json
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from speculators_v016.run import chat_samples
from speculators_v016.run import sources as input_sources
from speculators_v016.run.turns import BadRowError as BadRowError  # re-exported: the dataset's error
from speculators_v016.run.turns import raw_turns as raw_turns
from speculators_v016.run.turns import read_chat


@dataclass
class PreparedSamples:
    input_ids: list[list[int]]
    loss_masks: list[list[int]]
    kind: str  # "conversations" or "pretokenized"
    sources: list[dict]  # per input: path or name, and sha256 of local files
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)


_CHUNK = 1 << 20  # bytes read at a time from a .json array
_SPACE = re.compile(r"[ \t\n\r]*")
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, as surrogateescape keeps them
_DECODER = json.JSONDecoder()
_TOO_DEEP = "JSON nested too deeply to read (arrays or objects deeper than Python's recursion limit)"


def _line_rows(path: Path, fh):
    """Yield (where, row or BadRowError) per line of a JSON Lines file, one line in memory at a time."""
    for number, raw in enumerate(fh, 1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield (
                where,
                BadRowError(
                    f"{where}: not UTF-8 text (byte {exc.start} of the line is {raw[exc.start : exc.start + 1]!r})"
                ),
            )
            continue
        if number == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as exc:
            yield where, BadRowError(f"{where}: not valid JSON ({exc.msg})")
        except RecursionError:
            yield where, BadRowError(f"{where}: {_TOO_DEEP}")


class _ArrayReader:
    """The text of a JSON array read in blocks: what is not yet parsed, plus one block, in memory."""

    def __init__(self, fh):
        self.fh, self.text, self.pos, self.eof = fh, "", 0, False
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")

    def _more(self) -> bool:
        if self.eof:
            return False
        block = self.fh.read(max(_CHUNK, len(self.text) - self.pos))  # doubles for a row larger than a block
        self.eof = not block
        self.text = self.text[self.pos :] + self.decoder.decode(block, final=self.eof)
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not JSON whitespace ("" at the end)."""
        while True:
            self.pos = _SPACE.match(self.text, self.pos).end()
            if self.pos < len(self.text):
                return self.text[self.pos]
            if not self._more():
                return ""

    def value(self):
        """(value, its text): the next JSON value; JSONDecodeError where the text is not JSON."""
        self.peek()
        seen = None
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, self.pos)
                if end < len(self.text) or self.eof:  # a value cut at the block's end may parse short
                    raw, self.pos = self.text[self.pos : end], end
                    return value, raw
            except json.JSONDecodeError as exc:
                error = (exc.msg, exc.pos - self.pos)
                # the same error with more text after it is in the text, not the block's end
                if self.eof or (
                    error == seen
                    and len(self.text) - exc.pos > _CHUNK
                    and not exc.msg.startswith("Unterminated string")
                ):
                    raise
                seen = error
            self._more()


_STRUCTURE = re.compile(r'[\[\]{}"]')
_STRING_END = re.compile(r'["\\]')


def _skip_value(reader: _ArrayReader) -> bool:
    """Move ``reader`` past the array or object at its position without parsing it (one too deeply nested to
    parse): brackets counted outside strings. False where the text ends first."""
    reader.peek()
    offset, depth, in_string = 0, 0, False  # offset: from reader.pos, which _more() moves
    while True:
        text = reader.text
        at = reader.pos + offset
        match = (_STRING_END if in_string else _STRUCTURE).search(text, at)
        if match is None:
            offset = len(text) - reader.pos
            if not reader._more():
                return False
            continue
        char, offset = match.group(), match.end() - reader.pos
        if in_string:
            if char == "\\":
                if match.end() >= len(text):  # the escaped character is in the next block
                    offset -= 1
                    if not reader._more():
                        return False
                    continue
                offset += 1
            else:
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        else:
            depth -= 1
            if depth <= 0:
                reader.pos += offset
                return True


def _array_rows(path: Path, fh):
    """Yield (where, row or BadRowError) per element of a .json array, one element in memory at a time."""
    reader = _ArrayReader(fh)
    if reader.peek() == "\ufeff":
        reader.pos += 1
    if reader.peek() != "[":
        raise BadRowError(f"{path}: not a JSON array")
    reader.pos += 1
    index = 0
    if reader.peek() == "]":
        return
    while True:
        where = f"{path} row {index}"
        try:
            row, raw = reader.value()
        except json.JSONDecodeError as exc:
            raise BadRowError(f"{where}: not valid JSON ({exc.msg}); the rest of the array cannot be read") from None
        except RecursionError:
            if reader.peek() not in ("[", "{") or not _skip_value(reader):
                raise BadRowError(f"{where}: {_TOO_DEEP}; the rest of the array cannot be read") from None
            yield where, BadRowError(f"{where}: {_TOO_DEEP}")
        else:
            yield where, (BadRowError(f"{where}: not UTF-8 text") if _NOT_UTF8.search(raw) else row)
        index += 1
        after = reader.peek()
        if after == "]":
            return
        if after != ",":
            raise BadRowError(
                f"{path} row {index}: not valid JSON (expected ',' or ']' after row {index - 1}, "
                f"found {after or 'the end of the file'!r})"
            )
        reader.pos += 1


def _read_rows(path: Path):
    """Yield (where, row) for a .jsonl file or a .json array / JSON Lines file, streamed: never the whole file in
    memory. A row that cannot be used (not JSON, not UTF-8) comes as a BadRowError naming file and line."""
    with path.open("rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        fh.seek(0)
        if path.suffix == ".json" and head.startswith(b"["):
            yield from _array_rows(path, fh)
        else:
            yield from _line_rows(path, fh)


def _pretokenized(where: str, row) -> tuple[list[int], list[int]]:
    ids, mask = row.get("input_ids"), row.get("loss_mask")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRowError(f"{where}: 'input_ids' must be a list of integers")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise BadRowError(f"{where}: 'loss_mask' must be a list of 0/1 as long as input_ids ({len(ids)})")
    return ids, mask


def load_rows(
    paths: list[str], skip_bad_rows: bool, hf_cache_dir: str | None, reader=read_chat, keep_duplicates: bool = False
):
    """(kind, rows, sources, skipped) from every input, in order (:mod:`speculators_v016.run.sources`: the kinds of
    input, per-source caps, duplicate rows dropped unless ``keep_duplicates``); ``reader(where, row)`` reads a
    conversation row (its turns, tool definitions and tool turns: :func:`speculators_v016.run.turns.read_chat`)."""
    rows, sources, skipped, kinds = [], [], Counter(), set()
    readers = input_sources.JsonReaders(_read_rows, _line_rows)
    opened = [input_sources.open_source(given, hf_cache_dir, readers) for given in paths]  # all checked first
    duplicates = input_sources.Duplicates(keep=keep_duplicates)
    for source in opened:
        for where, row in source.rows(duplicates):
            try:
                if isinstance(row, Exception):
                    raise row
                if isinstance(row, dict) and "input_ids" in row:
                    kinds.add("pretokenized")
                    ids_mask = _pretokenized(where, row)
                    if not ids_mask[0]:
                        skipped["empty input_ids"] += 1
                        continue
                    rows.append((where, ids_mask))
                else:
                    kinds.add("conversations")
                    turns = reader(where, row)
                    if not getattr(turns, "turns", turns):
                        skipped["empty conversation"] += 1
                        continue
                    rows.append((where, turns))
            except BadRowError:
                if not skip_bad_rows:
                    raise
                logger.warning("skipping bad row {}", where)
                skipped["bad row"] += 1
        sources.append(source.describe())
        skipped.update(source.skipped)
    if len(kinds) > 1:
        raise BadRowError("the inputs mix pre-tokenized rows (input_ids) and conversations: use one kind")
    return (kinds.pop() if kinds else "conversations"), rows, sources, skipped


def run_order(count: int, seed: int, max_samples: int | None) -> list[int]:
    """The rows a run uses, in its order: shuffled as upstream does (datasets' shuffle with the seed), then cut."""
    import datasets  # noqa: PLC0415 - datasets is slow to import; only a run needs it

    order = list(range(count))
    if count:
        order = datasets.Dataset.from_dict({"i": order}).shuffle(seed=seed)["i"]
    return order if max_samples is None else order[:max_samples]


def prepare_samples(
    paths: list[str],
    tokenizer,
    seq_length: int,
    *,
    max_samples: int | None = None,
    seed: int = 0,
    num_proc: int = 8,
    assistant_pattern: str | None = None,
    turn_dropout: bool = False,
    hf_cache_dir: str | None = None,
    skip_bad_rows: bool = False,
    keep_duplicates: bool = False,
) -> PreparedSamples:
    """Load, validate, shuffle, cut and tokenize the inputs into samples."""
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be at least 1 (or None for all), got {max_samples}")
    if seq_length < 1:
        raise ValueError(f"seq_length must be at least 1, got {seq_length}")
    kind, rows, sources, skipped = load_rows(paths, skip_bad_rows, hf_cache_dir, keep_duplicates=keep_duplicates)
    order = run_order(len(rows), seed, max_samples)
    picked = [rows[i] for i in order]
    if kind == "pretokenized":
        ids = [r[1][0][:seq_length] for r in picked]
        masks = [r[1][1][:seq_length] for r in picked]
        cut = [len(r[1][0]) > seq_length for r in picked]
    else:
        ids, masks, cut = _conversations(
            picked,
            tokenizer,
            seq_length,
            skipped,
            num_proc,
            assistant_pattern=assistant_pattern,
            turn_dropout=turn_dropout,
            seed=seed,
            skip_bad_rows=skip_bad_rows,
        )
    keep = [i for i, m in enumerate(masks) if any(m)]
    if len(keep) != len(masks):
        skipped[chat_samples.NO_ASSISTANT] += len(masks) - len(keep)
        ids, masks, cut = [ids[i] for i in keep], [masks[i] for i in keep], [cut[i] for i in keep]
    return PreparedSamples(ids, masks, kind, sources, skipped, sum(cut))


def _conversations(
    picked,
    tokenizer,
    seq_length: int,
    skipped: Counter,
    num_proc: int,
    *,
    assistant_pattern,
    turn_dropout,
    seed,
    skip_bad_rows,
) -> tuple[list, list, list]:
    """(ids, masks, cut) of the conversation rows ``picked`` (``(where, ChatRow)``, in the run's order); rows
    refused raise the first one's BadRowError, or with ``skip_bad_rows`` are skipped, logged and counted in
    ``skipped`` by reason, as rows skipped are (too long, no assistant turn).

    Turn dropout keeps a row's turns up to its first assistant turn at or after turn ``randint(1, turns)``, drawn
    after ``random.seed(seed)`` a row at a time in the run's order, here (upstream drew them in a forked worker,
    whose ``random`` Python reseeds at fork: other draws at every run)."""
    if picked and not getattr(tokenizer, "is_fast", False):
        raise BadRowError(
            "the target's tokenizer is not a fast (Rust) tokenizer: the loss masks of conversation rows need its "
            "token offsets; give pre-tokenized rows (input_ids + loss_mask), or use --regenerate"
        )
    settings = chat_samples.Settings.of(tokenizer, seq_length, assistant_pattern)
    random.seed(seed)  # turn dropout draws from `random`, a row at a time in the run's order
    keeps = [random.randint(1, len(chat.turns)) if turn_dropout else None for _, chat in picked]
    workers = max(1, min(num_proc, len(picked) // 64))
    built = chat_samples.build_all(picked, keeps, tokenizer, settings, workers)
    refused = [(where, b) for (where, _), b in zip(picked, built, strict=True) if b.bad]
    if refused and not skip_bad_rows:
        first = refused[0][1].bad
        more = f" (and {len(refused) - 1} more rows)" if len(refused) > 1 else ""
        raise BadRowError(f"{first}{more}; --skip-bad-rows skips and counts such rows", refused[0][1].reason)
    for where, b in refused:
        logger.warning("skipping bad row {}: {}", where, b.log)
        skipped[b.reason] += 1
    for (where, _), b in zip(picked, built, strict=True):
        if b.skip:
            if b.log:
                logger.warning("skipping row {}: {} ({})", where, b.skip, b.log)
            skipped[b.skip] += 1
    kept = [b for b in built if b.ids is not None]
    return [b.ids for b in kept], [b.mask for b in kept], [b.cut for b in kept]
