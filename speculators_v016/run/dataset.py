"""Dataset rows in: JSON and JSON Lines read, every input's rows checked, located and ordered.

Conversation rows (ShareGPT ``conversations`` with ``from``/``value``, or ``messages`` with ``role``/``content``,
tool definitions and tool turns in either form) are read here, row by row, so a bad row is reported with its
file and line (:func:`speculators_v016.run.turns.read_chat`); rows are shuffled with the seed and cut to
``max_samples`` as upstream does (:func:`run_order`); then :mod:`speculators_v016.run.prepared` has
:mod:`speculators_v016.run.chat_samples` turn them into samples (chat
template of the target's tokenizer, a loss mask on the assistant turns' own text, truncation to ``seq_length``).
Pre-tokenized rows (``input_ids`` + ``loss_mask``) skip the template. What is dropped is counted by reason.

Local files are read as a stream (JSON Lines line by line, a ``.json`` array
element by element through a 1 MiB window), so reading needs memory for the
largest row, not for the file; each row's place in its file (its *locator*) reads it again alone, so a run
keeps an index of its rows, not the rows (:mod:`speculators_v016.run.row_index`). A line
that is not UTF-8, or nested deeper than Python's recursion limit, is a bad row
like one that is not JSON (named, skippable with ``skip_bad_rows``). What each input may be (compressed JSON
Lines, Parquet, ``datasets`` folders and ids, per-source caps), how each reads a row again, and duplicate rows:
:mod:`speculators_v016.run.sources`.
"""

from __future__ import annotations

import codecs
import json
import re
from collections import Counter
from pathlib import Path

from loguru import logger

from speculators_v016.run import line_scan
from speculators_v016.run import sources as input_sources
from speculators_v016.run.turns import BadRowError as BadRowError  # re-exported: the dataset's error
from speculators_v016.run.turns import raw_turns as raw_turns
from speculators_v016.run.turns import read_chat

_CHUNK = 1 << 20  # bytes read at a time from a .json array
_SPACE = re.compile(r"[ \t\n\r]*")
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, as surrogateescape keeps them
_DECODER = json.JSONDecoder()
_TOO_DEEP = "JSON nested too deeply to read (arrays or objects deeper than Python's recursion limit)"


