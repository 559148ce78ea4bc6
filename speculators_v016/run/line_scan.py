"""A JSON Lines file's rows indexed in bulk: the row index's first read at the speed of the file's bytes, not of
Python per turn.

:func:`speculators_v016.run.dataset.scan_rows` reads a row as ``json.loads`` of its line, then its turns
(:func:`speculators_v016.run.turns.read_chat`), then its content's canonical JSON and digest for the duplicate
check: tens of microseconds a row. The row index (:mod:`speculators_v016.run.row_index`) needs of a kept row only
its place and its turns' count; of every row, whether it is kept: not blank, not a duplicate (which needs its
content), not bad, not empty, within its source's cap. Those decide the run's order (the shuffle is of the kept
rows), so every row's content is still read here, but a plain row's (:mod:`speculators_v016.run.row_shape`) in C:

* the file is read in blocks of :data:`BLOCK` bytes and split into lines (as iterating the file does: at
  ``\\n``; a final line without one is a line); a block that is not all UTF-8 has each line checked;
* each line ``msgspec`` decodes as a :class:`~speculators_v016.run.row_shape.PlainRow` is a plain row: its turns
  counted, its duplicate check by key (:meth:`speculators_v016.run.sources.Duplicates.seen_plain`: the content's
  digest computed only where two keys are equal);
* any other line (blank, a BOM, not JSON, not UTF-8, not plain, nested :data:`DEPTH` brackets or more) is read
  exactly as before: the reader's own line reader, the duplicate check by digest, ``judge`` (bad and empty rows
  dropped and counted, or the error naming ``file:line``), ``take``.

``msgspec`` accepts no JSON text that ``json.loads`` refuses (a test runs both over the corner cases) and gives the
same strings; what it accepts that a line read as before would not (bytes that are not UTF-8 in a key or a field
it skips, nesting deep enough for ``json.loads`` to give up, an int longer than Python reads from text) is
checked above. The cap (``#max=N``), blank lines,
duplicates and counts are those of :meth:`speculators_v016.run.sources.Source.rows`.
"""

from __future__ import annotations

import gc
import re
import sys
from itertools import accumulate, repeat
from operator import add
from pathlib import Path

from speculators_v016.run import row_shape
from speculators_v016.run.sources import DUPLICATE, BadRowError, _JsonFile
from speculators_v016.run.turns import read_chat

#: bytes read at a time
BLOCK = 1 << 20
#: a line holding this many ``[`` and ``{`` together is read as before (json.loads's nesting limit decides it)
DEPTH = 400


def _long_digits():
    """A line with a run of digits longer than ``sys.get_int_max_str_digits()`` (json.loads refuses such an int,
    msgspec skips it in a field it does not read): such a line is read as before. None: no limit."""
    limit = sys.get_int_max_str_digits()
    return re.compile(rb"(?<![0-9])[0-9]{%d}" % (limit + 1)).search if limit else None


def plain_lines(source, reader) -> bool:
    """Whether ``source`` is a JSON Lines file (plain ``.jsonl``, or a ``.json`` that is not an array) read with
    :func:`~speculators_v016.run.turns.read_chat`: what :func:`scan` reads."""
    file = source.reader
    if reader is not read_chat or not isinstance(file, _JsonFile):
        return False
    with file.path.open("rb") as fh:
        return not file.readers.is_array(file.path, fh)


def _row_at(path: Path, line_row, offset: int, number: int):
    """The row (as json.loads gives it) of the line at ``offset``: a plain row's, read again for its digest."""
    with path.open("rb") as fh:
        fh.seek(offset)
        row = line_row(f"{path}:{number}", fh.readline(), number == 1)
    if not isinstance(row, dict):
        raise BadRowError(f"{path}:{number}: not the row read there before (the file changed?)")
    return row


def _lines(path: Path):
    """(lines, all UTF-8, newline) per block of the file: each line without its ``\\n`` (``newline``: 1, each had
    one; 0: the file's last line, which has none)."""
    rest = b""
    with path.open("rb", buffering=0) as fh:
        while True:
            block = fh.read(BLOCK)
            if not block:
                if rest:
                    yield [rest], _utf8(rest), 0
                return
            data = rest + block if rest else block
            lines = data.split(b"\n")
            rest = lines.pop()  # after the last newline: the start of the next block's first line
            if lines:
                yield lines, _utf8(data, len(data) - len(rest)), 1


