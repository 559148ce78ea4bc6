"""A run's rows, tokenized where and when they are needed, kept in compact arrays and in a cache.

**The run's order** is that of every release: the rows kept as they are read
(:mod:`speculators_v016.run.row_index`), shuffled with the seed (datasets' shuffle) and cut to ``max_samples``.
**Numbering** (:data:`NUMBERING`): the row at position *p* of that order is sample ``start_idx + p`` and goes to
shard ``p % num_shards``, so a shard knows its rows without tokenizing anyone else's. A row dropped after
tokenizing (no assistant token within ``seq_length``, far past it, refused by the template) leaves its name
unused, counted by reason; where no row is dropped, the names and shards are those of earlier releases, which
numbered the samples kept.

**Chunks**: a shard's positions are tokenized :data:`CHUNK_ROWS` at a time (chunk *k*: the shard's positions
``k * CHUNK_ROWS`` to ``(k + 1) * CHUNK_ROWS - 1``, in order) into numpy arrays: the kept rows' ids (uint32, or
int64 for pre-tokenized ids outside it) concatenated, their offsets (int64), masks (uint8), cut flags, names;
conversations in worker processes where there are many (forked before the engine starts, as the
``datasets.map`` workers of earlier releases were). A chunk is kept in the prepared-rows cache
(:mod:`speculators_v016.store.prepared_cache`) under a name derived from :func:`prep_key` (every input's sha256,
the tokenizer's files and serialization, its chat template, ``seq_length`` and every preprocessing option) and
the chunk's place: a second run, a resume, or the same shard of another output folder reads it instead of
tokenizing. A chunk is memory-mapped from there; memory stays flat in the dataset's size.

:class:`Stream` tokenizes a shard's chunks in a background thread, a few ahead of the engine, so the first
sample is written while later rows are tokenized. :func:`prepare_samples` is the same, all at once (the check
command, the service, tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from loguru import logger

from speculators_v016.run import chat_samples
from speculators_v016.run.dataset import BadRowError, run_order
from speculators_v016.run.row_index import RowIndex, build_index
from speculators_v016.run.sources import PREFETCH_ROWS
from speculators_v016.run.turns import ChatRow, read_chat
from speculators_v016.store import prepared_cache

#: How samples are numbered, as data_config.json records it (``speculators_v016.numbering``); a folder without
#: it numbered the samples kept (the same names only where no row was dropped after tokenizing).
NUMBERING = "run-order-position-1"
NUMBERING_TEXT = (
    "sample start_idx + p is the row at position p of the run's order (shuffled, cut), in shard p % num_shards; "
    "a row dropped after tokenizing leaves its name unused"
)
#: rows a chunk holds (a shard's consecutive positions)
CHUNK_ROWS = 512
#: what a chunk entry is, in its cache name: another version's entries are other entries
VERSION = "prepared-chunk-1"
#: rows a worker process is worth (fewer: tokenized in the calling thread)
ROWS_PER_WORKER = 64
_UINT32 = np.iinfo(np.uint32)


@dataclass
class Options:
    """What every row is prepared with (the run's preprocessing options)."""

    seq_length: int
    max_samples: int | None = None
    seed: int = 0
    num_proc: int = 8
    assistant_pattern: str | None = None
    turn_dropout: bool = False
    skip_bad_rows: bool = False
    hf_cache_dir: str | None = None
    keep_duplicates: bool = False


class Rows(Sequence):
    """Read-only rows of a concatenated array (``values[offsets[i]:offsets[i + 1]]``), each given as a list of
    ints when asked for: the arrays stay numpy; equal to a list of lists holding the same values."""

    def __init__(self, values: np.ndarray, offsets: np.ndarray):
        self.values, self.offsets = values, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def array(self, i: int) -> np.ndarray:
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.array(i).tolist()

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(self[i] == list(other[i]) for i in range(len(self)))

    __hash__ = None


@dataclass
class Chunk:
    """Tokenized rows: the kept ones' arrays, and what was dropped (``facts``: skipped by reason, the dropped
    positions' warnings)."""

    names: np.ndarray  # int64: the kept rows' positions in the run's order
    ids: np.ndarray  # uint32 (int64 where pre-tokenized ids do not fit), concatenated
    offsets: np.ndarray  # int64, len(names) + 1
    masks: np.ndarray  # uint8, as ids
    cut: np.ndarray  # uint8 per kept row: cut to seq_length
    skipped: Counter = field(default_factory=Counter)
    warnings: list = field(default_factory=list)

    def arrays(self) -> dict:
        return {"names": self.names, "ids": self.ids, "offsets": self.offsets, "masks": self.masks, "cut": self.cut}

    def __len__(self) -> int:
        return len(self.names)


def _chunk_of(names, ids_list, masks_list, cut, skipped, warnings) -> Chunk:
    lengths = np.fromiter((len(i) for i in ids_list), np.int64, len(ids_list))
    offsets = np.zeros(len(ids_list) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.concatenate([np.asarray(i, np.int64) for i in ids_list]) if ids_list else np.zeros(0, np.int64)
    if not len(ids) or (ids.min() >= 0 and ids.max() <= _UINT32.max):
        ids = ids.astype(np.uint32)
    masks = np.concatenate([np.asarray(m, np.uint8) for m in masks_list]) if masks_list else np.zeros(0, np.uint8)
    return Chunk(np.asarray(names, np.int64), ids, offsets, masks, np.asarray(cut, np.uint8), skipped, warnings)


def tokenizer_digest(tokenizer) -> str:
    """sha256 of what decides the tokenizer's ids and its chat template's text: its class, its serialization (a
    fast tokenizer's whole tokenizer.json), its special tokens and added tokens, its chat template(s), and the
    files of its folder that a tokenizer reads."""
    digest = hashlib.sha256()
    digest.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # truncation and padding: the state of its last call, not what it is
        spec = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
        digest.update(json.dumps(spec, sort_keys=True).encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True).encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    added = {i: str(t) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    digest.update(json.dumps(added, sort_keys=True).encode())
    folder = Path(str(getattr(tokenizer, "name_or_path", "") or ""))
    if folder.is_dir():
        from speculators_v016.store.run_config import TOKENIZER_FILES, file_sha256  # noqa: PLC0415 - only here

        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                digest.update(f"{name} {file_sha256(folder / name)}".encode())
    return digest.hexdigest()


def prep_key(index: RowIndex, tokenizer, options: Options) -> str | None:
    """The prepared rows' cache key (JSON): None where the index has none (an input not named by content, a name
    upstream's loader knows: a change could not be seen, so nothing is kept). The index's key holds the inputs
    (files' sha256, splits, configs, caps), ``--skip-bad-rows`` and ``--keep-duplicate-rows``."""
    if index.key is None:
        return None
    return json.dumps(
        {
            "version": VERSION,
            "numbering": NUMBERING,
            "index": index.key,
            "kind": index.kind,
            "reader": f"{index.reader.__module__}.{index.reader.__qualname__}",
            "reading": chat_samples.READING,
            "tokenizer": tokenizer_digest(tokenizer) if tokenizer is not None else None,
            "seq_length": options.seq_length,
            "max_samples": options.max_samples,
            "seed": options.seed,
            "assistant_pattern": options.assistant_pattern,
            "turn_dropout": options.turn_dropout,
            "skip_bad_rows": options.skip_bad_rows,
        },
        sort_keys=True,
    )


# -- worker processes -------------------------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(tokenizer, settings) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a worker: the workers are the parallelism
    _WORKER["tokenizer"], _WORKER["settings"] = tokenizer, settings


def _started(_: int) -> bool:
    return True


def _build_in_worker(rows: list[tuple[str, str, int]]) -> list:
    tokenizer, settings = _WORKER["tokenizer"], _WORKER["settings"]
    out = []
    for where, text, keep in rows:
        built = chat_samples.build_row(where, ChatRow.from_json(text), keep or None, tokenizer, settings)
        ids = np.asarray(built.ids, np.uint32) if built.ids is not None else None
        mask = np.asarray(built.mask, np.uint8) if built.mask is not None else None
        out.append((ids, mask, built.cut, built.skip, built.bad, built.reason, built.log))
    return out


class Plan:
    """A run's rows in its order, and how to tokenize them: chunks by shard (see the module's docstring)."""

    def __init__(self, index: RowIndex, tokenizer, options: Options, cache: Path | None = None):
        self.index, self.tokenizer, self.options = index, tokenizer, options
        self.order = run_order(len(index), options.seed, options.max_samples)
        self.kind = index.kind
        self.keeps = None
        self.settings = None
        if self.kind == "conversations":
            if len(self.order) and not getattr(tokenizer, "is_fast", False):
                raise BadRowError(
                    "the target's tokenizer is not a fast (Rust) tokenizer: the loss masks of conversation rows need "
                    "its token offsets; give pre-tokenized rows (input_ids + loss_mask), or use --regenerate"
                )
            self.settings = chat_samples.Settings.of(tokenizer, options.seq_length, options.assistant_pattern)
            if options.turn_dropout:  # drawn a row at a time in the run's order, after seeding with the seed
                draw = random.Random(options.seed)
                turns = index.size[self.order]
                self.keeps = np.fromiter((draw.randint(1, int(n)) for n in turns), np.int32, len(turns))
        self.key = prep_key(index, tokenizer, options) if cache is not None else None
        self.cache = cache if self.key is not None else None
        if cache is not None and self.key is None:
            logger.info("prepared rows are not cached: an input has no sha256 (a dataset name)")
        self._pool = None
        self._workers = 1
        self._held: dict[int, list] = {}  # rows read ahead from inputs that cannot seek, by chunk's first position
        self.built = 0  # rows tokenized by this plan (not read from the cache)

    def __len__(self) -> int:
        return len(self.order)

    @property
    def sources(self) -> list[dict]:
        return self.index.descriptions

    def positions(self, num_shards: int, shard_index: int) -> range:
        """The shard's positions (sample names less start_idx), in order."""
        return range(shard_index, len(self.order), num_shards)

    def chunk_positions(self, num_shards: int, shard_index: int, k: int) -> range:
        mine = self.positions(num_shards, shard_index)
        return mine[k * CHUNK_ROWS : (k + 1) * CHUNK_ROWS]

    def chunks(self, num_shards: int, shard_index: int) -> int:
        return -(-len(self.positions(num_shards, shard_index)) // CHUNK_ROWS)

    def use_workers(self, rows: int) -> None:
        """Tokenize in worker processes where ``rows`` (the rows to tokenize) are worth it: started here, in the
        calling thread, before an engine starts (forked, as the old ``datasets.map`` workers were; a worker
        only tokenizes)."""
        self._workers = max(1, min(self.options.num_proc, rows // ROWS_PER_WORKER))
        if self._workers > 1 and self._pool is None and self.kind == "conversations":
            import multiprocessing  # noqa: PLC0415 - only a run with many rows starts workers

            self._pool = ProcessPoolExecutor(
                self._workers,
                mp_context=multiprocessing.get_context("fork"),
                initializer=_init_worker,
                initargs=(self.tokenizer, self.settings),
            )
            list(self._pool.map(_started, range(self._workers)))  # every worker forked now, from this thread

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self.index.close()

    def _entry(self, num_shards: int, shard_index: int, k: int) -> str:
        return prepared_cache.entry_name(self.key, f"{num_shards}/{shard_index}/{k}/{CHUNK_ROWS}")

    def chunk(self, num_shards: int, shard_index: int, k: int) -> Chunk:
        """Chunk ``k`` of the shard: from the cache where it is there and whole, else tokenized (and kept)."""
        if self.cache is not None:
            name = self._entry(num_shards, shard_index, k)
            try:
                found = prepared_cache.read_entry(self.cache, name)
            except prepared_cache.CorruptEntry as exc:
                logger.bind(terminal=True).warning("{}: tokenized again and rebuilt", exc)
                found = None
            except OSError as exc:
                logger.warning("{}: cannot be read ({}); tokenized again", self.cache / name, exc)
                found = None
            if found is not None and found[1].get("key") != self.key:
                logger.bind(terminal=True).warning("{}: not the entry of its name; tokenized again", self.cache / name)
                found = None
            if found is not None:
                arrays, facts = found
                chunk = Chunk(**arrays, skipped=Counter(facts["skipped"]), warnings=list(facts["warnings"]))
                for line in chunk.warnings:
                    logger.warning("{}", line)
                return chunk
        chunk = self._build(self.chunk_positions(num_shards, shard_index, k))
        if self.cache is not None:
            facts = {"skipped": dict(chunk.skipped), "warnings": chunk.warnings, "key": self.key}
            try:
                prepared_cache.write_entry(self.cache, self._entry(num_shards, shard_index, k), chunk.arrays(), facts)
            except OSError as exc:  # a cache that cannot be written costs time, never the run
                logger.warning("cannot keep prepared rows in {} ({})", self.cache, exc)
        return chunk

    def _rows(self, positions: range) -> list:
        """``(where, value)`` of the rows at ``positions`` (a chunk's), read again from the inputs. Where an input
        cannot seek (compressed JSON Lines, Parquet: a read costs a pass or a row group), the rows of this chunk
        and of the shard's next ones, up to :data:`~speculators_v016.run.sources.PREFETCH_ROWS` rows, are read in
        one go and held until their chunk is built: one pass over such an input per that many rows of a shard,
        memory for that many rows."""
        if self.index.seekable:
            return self.index.rows(self.order[positions.start : positions.stop : positions.step])
        held = self._held.pop(positions.start, None)
        if held is not None:
            return held
        self._held.clear()
        step = positions.step * CHUNK_ROWS
        stop = min(positions.start + step * max(1, PREFETCH_ROWS // CHUNK_ROWS), len(self.order))
        window = range(positions.start, stop, positions.step)
        rows = self.index.rows(self.order[window.start : window.stop : window.step])
        for at in range(0, len(rows), CHUNK_ROWS):
            self._held[window[at]] = rows[at : at + CHUNK_ROWS]
        return self._held.pop(positions.start)

    def _build(self, positions: range) -> Chunk:
        """Tokenize the rows at ``positions`` (see :func:`prepare_samples` for what is dropped, and why)."""
        rows = self._rows(positions)
        self.built += len(rows)
        seq = self.options.seq_length
        skipped, warnings = Counter(), []
        if self.kind == "pretokenized":
            built = [(ids[:seq], mask[:seq], len(ids) > seq) for _, (ids, mask) in rows]
        else:
            keeps = [int(self.keeps[p]) if self.keeps is not None else None for p in positions]
            results = self._conversations(rows, keeps)
            refused = [(where, r) for (where, _), r in zip(rows, results, strict=True) if r[4]]
            if refused and not self.options.skip_bad_rows:
                first = refused[0][1][4]
                more = f" (and {len(refused) - 1} more rows)" if len(refused) > 1 else ""
                raise BadRowError(f"{first}{more}; --skip-bad-rows skips and counts such rows", refused[0][1][5])
            for where, r in refused:
                warnings.append(f"skipping bad row {where}: {r[6]}")
                skipped[r[5]] += 1
            built = []
            for (where, _), (ids, mask, cut, skip, bad, _reason, log) in zip(rows, results, strict=True):
                if skip:
                    if log:
                        warnings.append(f"skipping row {where}: {skip} ({log})")
                    skipped[skip] += 1
                built.append(None if bad or skip or ids is None else (ids, mask, cut))
        names, ids_list, masks_list, cut = [], [], [], []
        for p, b in zip(positions, built, strict=True):
            if b is None:
                continue
            if not any(b[1]):
                skipped[chat_samples.NO_ASSISTANT] += 1
                continue
            names.append(p)
            ids_list.append(b[0])
            masks_list.append(b[1])
            cut.append(b[2])
        for line in warnings:
            logger.warning("{}", line)
        return _chunk_of(names, ids_list, masks_list, cut, skipped, warnings)

    def _conversations(self, rows, keeps) -> list:
        """(ids, mask, cut, skip, bad, reason, log) per row, in order; in worker processes where worth it."""
        if self._pool is not None and len(rows) > ROWS_PER_WORKER:
            jobs = [(where, chat.as_json(), keep or 0) for (where, chat), keep in zip(rows, keeps, strict=True)]
            step = -(-len(jobs) // self._workers)
            parts = [self._pool.submit(_build_in_worker, jobs[i : i + step]) for i in range(0, len(jobs), step)]
            return [r for part in parts for r in part.result()]
        out = []
        for (where, chat), keep in zip(rows, keeps, strict=True):
            b = chat_samples.build_row(where, chat, keep, self.tokenizer, self.settings)
            out.append((b.ids, b.mask, b.cut, b.skip, b.bad, b.reason, b.log))
        return out


def plan_run(paths: list[str], tokenizer, options: Options, *, cache: Path | None = None, progress=None) -> Plan:
    """Index the inputs (:func:`build_index`) and order the rows: a :class:`Plan`, nothing tokenized yet."""
    if options.max_samples is not None and options.max_samples < 1:
        raise ValueError(f"max_samples must be at least 1 (or None for all), got {options.max_samples}")
    if options.seq_length < 1:
        raise ValueError(f"seq_length must be at least 1, got {options.seq_length}")
    index = build_index(
        paths,
        options.skip_bad_rows,
        options.hf_cache_dir,
        reader=read_chat,
        cache=cache,
        progress=progress,
        keep_duplicates=options.keep_duplicates,
    )
    try:
        return Plan(index, tokenizer, options, cache)
    except BaseException:
        index.close()
        raise


@dataclass
class PreparedSamples:
    """Samples in compact arrays (see :class:`Chunk`): ``input_ids[i]``/``loss_masks[i]`` give sample ``i``'s
    (a list), ``names[i]`` its position in the run's order."""

    names: np.ndarray
    ids: np.ndarray
    offsets: np.ndarray
    masks: np.ndarray
    kind: str
    sources: list
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.names)

    @property
    def input_ids(self) -> Rows:
        return Rows(self.ids, self.offsets)

    @property
    def loss_masks(self) -> Rows:
        return Rows(self.masks, self.offsets)

    @classmethod
    def of_lists(cls, ids: list, masks: list, kind: str = "", sources: list | None = None) -> PreparedSamples:
        chunk = _chunk_of(list(range(len(ids))), ids, masks, [False] * len(ids), Counter(), [])
        return cls(chunk.names, chunk.ids, chunk.offsets, chunk.masks, kind, sources or [])


def _joined(chunks: list[Chunk], plan: Plan, skipped: Counter) -> PreparedSamples:
    for chunk in chunks:
        skipped.update(chunk.skipped)
    names = np.concatenate([c.names for c in chunks]) if chunks else np.zeros(0, np.int64)
    dtype = np.int64 if any(c.ids.dtype == np.int64 for c in chunks) else np.uint32
    ids = np.concatenate([c.ids.astype(dtype, copy=False) for c in chunks]) if chunks else np.zeros(0, np.uint32)
    masks = np.concatenate([c.masks for c in chunks]) if chunks else np.zeros(0, np.uint8)
    lengths = np.concatenate([np.diff(c.offsets) for c in chunks]) if chunks else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    truncated = int(sum(int(c.cut.sum()) for c in chunks))
    return PreparedSamples(names, ids, offsets, masks, plan.kind, plan.sources, skipped, truncated)


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
    num_shards: int = 1,
    shard_index: int = 0,
    cache: Path | None = None,
) -> PreparedSamples:
    """Load, validate, shuffle, cut and tokenize the inputs into samples: those of shard ``shard_index`` of
    ``num_shards`` (all, by default), all at once (a run streams them: :class:`Stream`).

    Rows dropped after tokenizing are counted in ``skipped`` by reason: refused ones (a BadRowError naming the
    first of a chunk, unless ``skip_bad_rows``), those skipped by :mod:`speculators_v016.run.chat_samples`, and
    those without an assistant token within ``seq_length``."""
    options = Options(
        seq_length,
        max_samples,
        seed,
        num_proc,
        assistant_pattern,
        turn_dropout,
        skip_bad_rows,
        hf_cache_dir,
        keep_duplicates,
    )
    plan = plan_run(list(paths), tokenizer, options, cache=cache)
    try:
        plan.use_workers(len(plan.positions(num_shards, shard_index)))
        chunks = [plan.chunk(num_shards, shard_index, k) for k in range(plan.chunks(num_shards, shard_index))]
        return _joined(chunks, plan, Counter(plan.index.skipped))
    finally:
        plan.close()


class Stream:
    """A shard's chunks tokenized in a background thread, at most ``depth`` ahead of their reader (see the
    module's docstring). ``want``: the chunks to produce, in order. Iterate for the chunks; an error of the
    thread is raised there; :meth:`close` stops the thread."""

    _END = object()

    def __init__(self, plan: Plan, num_shards: int, shard_index: int, want: list[int], depth: int = 3):
        self.plan, self.num_shards, self.shard_index, self.want = plan, num_shards, shard_index, want
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name="prepare-rows", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for k in self.want:
                if self._stop.is_set():
                    return
                if not self._put((k, self.plan.chunk(self.num_shards, self.shard_index, k))):
                    return
            self._put(self._END)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, raised there
            self._put(exc)

    def __iter__(self):
        while not self._done:
            item = self._queue.get()
            if item is self._END:
                self._done = True
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
