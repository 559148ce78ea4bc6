"""The index of a run's rows: for each row kept as it is read, its input, its place there and a cheap fact.

Reading every input once (:func:`speculators_v016.run.dataset.scan_rows`: rows checked as a run reads them,
bad, empty and duplicate rows dropped and counted before the shuffle, as always) gives three numpy arrays: the
row's source, its locator in that source (two integers: a JSON file's byte offset and line or element number, a
compressed file's offset in its text and line, a Parquet file's number and row, a ``datasets`` row's number:
:mod:`speculators_v016.run.sources`) and its size (turns of a conversation, for turn dropout; ids of a
pre-tokenized row). A run keeps this, not the rows: 14 bytes a row where the values allow (fewer than 256 inputs,
fewer than 256 turns a row, lines within int32: :mod:`speculators_v016.run.narrow_column`), more where they do not;
a shard reads its own rows again by locator (:meth:`RowIndex.rows`). Duplicates are told apart here, by a 16-byte
digest of each row's content kept while the inputs are read (:class:`speculators_v016.run.sources.Duplicates`),
so every shard drops the same rows. A JSON Lines file read with :func:`~speculators_v016.run.turns.read_chat` is
read in bulk (:mod:`speculators_v016.run.line_scan`: plain rows decoded a block at a time, the same rows kept as row
by row); an input whose sha256 is not remembered is hashed on a thread while the rows are read (sha256 lets go of
the GIL), the cache asked after.

Where every input is named by content (its files' sha256: :meth:`speculators_v016.run.sources.Source.identity`),
the index is kept in the prepared-rows cache (:mod:`speculators_v016.store.prepared_cache`), keyed by
:func:`index_key`: the inputs (files' sha256, each source's split, config and cap), the reader, ``--skip-bad-rows``
and ``--keep-duplicate-rows``; a second run, another shard or a resume reads no row to index, and takes the files'
sha256 from :mod:`speculators_v016.store.digest_memo` (read again only where a file's stat changed). The cached
arrays are memory-mapped: a shard reads the pages of its own rows.
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from loguru import logger

from speculators_v016.run.dataset import BadRowError, open_sources, read_row, scan_rows
from speculators_v016.run.narrow_column import NarrowColumn
from speculators_v016.run.sources import PREFETCH_ROWS
from speculators_v016.run.turns import READ_RULES, read_chat
from speculators_v016.store import prepared_cache
from speculators_v016.store.digest_memo import DigestMemo, NotRemembered

#: what an index is, in its cache key: another version's entries are other entries
VERSION = "row-index-3"


@dataclass
class RowIndex:
    kind: str  # "conversations" or "pretokenized"
    sources: list  # the open sources (speculators_v016.run.sources.Source), in the order given
    skipped: Counter  # rows dropped as read, by reason
    # per row, each in the narrowest integer dtype that holds its values (run/narrow_column.py)
    source: np.ndarray  # uint8, int32 or int64
    offset: np.ndarray  # int64: the locator's first integer
    number: np.ndarray  # int32 or int64: the locator's second integer
    size: np.ndarray  # uint8, int32 or int64: turns (conversations) or ids (pre-tokenized)
    reader: object = read_chat
    key: str | None = None  # index_key (None: the inputs are not all named by content)

    def __len__(self) -> int:
        return len(self.source)

    @property
    def descriptions(self) -> list[dict]:
        return [s.describe() for s in self.sources]

    @property
    def seekable(self) -> bool:
        """Every input reads a row by a seek (else some rows are best read many at a time: :meth:`rows`)."""
        return all(s.seekable for s in self.sources)

    def row(self, i: int):
        """``(where, value)`` of row ``i``, read again from its input: ``(ids, mask)`` or a ChatRow."""
        return self.rows([i])[0]

    def rows(self, indices) -> list:
        """``(where, value)`` of each row of ``indices``, in that order, read again from their inputs (each
        input asked once, for all of its rows: one pass over a compressed file, a row group of Parquet once)."""
        indices = np.asarray(indices, np.int64)
        out: list = [None] * len(indices)
        of = np.asarray(self.source[indices]) if len(indices) else np.zeros(0, np.int32)
        for number in np.unique(of).tolist():
            picks = np.flatnonzero(of == number)
            at = indices[picks]
            locators = list(
                zip(np.asarray(self.offset[at]).tolist(), np.asarray(self.number[at]).tolist(), strict=True)
            )
            for j, (where, raw) in zip(picks.tolist(), self.sources[number].rows_at(locators), strict=True):
                kind, value = read_row(where, raw, self.reader)
                if kind != self.kind or value is None:
                    raise BadRowError(f"{where}: not the row read there before (the input changed?)")
                out[j] = (where, value)
        return out

    def iter_rows(self, indices):
        """``(where, value)`` of each row of ``indices``, in order, read :data:`~speculators_v016.run.sources.
        PREFETCH_ROWS` at a time where an input cannot seek (else 512): memory for those rows only."""
        block = 512 if self.seekable else PREFETCH_ROWS
        for start in range(0, len(indices), block):
            yield from self.rows(indices[start : start + block])

    def close(self) -> None:
        for source in self.sources:
            source.close()


def _size(value) -> int:
    if isinstance(value, tuple):
        return len(value[0])
    return len(getattr(value, "turns", value))


def _by_content(identity: dict) -> bool:
    """An input named by the sha256 of what it reads (a file, or every file of a folder or dataset)."""
    files = identity.get("files")
    return "sha256" in identity or (isinstance(files, list) and bool(files) and all("sha256" in f for f in files))


def index_key(sources: list, skip_bad_rows: bool, reader, keep_duplicates: bool) -> str | None:
    """The index's cache key: every input by content, with its split, config and cap, and what decides which rows
    are kept; None where an input is not named by content (a name upstream's loader knows: not kept)."""
    identities = [s.identity() for s in sources]
    if not identities or not all(_by_content(d) for d in identities):
        return None
    return json.dumps(
        {
            "version": VERSION,
            "inputs": identities,
            "skip_bad_rows": skip_bad_rows,
            "keep_duplicate_rows": keep_duplicates,
            "reader": f"{reader.__module__}.{reader.__qualname__}",
            "rows_read": READ_RULES,  # which rows are kept depends on how they are read
        },
        sort_keys=True,
    )


def build_index(
    paths: list[str],
    skip_bad_rows: bool,
    hf_cache_dir: str | None,
    *,
    reader=read_chat,
    cache: Path | None = None,
    progress=None,
    keep_duplicates: bool = False,
) -> RowIndex:
    """Index every row of ``paths`` (see the module's docstring); ``cache``: the prepared-rows folder (None: no
    cache, every input hashed); ``progress(bytes_done, rows)``: called as rows are read (a progress bar's);
    ``keep_duplicates``: rows equal to an earlier one are kept (else dropped and counted)."""
    memo = DigestMemo(cache)
    sources = open_sources(paths, hf_cache_dir, memo)
    try:
        memo.remembered_only = True
        try:  # every input's digest remembered: the key at once, and the index maybe cached
            key, keyed = index_key(sources, skip_bad_rows, reader, keep_duplicates), True
        except NotRemembered:  # an input to hash: hashed on a thread while the rows are read (sha256 lets go of
            keyed = False  # the GIL), the key checked after
        finally:
            memo.remembered_only = False
        found = _cached(cache, key, sources, reader) if keyed and cache is not None and key else None
        if found is not None:
            return found
        if keyed:
            index = _read(sources, skip_bad_rows, hf_cache_dir, reader, progress, keep_duplicates)
        else:
            with ThreadPoolExecutor(1, thread_name_prefix="input-sha256") as pool:
                keying = pool.submit(index_key, sources, skip_bad_rows, reader, keep_duplicates)
                index = _read(sources, skip_bad_rows, hf_cache_dir, reader, progress, keep_duplicates)
                key = keying.result()
            found = _cached(cache, key, sources, reader) if cache is not None and key else None
            if found is not None:  # the same index, kept by an earlier run of these same inputs
                return found
    except BaseException:
        for source in sources:
            source.close()
        raise
    index.key = key
    if cache is not None and key:
        try:  # the inputs as they were opened, still: else the key (hashed beside the read) may name other rows
            for source in sources:
                getattr(source.reader, "check", lambda: None)()
        except BaseException:
            index.close()
            raise
        _store(cache, key, index)
    return index


def _read(sources, skip_bad_rows, hf_cache_dir, reader, progress, keep_duplicates) -> RowIndex:
    # each column in the narrowest dtype its values fit (run/narrow_column.py): 14 bytes a row, usually
    source_of, offsets, numbers, sizes = NarrowColumn("Biq"), NarrowColumn("q"), NarrowColumn("iq"), NarrowColumn("Biq")
    before = np.cumsum([0] + [s.bytes() for s in sources]).tolist()  # bytes of the earlier inputs
    rows = [0]

    def take(number, locator, _where, value):
        source_of.append(number)
        offsets.append(locator[0])
        numbers.append(locator[1])
        sizes.append(_size(value))
        rows[0] += 1
        if progress is not None and rows[0] % 256 == 0:
            progress(before[number] + sources[number].bytes_at(locator), rows[0], before[-1])

    def take_plain(number, offsets_, numbers_, turns):
        source_of.extend([number] * len(turns))
        offsets.extend(offsets_)
        numbers.extend(numbers_)
        sizes.extend(turns)
        rows[0] += len(turns)
        if progress is not None and offsets_:
            progress(before[number] + offsets_[-1], rows[0], before[-1])

    kind, sources, skipped = scan_rows(
        [s.given for s in sources],
        skip_bad_rows,
        hf_cache_dir,
        take,
        reader,
        sources,
        keep_duplicates,
        take_plain,
        kept=(source_of, offsets, numbers),
    )
    if progress is not None:
        progress(None, rows[0], before[-1])
    return RowIndex(kind, sources, skipped, source_of.array(), offsets.array(), numbers.array(), sizes.array(), reader)


def _cached(cache: Path, key: str, sources: list, reader) -> RowIndex | None:
    name = prepared_cache.entry_name(key)
    try:
        found = prepared_cache.read_entry(cache, name)
    except prepared_cache.CorruptEntry as exc:
        logger.warning("{}; the row index is read again and the entry rebuilt", exc)
        return None
    except OSError as exc:
        logger.warning("the row index in {} cannot be read ({}); read again", cache / name, exc)
        return None
    if found is None or found[1].get("key") != key:
        return None
    arrays, facts = found
    if not isinstance(facts.get("source_skipped"), list) or len(facts["source_skipped"]) != len(sources):
        return None
    for source, skipped in zip(sources, facts["source_skipped"], strict=True):
        source.skipped = Counter(skipped)  # what describe() says (duplicates dropped), as when it was read
    return RowIndex(
        facts["kind"],
        sources,
        Counter(facts["skipped"]),
        arrays["source"],
        arrays["offset"],
        arrays["number"],
        arrays["size"],
        reader,
        key,
    )


def _store(cache: Path, key: str, index: RowIndex) -> None:
    arrays = {"source": index.source, "offset": index.offset, "number": index.number, "size": index.size}
    facts = {
        "kind": index.kind,
        "skipped": dict(index.skipped),
        "source_skipped": [dict(s.skipped) for s in index.sources],
        "key": key,
    }
    try:
        prepared_cache.write_entry(cache, prepared_cache.entry_name(key), arrays, facts)
    except OSError as exc:  # a cache that cannot be written costs time, never the run
        logger.warning("cannot keep the row index in {} ({})", cache, exc)