def _utf8(data: bytes, end: int | None = None) -> bool:
    """Whether ``data[:end]`` is UTF-8 text (ASCII at once, else decoded)."""
    if data.isascii():
        return True
    try:
        str(memoryview(data)[:end], "utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _block(block: list[bytes], utf8: bool):
    """(turns, keys) of a block's lines: a line's turns (a tuple) and key where it is a plain row, else None (and
    :data:`NOT_PLAIN_ROW`'s key); the plain lines decoded in one pass (msgspec over the list, in C)."""
    decoded, lines = [], map(row_shape.DECODER.decode, block)
    collecting = gc.isenabled()
    gc.disable()  # a block's rows are all alive: the collector would walk them again and again, finding nothing
    try:
        while True:
            try:
                decoded.extend(lines)
                break
            except row_shape.NOT_PLAIN:  # that line is not plain: the rest of the block goes on
                decoded.append(NOT_PLAIN_ROW)
    finally:
        if collecting:
            gc.enable()
    turns = list(map(row_shape.turns_of, decoded))
    brackets = list(map(add, map(bytes.count, block, repeat(b"[")), map(bytes.count, block, repeat(b"{"))))
    if max(brackets, default=0) >= DEPTH:  # nested deep enough for json.loads's limit, maybe: read as before
        for i, count in enumerate(brackets):
            if count >= DEPTH:
                turns[i] = None
    long_digits = _long_digits()
    if long_digits is not None:  # an int json.loads refuses, maybe: read as before
        for i, found in enumerate(map(long_digits, block)):
            if found is not None:
                turns[i] = None
    if not utf8:  # bytes that are not UTF-8 somewhere: each line checked
        for i, raw in enumerate(block):
            if turns[i] is not None and not _utf8(raw):
                turns[i] = None
    return turns, list(map(hash, decoded))


#: what a line that is not a plain row decodes to here (neither conversations nor messages: turns_of is None)
NOT_PLAIN_ROW = row_shape.PlainRow()


def scan(number: int, source, duplicates, judge, take, take_plain) -> None:
    """Read source ``number`` (a :func:`plain_lines` source) once, in order, up to its cap: ``take_plain(number,
    offsets, lines, turns)`` (lists) for the plain rows not dropped as duplicates (empty ones too: ``turns`` 0),
    in order; other lines as before, ``judge(where, row)`` (the row's value, or None where it is dropped, counted;
    or BadRowError) then ``take(number, (offset, line), where, value)``. A block whose lines are all plain rows of
    new keys, none empty, within the cap, is taken whole (no Python a row); any other, line by line.

    ``take`` and ``take_plain`` put each kept row (not an empty one) in ``duplicates.kept``: a plain row's first
    place is its position there (an empty row's: its digest), and the rows waiting for ``take_plain`` are given
    before any row's duplicate check may read a place."""
    path = source.reader.path
    line_row = source.reader.readers.line_row
    duplicates.resolve[number] = lambda offset, line: _row_at(path, line_row, offset, line)
    first, kept = duplicates.plain_keys(), duplicates.kept[0]
    cap, taken, offset, line = source.max_rows, 0, 0, 0
    for block, utf8, newline in _lines(path):
        turns, keys = _block(block, utf8)
        count = len(block)
        sizes = list(map(len, block)) if newline == 0 else list(map(add, map(len, block), repeat(newline)))
        # the block's keys asked at once: known before it (a row-by-row look-up only where the table's levels
        # changed within the block: run/key_table.py)
        known = first.contains(keys).tolist() if first is not None else None
        generation = first.generation if first is not None else 0
        if (
            all(turns)  # every line a plain row (None: not plain), none empty
            and (cap is None or taken + count < cap)
            and (first is None or (not any(known) and len(set(keys)) == count))
        ):
            starts = list(accumulate(sizes, initial=offset))
            numbers = range(line + 1, line + count + 1)
            if first is not None:  # their positions in kept, once given
                first.add(keys, range(len(kept), len(kept) + count))
            take_plain(number, starts[:-1], list(numbers), list(map(len, turns)))
            taken, offset, line = taken + count, starts[-1], line + count
            continue
        waiting = _Waiting(number, take_plain)
        for i, (raw, its, key, size) in enumerate(zip(block, turns, keys, sizes, strict=True)):
            line += 1
            if its is not None:
                new = first is not None and not (
                    known[i] or first.is_recent(key) or (first.generation != generation and key in first)
                )
                if new and its:
                    first[key] = len(kept) + waiting.rows  # its position in kept, once given
                elif first is not None:  # a key seen before, or an empty row (its digest is its first place)
                    waiting.give()  # every row before it in kept: a first place can be read
                    if duplicates.seen_again(key, line_row(f"{path}:{line}", raw, line == 1)):
                        source.skipped[DUPLICATE] += 1
                        offset += size
                        continue
                waiting.add(offset, line, len(its))
            else:  # not a plain row: read as before
                waiting.give()
                where = f"{path}:{line}"
                row = line_row(where, raw + b"\n" if newline else raw, line == 1)
                if row is None:  # a blank line: not a row
                    offset += size
                    continue
                if duplicates.seen(row):
                    source.skipped[DUPLICATE] += 1
                    offset += size
                    continue
                value = judge(where, row)
                if value is not None:
                    take(number, (offset, line), where, value)
            taken += 1
            offset += size
            if cap is not None and taken >= cap:
                break
        waiting.give()
        if first is not None:
            first.settle()
        if cap is not None and taken >= cap:
            return


class _Waiting:
    """A block's plain rows not given to ``take_plain`` yet (given in one call); ``rows``: those that will be kept
    (not empty)."""

    def __init__(self, number: int, take_plain):
        self.number, self.take_plain = number, take_plain
        self.offsets, self.lines, self.counts = [], [], []
        self.rows = 0

    def add(self, offset: int, line: int, turns: int) -> None:
        self.offsets.append(offset)
        self.lines.append(line)
        self.counts.append(turns)
        self.rows += turns > 0

    def give(self) -> None:
        """The rows waiting, to ``take_plain`` (in order: before a later row is taken or read)."""
        if self.offsets:
            self.take_plain(self.number, self.offsets, self.lines, self.counts)
            self.offsets, self.lines, self.counts = [], [], []
            self.rows = 0
