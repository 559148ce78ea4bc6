"""One ``--train-data-path`` value as a source of rows: what it names, its rows in order, and what it was.

A value is ``WHAT[#max=N]``; ``WHAT`` is, in this order:

* a file: ``.json`` (an array, or JSON Lines), ``.jsonl``, ``.jsonl.gz`` (gzip), ``.jsonl.zst`` (Zstandard, through
  the ``zstandard`` package), ``.parquet``;
* a folder: its ``*.parquet`` files in name order (sorted as strings; sub-folders are not read), or a folder that
  ``datasets``' ``save_to_disk`` wrote (``state.json`` + ``dataset_info.json``; a ``DatasetDict``'s
  ``dataset_dict.json`` needs a split: ``FOLDER@SPLIT``). ``FOLDER@SPLIT`` in a Parquet folder reads the split's
  files (``SPLIT-*.parquet``, ``SPLIT.parquet``); a folder whose files hold several splits, by the hub's naming
  (``train-00000-of-00002.parquet``), needs one named;
* a dataset name upstream's loader knows (``sharegpt``, ``ultrachat``);
* a hub dataset, ``ORG/NAME@SPLIT`` or ``ORG/NAME:CONFIG@SPLIT`` (the ``datasets`` library's path, config name and
  split), loaded with ``datasets.load_dataset`` into ``--hf-cache-dir``; where no hub is reachable (or
  ``HF_HUB_OFFLINE=1``) ``datasets`` takes the copy in that cache, and an id it has no copy of is an error naming
  it. No loading script runs (``datasets`` 4 has none) and nothing is unpickled: only the builders of
  :data:`HUB_BUILDERS` (data files) may read a hub dataset.

``#max=N`` keeps the source's first ``N`` rows in its own order (file order; blank lines are not rows, a bad row
skipped with ``--skip-bad-rows`` counts, a duplicate dropped does not), before the run's shuffle and
``--max-samples``; the rest of the source is not read.

Each source yields ``(where, row, locator)``: ``where`` names the file and line (``a.jsonl:12``, ``a.jsonl.gz:12``)
or row (``a.json row 3``, ``data.parquet row 7``, ``org/name@train row 7``); a row that cannot be read arrives as a
:class:`BadRowError` (skippable with ``--skip-bad-rows``). A source that cannot be read at all (no such file, a
Parquet file without the columns rows need, a corrupt archive, an empty folder, an unknown dataset id) raises
:class:`SourceError` naming the file or id, and the row reached: never a silently short dataset. Every source is
opened (checked) before any is read, all before anything is written.

The ``locator`` (two integers) reads the row again (:meth:`Source.rows_at`), so a run keeps an index of its rows,
not the rows (:mod:`speculators_v016.run.row_index`); how, by format:

* ``.json``/``.jsonl``: the byte offset and the line or element number; a seek and one row read;
* ``.jsonl.gz``/``.jsonl.zst``: the offset in the decompressed text and the line. A compressed stream cannot seek,
  so rows are asked for many at a time and read in one pass over the archive in line order, only the asked rows'
  lines kept; a shard asks for :data:`PREFETCH_ROWS` rows at a time: one decompression pass per that many rows of
  the shard, memory for that many rows (decompress a large archive once, or convert it to Parquet, where a shard
  holding most of it is read many times);
* Parquet: the file's number in the source and the row's number in the file; the row groups holding the asked rows
  are decoded once each (their used columns) and the rows taken from them, :data:`PREFETCH_ROWS` rows at a time;
* ``save_to_disk`` folders and hub datasets: the row's number; a take from the memory-mapped Arrow table;
* a name upstream's loader knows: the row's number in what the loader returns (kept loaded).

A file changed after it was first read (device, inode, size, modification or status-change time) is refused by name
when a row is read again, never read.

Rows whose content is exactly another's (:data:`CONVERSATION_FIELDS` or :data:`PRETOKENIZED_FIELDS`, as canonical
JSON: keys sorted, other fields ignored) are duplicates: the first in the run's input order (sources in the order
given, each in its own order) is kept, the others are dropped at read time and counted (``duplicate row``), by a
128-bit digest, so no shard has to see another shard's tokens to agree. Arrow-backed rows (Parquet, ``datasets``)
hold a struct field absent from a row as null: such nulls are read as absent keys, so the same rows in JSON Lines
and in Parquet are the same rows.

A folder given is read without following a link out of it: an entry that is a link to a file outside the folder is
refused, naming it (``huggingface_hub``'s snapshot folders link into its blob store: give a copy, e.g. what
``hf download --local-dir`` writes). No file name read comes from data: a ``save_to_disk`` folder's
``state.json`` names its data files, and each must be a plain file name of that folder.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from speculators_v016.run import row_shape
from speculators_v016.run.key_table import KeyTable
from speculators_v016.run.turns import MEDIA_KEYS, SYSTEM_KEY, BadRowError
from speculators_v016.store.run_config import file_sha256

#: the fields of a conversation row that are read (speculators_v016.run.turns): its content, for duplicates
CONVERSATION_FIELDS = ("conversations", "messages", "tools", SYSTEM_KEY, *MEDIA_KEYS)
#: the fields of a pre-tokenized row
PRETOKENIZED_FIELDS = ("input_ids", "loss_mask")
#: what ``--skip-bad-rows``' summary calls a row dropped as a duplicate
DUPLICATE = "duplicate row"

#: rows of a Parquet file or an Arrow dataset decoded at a time
BATCH_ROWS = 256
_MAX = re.compile(r"#max=(\d+)$")
_SPLIT = re.compile(r"\w+(\.\w+)*")  # the datasets library's split names
_DATASET_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_CONFIG = re.compile(r"[\w.-]+")
_HUB_SHARD = re.compile(r"(?P<split>\w+?)-\d{5}-of-\d{5}.*\.parquet")  # the hub's Parquet file names
_JSON_SUFFIXES = (".json", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")


class SourceError(BadRowError):
    """A ``--train-data-path`` value that cannot be read as a whole (never skipped): the message names it."""


class Duplicates:
    """The rows taken so far, across the run's sources: :meth:`seen` is True for a row whose content (its used
    fields, canonical JSON) an earlier row had. ``keep``: never a duplicate.

    A row's content is known by a 128-bit digest of its canonical JSON; a plain row's
    (:mod:`speculators_v016.run.row_shape`) first by its key, the hash of its :class:`~speculators_v016.run.
    row_shape.PlainRow`, whether it was read in bulk, its digest not computed
    (:meth:`plain_keys`) or parsed (:meth:`seen`): only where two plain rows' keys are equal are their digests computed (the earlier row read again
    by ``resolve``) and compared, so the rows dropped are exactly those whose digests are equal."""

    def __init__(self, keep: bool = False):
        self.keep, self._digests = keep, set()
        # plain key -> the first such row: its position among the kept rows (>= 0: its place in ``kept``) or its
        # digest (-1 - i: the i-th 16 bytes of _first_digests); compact, as a million rows' keys are (run/key_table.py)
        self._first = KeyTable()
        self._first_digests = bytearray()
        self._exact: dict[int, set] = {}  # plain key -> the digests of the rows of that key (after a second one)
        # the kept rows' (source, offset, number), three sequences the reader's caller fills as it keeps rows (the
        # row index's own arrays: no copy of the first rows' places is kept here)
        self.kept: tuple = ((), (), ())
        self.resolve: dict[int, Callable] = {}  # source number -> its row at (offset, number), as json.loads gives it

    @staticmethod
    def digest(row) -> bytes | None:
        """The digest of a row's content (None: not JSON content, e.g. bytes from a binary column)."""
        fields = PRETOKENIZED_FIELDS if "input_ids" in row else CONVERSATION_FIELDS
        content = {k: row[k] for k in fields if k in row}
        try:
            text = json.dumps(content, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
        except (TypeError, ValueError):  # not JSON content (bytes from a binary column): the reader refuses it
            return None
        return hashlib.blake2b(text.encode("ascii"), digest_size=16).digest()

    def seen(self, row) -> bool:
        if self.keep or not isinstance(row, dict):
            return False
        digest = self.digest(row)
        if digest is None:
            return False
        key = row_shape.key_of(row)
        if key is not None:
            return self._seen_key(key, digest)
        if digest in self._digests:
            return True
        self._digests.add(digest)
        return False

    def plain_keys(self) -> KeyTable | None:
        """For plain rows read in bulk (:mod:`speculators_v016.run.line_scan`, a block's keys at once): the keys
        seen (a :class:`~speculators_v016.run.key_table.KeyTable`; None: duplicates are kept). A row whose key (its
        PlainRow's hash) is not in the table is no duplicate: the reader adds the key, valued with the position the
        row will have in :attr:`kept` (the kept rows' source, offset and line, filled by the caller); else, once
        every row before it is in :attr:`kept`, :meth:`seen_again` decides."""
        return None if self.keep else self._first

    def seen_again(self, key: int, row) -> bool:
        """:meth:`seen` of a plain row read in bulk whose key an earlier plain row had (``row``: as parsed)."""
        return self._seen_key(key, self.digest(row))

    def _seen_key(self, key: int, digest: bytes) -> bool:
        first = self._first.get(key)
        if first is None:
            self._first[key] = -1 - len(self._first_digests) // 16
            self._first_digests += digest
            return False
        exact = self._exact.get(key)
        if exact is None:
            exact = self._exact[key] = {self._digest_of(first)}
        if digest in exact:
            return True
        exact.add(digest)
        return False

    def _digest_of(self, first: int) -> bytes:
        if first < 0:
            at = 16 * (-1 - first)
            return bytes(self._first_digests[at : at + 16])
        source, offset, number = (int(place[first]) for place in self.kept)
        return self.digest(self.resolve[source](offset, number))


#: where rows of a source that cannot seek (compressed JSON Lines, Parquet) are gathered for: rows of a shard
#: read in one pass over the source (see :meth:`Source.rows_at` and speculators_v016.run.prepared)
PREFETCH_ROWS = 16384


def stamp(path: Path) -> tuple[int, ...]:
    """What tells a file changed since it was read: device, inode, size, modification and status-change times."""
    info = path.stat()
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


class _Stamped:
    """The files a reader reads, with their stamps as first seen: :meth:`check` refuses one changed since."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.stamps = [stamp(f) for f in files]

    def check(self) -> None:
        for path, seen in zip(self.files, self.stamps, strict=True):
            try:
                now = stamp(path)
            except OSError:
                now = None
            if now != seen:
                raise BadRowError(f"{path}: changed since the run read it (its size, times or inode)")


@dataclass
class Source:
    """One ``--train-data-path`` value, checked: :meth:`rows` reads it once, in order, with each row's locator;
    :meth:`rows_at` reads rows again by locator; :meth:`describe` says what was read, :meth:`identity` what will
    be (the row index's cache key).

    Its ``reader`` knows the format: ``rows()`` yields ``(where, row or BadRowError, locator)``, a locator being
    two integers; ``rows_at(locators)`` gives ``(where, row or BadRowError)`` for each, in the order asked;
    ``seekable``: a row costs a seek (False: a call costs a pass over what holds the rows, so rows are asked for
    many at a time)."""

    given: str
    max_rows: int | None
    reader: object
    description: Callable[[], dict]
    skipped: Counter = field(default_factory=Counter)
    _described: dict | None = None

    @property
    def seekable(self) -> bool:
        return self.reader.seekable

    def rows(self, duplicates: Duplicates) -> Iterator[tuple[str, object, tuple[int, int]]]:
        """(where, row or BadRowError, locator): the source's rows up to its cap, duplicates dropped and counted."""
        taken = 0
        for where, row, locator in self.reader.rows():
            if duplicates.seen(row):
                self.skipped[DUPLICATE] += 1
                continue
            yield where, row, locator
            taken += 1
            if self.max_rows is not None and taken >= self.max_rows:
                return

    def rows_at(self, locators: list) -> list[tuple[str, object]]:
        """(where, row or BadRowError) of each locator (as :meth:`rows` gave them), in that order; BadRowError
        where a file changed since it was read."""
        return self.reader.rows_at(locators) if locators else []

    def identity(self) -> dict:
        """What the rows read depend on, known before reading: the description by content (files' sha256, the
        split, the config) and the cap."""
        if self._described is None:
            self._described = self.description()
        return {**self._described, "max_rows": self.max_rows}

    def describe(self) -> dict:
        """For data_config.json's ``sources`` (and the resume fingerprint): what was read, by content."""
        if self._described is None:
            self._described = self.description()
        out = dict(self._described)
        if self.max_rows is not None:
            out["max_rows"] = self.max_rows
        if self.skipped[DUPLICATE]:  # absent without: a folder of an earlier release, same rows, still resumes
            out["duplicate_rows"] = self.skipped[DUPLICATE]
        return out

    def bytes(self) -> int:
        """The bytes of its files (a progress bar's total)."""
        return sum(f.stat().st_size for f in getattr(self.reader, "files", ()))

    def bytes_at(self, locator) -> int:
        """How far into :meth:`bytes` the row at ``locator`` is, where a locator says (a JSON file's offset)."""
        return int(locator[0]) if isinstance(self.reader, _JsonFile) else 0

    def close(self) -> None:
        self.reader.close()


@dataclass(frozen=True)
class JsonReaders:
    """The JSON readers (speculators_v016.run.dataset): ``file(path)`` a .json/.jsonl file's ``(where, row,
    locator)``, ``lines(path, fh)`` JSON Lines from a binary stream, ``row_at(path, fh, array, locator)`` one row
    again, ``is_array(path, fh)`` a .json array or not, ``line_row(where, raw, first)`` one line's row."""

    file: Callable
    lines: Callable
    row_at: Callable
    is_array: Callable
    line_row: Callable


def open_source(given: str, hf_cache_dir: str | None, readers: JsonReaders, digests=None) -> Source:
    """``given`` (a ``--train-data-path`` value) checked and ready to read, or SourceError naming it. ``digests``:
    where files' sha256 come from (a :class:`speculators_v016.store.digest_memo.DigestMemo`; None: hashed)."""
    what, max_rows = split_cap(given)
    sha = digests.sha256 if digests is not None else file_sha256
    path = Path(what)
    if path.is_dir():
        reader, description = _folder(given, path, None, sha)
    elif path.exists():
        reader, description = _file(given, path, readers, sha)
    elif what.lower().endswith(_JSON_SUFFIXES):
        raise SourceError(f"--train-data-path {given}: no such file")
    elif "@" in what and Path(what.rpartition("@")[0]).is_dir():
        folder, _, split = what.rpartition("@")
        reader, description = _folder(given, Path(folder), _split_name(given, split), sha)
    elif "@" in what:
        reader, description = _hub(given, what, hf_cache_dir, sha)
    else:
        reader, description = _upstream(given, what, hf_cache_dir)
    return Source(given, max_rows, reader, description)


def split_cap(given: str) -> tuple[str, int | None]:
    """(what, N) of ``WHAT#max=N`` (N None without a cap)."""
    match = _MAX.search(given)
    if match is None:
        if "#max" in given:
            raise SourceError(f"--train-data-path {given}: a cap is written WHAT#max=N, N a whole number")
        return given, None
    if int(match.group(1)) < 1:
        raise SourceError(f"--train-data-path {given}: a cap keeps at least 1 row (#max=N, N at least 1)")
    return given[: match.start()], int(match.group(1))


def _split_name(given: str, split: str) -> str:
    if not _SPLIT.fullmatch(split):
        raise SourceError(f"--train-data-path {given}: {split!r} is not a split name (letters, digits, _ and .)")
    return split


def _files_sha(folder: Path, files: list[Path], sha) -> list[dict]:
    return [{"name": str(f.relative_to(folder)), "sha256": sha(f)} for f in files]


# --- files ---------------------------------------------------------------------------------------------------


class _JsonFile(_Stamped):
    """A .json/.jsonl file: rows streamed, read again by seeking to a locator (byte offset, line or element)."""

    seekable = True

    def __init__(self, path: Path, readers: JsonReaders):
        super().__init__([path])
        self.path, self.readers = path, readers
        self._fh, self._array = None, False

    def rows(self):
        yield from self.readers.file(self.path)

    def rows_at(self, locators):
        if self._fh is None:
            self.check()
            self._fh = self.path.open("rb")
            self._array = self.readers.is_array(self.path, self._fh)
        return [self.readers.row_at(self.path, self._fh, self._array, tuple(loc)) for loc in locators]

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class _Archive(_Stamped):
    """A compressed JSON Lines file: it cannot seek, so rows asked for again are read in one pass, in line order,
    only their lines' bytes kept (:meth:`rows_at`); a locator is (offset in the decompressed text, line)."""

    seekable = False

    def __init__(self, path: Path, kind: str, opener: Callable, readers: JsonReaders, errors: tuple = ()):
        super().__init__([path])
        self.path, self.kind, self.opener, self.readers, self.errors = path, kind, opener, readers, errors

    def rows(self):
        yield from _archive_rows(self.path, self.opener(), self.kind, self.readers.lines, self.errors)

    def rows_at(self, locators):
        self.check()
        wanted = sorted({int(n) for _, n in locators})
        found: dict[int, bytes] = {}
        at, number = 0, 0
        try:
            with self.opener() as fh:
                for number, raw in enumerate(fh, 1):
                    if number == wanted[at]:
                        found[number] = raw
                        at += 1
                        if at == len(wanted):
                            break
        except (OSError, EOFError, zlib.error, *self.errors) as exc:
            raise SourceError(f"{self.path}: not a readable {self.kind} archive ({exc}; after line {number})") from None
        out = []
        for _, n in locators:
            where = f"{self.path}:{int(n)}"
            row = self.readers.line_row(where, found[int(n)], int(n) == 1) if int(n) in found else None
            if row is None:
                row = BadRowError(f"{where}: no row where one was read before (the file changed?)")
            out.append((where, row))
        return out

    def close(self) -> None:
        pass


def _file(given: str, path: Path, readers: JsonReaders, sha):
    if not path.is_file():
        raise SourceError(f"--train-data-path {given}: not a regular file")
    name = path.name.lower()
    described = lambda: {"path": str(path.resolve()), "sha256": sha(path)}  # noqa: E731 - one line each
    if name.endswith(".parquet"):
        _parquet_columns(path)
        return _Parquet(str(path), [path]), described
    if name.endswith(".jsonl.gz"):
        return _Archive(path, "gzip", lambda: gzip.open(path, "rb"), readers), described
    if name.endswith(".jsonl.zst"):
        zstandard = _zstandard(given)
        opener = lambda: _zstd_stream(path, zstandard)  # noqa: E731 - one line
        return _Archive(path, "Zstandard", opener, readers, (zstandard.ZstdError,)), described
    if path.suffix in (".json", ".jsonl"):
        return _JsonFile(path, readers), described
    raise SourceError(
        f"--train-data-path {given}: not a {', '.join(_JSON_SUFFIXES[:-1])} or .parquet file, nor a folder of "
        "Parquet files or of datasets' save_to_disk"
    )


def _zstandard(given: str):
    try:
        import zstandard  # noqa: PLC0415 - only .zst inputs need it
    except ImportError:
        raise SourceError(
            f"--train-data-path {given}: reading Zstandard (.zst) needs the 'zstandard' package, which is not "
            "installed: pip install zstandard (or decompress the file: zstd -d)"
        ) from None
    return zstandard


class _ZstdStream(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame; a file that ends inside a frame is an EOFError (the
    ``zstandard`` package's own stream reader ends there quietly: a short dataset)."""

    def __init__(self, fh, zstandard):
        self.fh, self.dctx, self.frame = fh, zstandard.ZstdDecompressor(), None
        self.pending, self.offset, self.done = b"", 0, False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.offset >= len(self.pending):
            if self.done:
                return 0
            block = self.fh.read(1 << 16)
            if not block:
                self.done = True
                if self.frame is not None and not self.frame.eof:
                    raise EOFError("the archive ends inside a Zstandard frame (truncated)")
                return 0
            self.pending, self.offset = self._decompress(block), 0
        n = min(len(buffer), len(self.pending) - self.offset)
        buffer[:n] = self.pending[self.offset : self.offset + n]
        self.offset += n
        return n

    def _decompress(self, block: bytes) -> bytes:
        out = []
        while block:
            if self.frame is None or self.frame.eof:
                self.frame = self.dctx.decompressobj()
            out.append(self.frame.decompress(block))
            block = self.frame.unused_data if self.frame.eof else b""
        return b"".join(out)

    def close(self):
        self.fh.close()
        super().close()


def _zstd_stream(path: Path, zstandard):
    return io.BufferedReader(_ZstdStream(path.open("rb"), zstandard), 1 << 16)


def _archive_rows(path: Path, fh, kind: str, lines: Callable, errors: tuple = ()):
    """JSON Lines rows of a compressed file; a corrupt or truncated archive (``errors``, beside the standard
    library's) is a SourceError naming the file and the last line read, after whatever rows came before it (the
    run stops: never a short dataset)."""
    where = None
    try:
        with fh:
            for where, row, locator in lines(path, fh):
                yield where, row, locator
    except BadRowError:
        raise
    except (OSError, EOFError, zlib.error, *errors) as exc:
        reached = f"after {where}" if where else "before its first line"
        raise SourceError(f"{path}: not a readable {kind} archive ({exc}; {reached})") from None


# --- Parquet and Arrow -----------------------------------------------------------------------------------------


def _needed(names, label: str) -> list[str]:
    """The used columns among ``names`` (a file's or a dataset's), or SourceError naming what is missing."""
    names = list(names)
    if "input_ids" in names or "loss_mask" in names:
        missing = [c for c in PRETOKENIZED_FIELDS if c not in names]
        if missing:
            raise SourceError(
                f"{label}: pre-tokenized rows need the columns input_ids and loss_mask; missing: "
                f"{', '.join(missing)} (its columns: {', '.join(names) or 'none'})"
            )
        return list(PRETOKENIZED_FIELDS)
    if "conversations" in names or "messages" in names:
        return [c for c in CONVERSATION_FIELDS if c in names]
    raise SourceError(
        f"{label}: has none of the columns rows need: conversations or messages (a conversation), or input_ids "
        f"and loss_mask (pre-tokenized); missing: conversations, messages, input_ids, loss_mask (its columns: "
        f"{', '.join(names) or 'none'})"
    )


def _parquet_file(path: Path):
    import pyarrow.parquet as pq  # noqa: PLC0415 - pyarrow is slow to import; only Parquet inputs need it

    try:
        return pq.ParquetFile(path, arrow_extensions_enabled=False)
    except Exception as exc:  # pyarrow's ArrowInvalid, OSError
        raise SourceError(f"{path}: not a readable Parquet file ({exc})") from None


def _parquet_columns(path: Path) -> list[str]:
    parquet = _parquet_file(path)
    try:
        return _needed(parquet.schema_arrow.names, str(path))
    finally:
        parquet.close()


def _without_nulls(value):
    """Arrow's nulls for struct fields a row lacks, read as absent keys (the rows JSON would give)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _batch_rows(label: str, batches, start: int = 0):
    """(where, row, index) of Arrow record batches; ``label`` names the file or dataset."""
    index = start
    for batch in batches:
        for row in batch.to_pylist():
            yield f"{label} row {index}", _without_nulls(row), index
            index += 1


def _parquet_rows(path: Path):
    """(where, row, its row number in the file), a batch at a time."""
    parquet = _parquet_file(path)
    columns = _needed(parquet.schema_arrow.names, str(path))
    where = None
    try:
        for where, row, index in _batch_rows(str(path), parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns)):
            yield where, row, index
    except BadRowError:
        raise
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise SourceError(f"{path}: not a readable Parquet file ({exc}; after {where or 'no row'})") from None
    finally:
        parquet.close()


def _parquet_at(path: Path, numbers: list[int]) -> list:
    """The rows numbered ``numbers`` of a Parquet file, in that order: each row group holding one of them decoded
    once (its used columns), the rows taken from it."""
    import numpy as np  # noqa: PLC0415 - numpy only where rows are read again

    parquet = _parquet_file(path)
    try:
        columns = _needed(parquet.schema_arrow.names, str(path))
        meta = parquet.metadata
        starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        at = np.asarray(numbers, np.int64)
        if len(at) and (at.min() < 0 or at.max() >= starts[-1]):
            raise BadRowError(f"{path}: fewer rows than when the run read it (the file changed?)")
        groups = np.searchsorted(starts, at, side="right") - 1
        out: list = [None] * len(at)
        for group in np.unique(groups):
            picked = np.flatnonzero(groups == group)
            table = parquet.read_row_group(int(group), columns=columns)
            rows = table.take(at[picked] - starts[group]).to_pylist()
            for j, row in zip(picked.tolist(), rows, strict=True):
                out[j] = _without_nulls(row)
        return out
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        if isinstance(exc, BadRowError):
            raise
        raise SourceError(f"{path}: not a readable Parquet file ({exc})") from None
    finally:
        parquet.close()


class _Parquet(_Stamped):
    """Parquet files read in order: a locator is (file number, row number in that file). Parquet reads a row
    group at a time, so rows asked for again are read many at a time (:func:`_parquet_at`)."""

    seekable = False

    def __init__(self, label: str, files: list[Path]):
        super().__init__(files)
        self.label = label

    def rows(self):
        for number, path in enumerate(self.files):
            for where, row, index in _parquet_rows(path):
                yield where, row, (number, index)

    def rows_at(self, locators):
        self.check()
        by_file: dict[int, list[int]] = {}
        for j, (number, _) in enumerate(locators):
            by_file.setdefault(int(number), []).append(j)
        out: list = [None] * len(locators)
        for number, picks in by_file.items():
            path = self.files[number]
            rows = _parquet_at(path, [int(locators[j][1]) for j in picks])
            for j, row in zip(picks, rows, strict=True):
                out[j] = (f"{path} row {int(locators[j][1])}", row)
        return out

    def close(self) -> None:
        pass


class _Arrow(_Stamped):
    """A ``datasets.Dataset`` (memory-mapped Arrow files): rows in order, its used columns a batch at a time; a
    locator is (row number, row number), read again by number (a take of the memory-mapped table)."""

    seekable = True

    def __init__(self, label: str, dataset, columns: list[str], files: list[Path]):
        super().__init__(files)
        self.label, self.view = label, dataset.select_columns(columns).with_format("arrow")

    def rows(self):
        for where, row, index in _batch_rows(self.label, (t for t in self.view.iter(batch_size=BATCH_ROWS))):
            yield where, row, (index, index)

    def rows_at(self, locators):
        self.check()
        numbers = [int(n) for n, _ in locators]
        if any(not 0 <= n < len(self.view) for n in numbers):
            raise BadRowError(f"{self.label}: fewer rows than when the run read it (the dataset changed?)")
        rows = self.view[numbers].to_pylist()
        return [(f"{self.label} row {n}", _without_nulls(r)) for n, r in zip(numbers, rows, strict=True)]

    def close(self) -> None:
        pass


# --- folders -------------------------------------------------------------------------------------------------


def _inside(folder: Path, entry: Path, given: str) -> Path:
    """``entry`` of ``folder``, a regular file reached without a link out of ``folder``; else SourceError."""
    if entry.is_symlink():
        target = entry.resolve()
        if not target.is_relative_to(folder.resolve()):
            raise SourceError(
                f"--train-data-path {given}: {entry} is a link to {os.readlink(entry)}, outside the folder; a folder "
                "is read without following links out of it (copy the files in)"
            )
    if not entry.is_file():
        raise SourceError(f"--train-data-path {given}: {entry} is not a regular file")
    return entry


def _folder(given: str, folder: Path, split: str | None, sha):
    if (folder / "dataset_dict.json").exists() or (folder / "state.json").exists():
        return _saved(given, folder, split, sha)
    with os.scandir(folder) as entries:
        names = sorted(e.name for e in entries if e.name.endswith(".parquet"))
    if not names:
        raise SourceError(
            f"--train-data-path {given}: a folder holding no *.parquet files and not a datasets save_to_disk folder "
            "(no state.json or dataset_dict.json)"
        )
    splits = sorted({m.group("split") for n in names if (m := _HUB_SHARD.fullmatch(n))})
    if split is not None:
        names = [n for n in names if n == f"{split}.parquet" or n.startswith(f"{split}-")]
        if not names:
            raise SourceError(
                f"--train-data-path {given}: no Parquet file of split {split!r} ({split}-*.parquet) in {folder} "
                f"(splits there: {', '.join(splits) or 'none named'})"
            )
    elif len(splits) > 1:
        raise SourceError(
            f"--train-data-path {given}: {folder} holds the Parquet files of several splits ({', '.join(splits)}); "
            f"name one: {folder}@{splits[0]}"
        )
    files = [_inside(folder, folder / n, given) for n in names]
    for f in files:
        _parquet_columns(f)

    def description():
        out = {"path": str(folder.resolve()), "files": _files_sha(folder, files, sha)}
        return out if split is None else {**out, "split": split}

    return _Parquet(str(folder), files), description


def _json_file(path: Path, given: str) -> dict:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise SourceError(f"--train-data-path {given}: {path} is not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise SourceError(f"--train-data-path {given}: {path} is not a JSON object")
    return value


def _saved(given: str, folder: Path, split: str | None, sha):
    """A folder of ``datasets``' ``save_to_disk``: a Dataset, or a DatasetDict's split."""
    root = folder
    if (folder / "dataset_dict.json").exists():
        splits = _json_file(_inside(folder, folder / "dataset_dict.json", given), given).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
            raise SourceError(f"--train-data-path {given}: {folder}/dataset_dict.json lists no splits")
        if split is None or split not in splits:
            why = "is a DatasetDict: name a split" if split is None else f"has no split {split!r}"
            splits = sorted(splits)
            raise SourceError(
                f"--train-data-path {given}: {folder} (datasets' save_to_disk) {why} (splits: {', '.join(splits)}), "
                f"e.g. {folder}@{splits[0] if splits else 'SPLIT'}"
            )
        folder = folder / split
        if folder.is_symlink() or not folder.is_dir():
            raise SourceError(f"--train-data-path {given}: {folder} is not a folder of the dataset")
    elif split is not None:
        raise SourceError(f"--train-data-path {given}: {folder} holds one dataset, no splits: give it without @{split}")
    state = _json_file(_inside(root, folder / "state.json", given), given)
    _inside(root, folder / "dataset_info.json", given)
    named = state.get("_data_files")
    if not isinstance(named, list) or not named:
        raise SourceError(f"--train-data-path {given}: {folder}/state.json names no data files")
    files = []
    for entry in named:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise SourceError(
                f"--train-data-path {given}: {folder}/state.json names a data file {name!r} that is not a plain file "
                "name of its folder"
            )
        files.append(_inside(root, folder / name, given))
    import datasets  # noqa: PLC0415 - datasets is slow to import; only these inputs need it

    try:
        dataset = datasets.load_from_disk(str(folder), keep_in_memory=False)
    except Exception as exc:  # datasets raises many kinds
        raise SourceError(f"--train-data-path {given}: {folder} cannot be read by datasets ({exc})") from None
    columns = _needed(dataset.column_names, f"--train-data-path {given}")
    label = f"{root}@{split}" if split else str(root)

    def description():
        out = {"path": str(root.resolve()), "files": _files_sha(root, [folder / "state.json", *files], sha)}
        return out if split is None else {**out, "split": split}

    return _Arrow(label, dataset, columns, [folder / "state.json", *files]), description


# --- datasets by name ----------------------------------------------------------------------------------------


def _hub(given: str, what: str, hf_cache_dir: str | None, sha):
    """``ORG/NAME[:CONFIG]@SPLIT`` through ``datasets.load_dataset`` (its cache where no hub is reachable)."""
    base, _, split = what.rpartition("@")
    name, _, config = base.partition(":")
    if Path(base).exists():
        raise SourceError(f"--train-data-path {given}: {base} is a file: a split (@{split}) names a folder's")
    _split_name(given, split)
    if not _DATASET_ID.fullmatch(name) or ".." in name or (config and not _CONFIG.fullmatch(config)):
        raise SourceError(
            f"--train-data-path {given}: no such file or folder, and not a dataset id (ORG/NAME@SPLIT or "
            "ORG/NAME:CONFIG@SPLIT)"
        )
    import datasets  # noqa: PLC0415 - datasets is slow to import; only these inputs need it

    logger.info("loading dataset {} (config {}, split {}) with datasets", name, config or "default", split)
    builder, dataset = None, None
    try:  # load_dataset's steps, the builder checked before it reads anything
        builder = datasets.load_dataset_builder(name, config or None, cache_dir=hf_cache_dir)
        if _builder_kind(builder) in HUB_BUILDERS:
            builder.download_and_prepare()
            dataset = builder.as_dataset(split=split)
    except Exception as exc:  # datasets raises many kinds: the id, the config, the split, the hub, the cache
        cache = hf_cache_dir or datasets.config.HF_DATASETS_CACHE
        raise SourceError(
            f"--train-data-path {given}: no such file or folder, and dataset {name!r} (config {config or 'default'}, "
            f"split {split}) cannot be loaded: no hub reachable that has it and not in the datasets cache {cache}, "
            f"or no such config or split ({type(exc).__name__}: {exc})"
        ) from None
    if dataset is None:
        raise SourceError(
            f"--train-data-path {given}: dataset {name!r} would be read by datasets' {_builder_kind(builder)!r} "
            f"builder; its rows are read from {', '.join(sorted(HUB_BUILDERS))} files only"
        )
    if not isinstance(dataset, datasets.Dataset):
        raise SourceError(f"--train-data-path {given}: {name} split {split} is not one dataset")
    columns = _needed(dataset.column_names, f"--train-data-path {given}")
    files = [Path(f["filename"]) for f in dataset.cache_files]

    def description():
        return {
            "dataset": name,
            "config": config or None,
            "split": split,
            "files": [{"name": f.name, "sha256": sha(f)} for f in files],
        }

    return _Arrow(f"{base}@{split}", dataset, columns, files), description


#: the builders of ``datasets`` a hub dataset may be read by: data files that are data, never code or pickles
#: (``cache``: a copy in the datasets cache, Arrow files)
HUB_BUILDERS = frozenset({"arrow", "cache", "csv", "json", "parquet"})


def _builder_kind(builder) -> str:
    """The packaged module a ``datasets`` builder comes from (``parquet``, ``json``, ``cache``...)."""
    module = type(builder).__module__
    return module.rsplit(".", 1)[-1] if module.startswith("datasets.packaged_modules.") else module


def _upstream(given: str, name: str, hf_cache_dir: str | None):
    """A dataset name upstream's loader knows (it normalizes the rows to ``conversations``)."""
    from speculators.data_generation.preprocessing import DATASET_CONFIGS  # noqa: PLC0415 - upstream is slow

    if name not in DATASET_CONFIGS:
        raise SourceError(
            f"--train-data-path {given}: no such file, and not a dataset name upstream knows "
            f"({', '.join(sorted(DATASET_CONFIGS))}) nor a dataset id with its split (ORG/NAME@SPLIT, "
            "ORG/NAME:CONFIG@SPLIT)"
        )

    return _Upstream(name, hf_cache_dir), (lambda: {"name": name})


class _Upstream:
    """A dataset name upstream's loader knows: loaded when first read, its rows by number (a locator: (row number,
    row number)). Named, not hashed: the row index of such a source is never cached."""

    seekable = True

    def __init__(self, name: str, hf_cache_dir: str | None):
        self.name, self.hf_cache_dir, self.data = name, hf_cache_dir, None

    def _loaded(self):
        if self.data is None:
            from speculators.data_generation.preprocessing import load_raw_dataset  # noqa: PLC0415 - slow import

            logger.info("loading dataset {} with upstream's loader", self.name)
            self.data = load_raw_dataset(self.name, cache_dir=self.hf_cache_dir)
        return self.data

    def rows(self):
        for i, row in enumerate(self._loaded()):
            yield f"{self.name} row {i}", row, (i, i)

    def rows_at(self, locators):
        data = self._loaded()
        return [(f"{self.name} row {int(n)}", data[int(n)]) for n, _ in locators]

    def close(self) -> None:
        pass