def _line_row(where: str, raw: bytes, first: bool):
    """The row of one line of a JSON Lines file (None: a blank line), or a BadRowError naming it."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadRowError(
            f"{where}: not UTF-8 text (byte {exc.start} of the line is {raw[exc.start : exc.start + 1]!r})"
        )
    if first:
        line = line.removeprefix("\ufeff")
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        return BadRowError(f"{where}: not valid JSON ({exc.msg})")
    except RecursionError:
        return BadRowError(f"{where}: {_TOO_DEEP}")
    except ValueError as exc:  # an int of more digits than sys.get_int_max_str_digits() allows
        return BadRowError(f"{where}: not valid JSON ({exc})")


def _line_rows(path: Path, fh):
    """Yield (where, row or BadRowError, byte offset of the line) per line of a JSON Lines file, one line in
    memory at a time."""
    offset = 0
    for number, raw in enumerate(fh, 1):
        where = f"{path}:{number}"
        row = _line_row(where, raw, number == 1)
        if row is not None:
            yield where, row, (offset, number)
        offset += len(raw)


class _ArrayReader:
    """The text of a JSON array read in blocks: what is not yet parsed, plus one block, in memory."""

    def __init__(self, fh, start: int = 0):
        self.fh, self.text, self.pos, self.eof = fh, "", 0, False
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.mark, self.mark_bytes = 0, start  # text[mark] is byte mark_bytes of the file

    def byte_at(self) -> int:
        """The byte offset in the file of the text at ``pos`` (the text before it encoded back, once)."""
        self.mark_bytes += len(self.text[self.mark : self.pos].encode("utf-8", "surrogateescape"))
        self.mark = self.pos
        return self.mark_bytes

    def _more(self) -> bool:
        if self.eof:
            return False
        self.byte_at()
        block = self.fh.read(max(_CHUNK, len(self.text) - self.pos))  # doubles for a row larger than a block
        self.eof = not block
        self.text = self.text[self.pos :] + self.decoder.decode(block, final=self.eof)
        self.pos = self.mark = 0
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
    """Yield (where, row or BadRowError, (byte offset, index)) per element of a .json array, one element in
    memory at a time."""
    reader = _ArrayReader(fh)
    if reader.peek() == "\ufeff":
        reader.pos += 1
    if reader.peek() != "[":
        raise BadRowError(f"{path}: not a JSON array")
    reader.pos += 1
    index = 0
    if reader.peek() == "]":
        _array_end(path, reader)
        return
    while True:
        where = f"{path} row {index}"
        reader.peek()
        at = (reader.byte_at(), index)
        try:
            row, raw = reader.value()
        except json.JSONDecodeError as exc:
            raise BadRowError(f"{where}: not valid JSON ({exc.msg}); the rest of the array cannot be read") from None
        except ValueError as exc:  # an int of more digits than sys.get_int_max_str_digits() allows
            raise BadRowError(f"{where}: not valid JSON ({exc}); the rest of the array cannot be read") from None
        except RecursionError:
            if reader.peek() not in ("[", "{") or not _skip_value(reader):
                raise BadRowError(f"{where}: {_TOO_DEEP}; the rest of the array cannot be read") from None
            yield where, BadRowError(f"{where}: {_TOO_DEEP}"), at
        else:
            yield where, (BadRowError(f"{where}: not UTF-8 text") if _NOT_UTF8.search(raw) else row), at
        index += 1
        after = reader.peek()
        if after == "]":
            _array_end(path, reader)
            return
        if after != ",":
            raise BadRowError(
                f"{path} row {index}: not valid JSON (expected ',' or ']' after row {index - 1}, "
                f"found {after or 'the end of the file'!r})"
            )
        reader.pos += 1


def _array_end(path: Path, reader: _ArrayReader) -> None:
    """Past the array's closing ``]`` only JSON whitespace may follow: anything else (a second array of two files
    joined, a stray line) would be rows never read, so it is a BadRowError naming the byte it starts at."""
    reader.pos += 1
    rest = reader.peek()
    if rest:
        raise BadRowError(
            f"{path}: text after the JSON array's closing ']' (byte {reader.byte_at()}: {rest!r}): the file is not "
            "one JSON array (two files joined?), and what follows the array would never be read; make it one array, "
            "or JSON Lines"
        )


def _is_array(path: Path, fh) -> bool:
    head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    fh.seek(0)
    return path.suffix == ".json" and head.startswith(b"[")


def _read_located(path: Path):
    """Yield (where, row, locator) for a .jsonl file or a .json array / JSON Lines file, streamed: never the whole
    file in memory. A row that cannot be used (not JSON, not UTF-8) comes as a BadRowError naming file and line;
    ``locator`` (byte offset, line or element number) reads the row again (:func:`_row_at`)."""
    with path.open("rb") as fh:
        yield from (_array_rows if _is_array(path, fh) else _line_rows)(path, fh)


def _row_at(path: Path, fh, array: bool, locator) -> tuple[str, object]:
    """(where, row or BadRowError) of the row at ``locator`` (as :func:`_read_located` gave it) of ``fh``."""
    offset, number = locator
    fh.seek(offset)
    if array:
        where = f"{path} row {number}"
        try:
            row, raw = _ArrayReader(fh, offset).value()
        except (ValueError, RecursionError):  # JSONDecodeError, or an int past sys.get_int_max_str_digits()
            return where, BadRowError(f"{where}: not valid JSON where it was read before (the file changed?)")
        return where, (BadRowError(f"{where}: not UTF-8 text") if _NOT_UTF8.search(raw) else row)
    where = f"{path}:{number}"
    row = _line_row(where, fh.readline(), number == 1)
    return where, (
        BadRowError(f"{where}: a blank line where a row was read before (the file changed?)") if row is None else row
    )


#: the largest token id a row may hold as it is read (int32, every tokenizer's and vLLM's range): one past it, or
#: a negative one, is a bad row named by file and line; the target's own vocabulary is checked before the engine
#: takes a sample
MAX_TOKEN_ID = 2**31 - 1


def _pretokenized(where: str, row) -> tuple[list[int], list[int]]:
    ids, mask = row.get("input_ids"), row.get("loss_mask")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRowError(f"{where}: 'input_ids' must be a list of integers")
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        bad = next(t for t in ids if t < 0 or t > MAX_TOKEN_ID)
        raise BadRowError(
            f"{where}: 'input_ids' holds {bad} at position {ids.index(bad)}, not a token id (0 to {MAX_TOKEN_ID})"
        )
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise BadRowError(f"{where}: 'loss_mask' must be a list of 0/1 as long as input_ids ({len(ids)})")
    return ids, mask


def read_row(where: str, row, reader=read_chat):
    """A row as a run takes it: ``("pretokenized", (ids, mask))`` or ``("conversations", ChatRow)``, or
    ``(kind, None)`` for an empty one; BadRowError naming it where it cannot be used."""
    if isinstance(row, Exception):
        raise row
    if isinstance(row, dict) and "input_ids" in row:
        ids_mask = _pretokenized(where, row)
        return "pretokenized", (ids_mask if ids_mask[0] else None)
    turns = reader(where, row)
    return "conversations", (turns if getattr(turns, "turns", turns) else None)


#: skip reasons of rows dropped as they are read (before the shuffle: they take no place in the run's order)
EMPTY = {"pretokenized": "empty input_ids", "conversations": "empty conversation"}


def json_readers() -> input_sources.JsonReaders:
    """This module's JSON readers, as :mod:`speculators_v016.run.sources` takes them (looked up when called)."""
    return input_sources.JsonReaders(_read_located, _line_rows, _row_at, _is_array, _line_row)


def open_sources(paths: list[str], hf_cache_dir: str | None, digests=None) -> list:
    """Every input checked and opened (:func:`speculators_v016.run.sources.open_source`), all before any is read;
    ``digests``: a :class:`speculators_v016.store.digest_memo.DigestMemo` (or None: every file hashed)."""
    readers = json_readers()
    opened = []
    try:
        for given in paths:
            opened.append(input_sources.open_source(given, hf_cache_dir, readers, digests))
    except BaseException:
        for source in opened:
            source.close()
        raise
    return opened


def scan_rows(
    paths: list[str],
    skip_bad_rows: bool,
    hf_cache_dir: str | None,
    take,
    reader=read_chat,
    opened=None,
    keep_duplicates: bool = False,
    take_plain=None,
    kept=None,
):
    """Read every input in order; ``take(source number, locator, where, value)`` for each row kept (``value``:
    ``(ids, mask)`` or the reader's ChatRow). ``(kind, sources, skipped)``; the sources stay open for
    ``rows_at``. ``opened``: the sources of ``paths``, already opened (:func:`open_sources`). Duplicate rows are
    dropped here, at read time, by their digest (:class:`speculators_v016.run.sources.Duplicates`), unless
    ``keep_duplicates``: every shard reads every row here, so every shard drops the same ones. ``take_plain(source
    number, offsets, lines, turns)`` (lists): where given, a JSON Lines file's plain rows are read in bulk and given so, no
    value made (:mod:`speculators_v016.run.line_scan`); the same rows kept, the same counts. ``kept``, with
    ``take_plain``: three sequences (source number, offset, line) that ``take`` and ``take_plain`` extend by each
    row they are given (the row index's arrays): the duplicate check reads a plain row's first place there."""
    if take_plain is not None and kept is None:
        raise ValueError("scan_rows: take_plain needs kept (the kept rows' places, which the duplicate check reads)")
    sources = opened if opened is not None else open_sources(paths, hf_cache_dir)
    skipped, kinds = Counter(), set()
    duplicates = input_sources.Duplicates(keep=keep_duplicates)
    if kept is not None:
        duplicates.kept = kept

    def judge(where, row):
        try:
            kind, value = read_row(where, row, reader)
        except BadRowError as exc:
            if not skip_bad_rows:
                raise
            logger.warning("skipping bad row {}", where)
            skipped[exc.reason] += 1  # "bad row", or what it is (a field that is not read)
            return None
        kinds.add(kind)
        if value is None:
            skipped[EMPTY[kind]] += 1
        return value

    def plain(number, offsets, lines, turns):
        kinds.add("conversations")
        if 0 in turns:
            kept = [i for i, count in enumerate(turns) if count]
            skipped[EMPTY["conversations"]] += len(turns) - len(kept)
            offsets, lines, turns = ([v[i] for i in kept] for v in (offsets, lines, turns))
        take_plain(number, offsets, lines, turns)

    for number, source in enumerate(sources):
        if take_plain is not None and line_scan.plain_lines(source, reader):
            line_scan.scan(number, source, duplicates, judge, take, plain)
        else:
            for where, row, locator in source.rows(duplicates):
                value = judge(where, row)
                if value is not None:
                    take(number, locator, where, value)
        skipped.update(source.skipped)
    if len(kinds) > 1:
        raise BadRowError("the inputs mix pre-tokenized rows (input_ids) and conversations: use one kind")
    return (kinds.pop() if kinds else "conversations"), sources, skipped


def load_rows(
    paths: list[str],
    skip_bad_rows: bool,
    hf_cache_dir: str | None,
    reader=read_chat,
    keep_duplicates: bool = False,
):
    """(kind, rows, sources, skipped) from every input, in order (:mod:`speculators_v016.run.sources`: the kinds of
    input, per-source caps, duplicate rows dropped unless ``keep_duplicates``); ``reader(where, row)`` reads a
    conversation row (its turns, tool definitions and tool turns: :func:`speculators_v016.run.turns.read_chat`).
    Every row in memory, as every release read them: a run indexes its rows instead
    (:mod:`speculators_v016.run.row_index`); the tests restate the old path with this."""
    rows = []
    kind, sources, skipped = scan_rows(
        paths,
        skip_bad_rows,
        hf_cache_dir,
        lambda _number, _locator, where, value: rows.append((where, value)),
        reader,
        keep_duplicates=keep_duplicates,
    )
    for source in sources:
        source.close()
    return kind, rows, [s.describe() for s in sources], skipped


def shuffled(count: int, seed: int):
    """Datasets' shuffle of ``range(count)`` with ``seed`` (``Dataset.shuffle(seed=seed)`` takes
    ``numpy.random.default_rng(seed).permutation(count)``), as an int64 array; a test compares the two."""
    import numpy as np  # noqa: PLC0415 - numpy only where a run orders its rows

    return (
        np.random.default_rng(seed).permutation(count).astype(np.int64, copy=False) if count else np.zeros(0, np.int64)
    )


def run_order(count: int, seed: int, max_samples: int | None):
    """The rows a run uses, in its order: shuffled as upstream does (datasets' shuffle with the seed), then cut
    (position -> row: an int32 array, 4 bytes a row, where every row number fits; else int64)."""
    import numpy as np  # noqa: PLC0415 - numpy only where a run orders its rows

    order = shuffled(count, seed)
    order = order if max_samples is None else order[:max_samples]
    return order.astype(np.int32) if count - 1 <= np.iinfo(np.int32).max else order
