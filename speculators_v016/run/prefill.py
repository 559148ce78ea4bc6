"""A run's samples taken as the dataset has them (its responses), prefilled: the pipeline's work of a prefill run.

The rows are indexed once (a progress bar with rows/s and an ETA while they are read), ordered, and only this
shard's are tokenized, in a background thread a few chunks ahead of the engine
(:class:`speculators_v016.run.prepared.Stream`), from the prepared-rows cache where they are there. Sample names
are positions in the run's order (:data:`speculators_v016.run.prepared.NUMBERING`): a row dropped after
tokenizing leaves a gap, counted (``dropped``) and by reason in ``skipped``. :func:`check_numbering` refuses a
folder of an earlier release whose names could differ.
"""

from __future__ import annotations

import io
import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from loguru import logger
from tqdm import tqdm

from speculators_v016.run import prepared
from speculators_v016.run.prepared import CHUNK_ROWS, NUMBERING, Options, Plan, Stream, plan_run
from speculators_v016.store import prepared_cache
from speculators_v016.store.atomic_files import write_atomic
from speculators_v016.store.outdir import CONFIG
from speculators_v016.store.run_config import ResumeMismatchError


def cache_folder(opts) -> Path | None:
    """The prepared-rows cache of ``opts`` (``--prepared-cache``, default under ``$XDG_CACHE_HOME``), or None
    (``--no-prepared-cache``)."""
    if not opts.use_prepared_cache:
        return None
    return Path(opts.prepared_cache) if opts.prepared_cache else prepared_cache.default_folder()


def cache_line(folder: Path | None) -> str:
    """What the summary says of the cache: its place and size."""
    if folder is None:
        return "off (--no-prepared-cache): every run tokenizes its rows"
    entries, size = prepared_cache.folder_size(folder)
    return f"{folder} ({entries} entries, {size / 2**20:,.1f} MiB; --prepared-cache DIR, --no-prepared-cache)"


def reading_bar(progress_to, enabled: bool):
    """A bar over the inputs' bytes while their rows are indexed (rows/s in its postfix), and its callback
    ``progress(bytes_done or None at the end, rows, total bytes)``."""
    bar = tqdm(
        total=0,
        unit="B",
        unit_scale=True,
        desc="reading rows",
        disable=not enabled or progress_to is None,
        dynamic_ncols=True,
        file=progress_to,
        mininterval=1.0,
    )
    started = time.monotonic()

    def progress(done: int | None, rows: int, total: int) -> None:
        bar.total = total
        bar.n = total if done is None else min(done, total)
        rate = rows / max(time.monotonic() - started, 1e-9)
        bar.set_postfix_str(f"{rows:,} rows, {rate:,.0f} rows/s", refresh=False)
        bar.refresh() if done is None else bar.update(0)

    return bar, progress


def check_numbering(directory: Path, config: dict, names: int) -> None:
    """Refuse to resume a folder whose sample names may not be this release's (:data:`NUMBERING`).

    A folder of an earlier release (no ``numbering`` in its data_config.json) numbered the samples kept after
    tokenizing; its names are positions in the run's order only where no row was dropped then: where the
    samples it counted (``dataset_samples``) are all ``names`` rows of the run's order (its fingerprint, checked
    before, says the order is the same). Else ResumeMismatchError naming the folder and what to do."""
    ours = config.get("speculators_v016", {})
    held = ours.get("numbering")
    if held == NUMBERING:
        return
    if held is not None:
        raise ResumeMismatchError(
            f"{directory}/{CONFIG} numbers its samples as {held!r}, not {NUMBERING!r} ({prepared.NUMBERING_TEXT}): "
            "resuming would give samples other names. Finish the folder with the release that started it, or use "
            "another --output-dir."
        )
    if ours.get("dataset_samples") == names:
        return
    raise ResumeMismatchError(
        f"{directory}/{CONFIG} was written by an earlier release, which numbered the samples kept after tokenizing "
        f"({ours.get('dataset_samples')!r} of the {names} rows of the run's order); this release names each "
        f"sample by its row's position in that order ({prepared.NUMBERING_TEXT}), so rows dropped after "
        "tokenizing shift every later name: resuming would write samples under names that the folder already "
        "uses for others. Finish the folder with the release that started it, or use another --output-dir."
    )


class PrefillWork:
    """The pipeline's side of a prefill run (see the module's docstring)."""

    def __init__(self, plan: Plan, num_shards: int = 1, shard_index: int = 0, token_counts: bool = False):
        self.plan = plan
        self.kind, self.sources = plan.kind, plan.sources
        self.skipped: Counter = Counter(plan.index.skipped)
        self.truncated = 0
        self.dropped = 0  # this shard's positions without a sample (rows dropped after tokenizing)
        self.count = len(plan)  # names of the run's order (data_config.json's dataset_samples)
        self.num_shards, self.shard_index = num_shards, shard_index
        self.token_counts: Counter | None = Counter() if token_counts else None
        self._masks: dict[int, np.ndarray] = {}
        self._new_dropped = 0
        self._stream: Stream | None = None
        self._head: list = []
        self._ended = False
        self._pending = np.zeros(0, np.int64)

    @classmethod
    def prepare(cls, opts, tokenizer, progress_to=None, token_counts: bool = False) -> PrefillWork:
        options = Options(
            opts.seq_length,
            opts.max_samples,
            opts.seed,
            opts.num_preprocessing_workers,
            opts.assistant_pattern,
            opts.turn_dropout,
            opts.skip_bad_rows,
            opts.hf_cache_dir,
            opts.keep_duplicate_rows,
        )
        paths = list(opts.train_data_path)
        bar, progress = reading_bar(progress_to, opts.progress)
        try:
            plan = plan_run(paths, tokenizer, options, cache=cache_folder(opts), progress=progress)
        finally:
            bar.close()
        return cls(plan, opts.num_shards, opts.shard_index, token_counts)

    def shard(self, num_shards: int, shard_index: int) -> np.ndarray:
        """The shard's positions (an int64 array, ascending)."""
        mine = self.plan.positions(num_shards, shard_index)
        return np.arange(mine.start, mine.stop, mine.step, dtype=np.int64)

    def begin(self, pending) -> bool:
        """Start tokenizing ``pending``'s chunks (every chunk of the shard where token counts are wanted); wait
        for the first sample. False where none will come (every pending row dropped). ``pending``: positions of
        the shard (an int64 array, best ascending: then it is kept as it is, not copied)."""
        pending = np.asarray(pending, np.int64)
        self._pending = pending if bool((pending[1:] >= pending[:-1]).all()) else np.sort(pending)
        wanted = self._chunks_holding(self._pending)
        if self.token_counts is not None:
            wanted = list(range(self.plan.chunks(self.num_shards, self.shard_index)))
        mine = self.plan.positions(self.num_shards, self.shard_index)
        self.plan.use_workers(sum(len(mine[k * CHUNK_ROWS : (k + 1) * CHUNK_ROWS]) for k in wanted))
        self._stream = Stream(self.plan, self.num_shards, self.shard_index, wanted)
        chunks = iter(self._stream)
        for item in chunks:
            self._head.append(item)
            if self._in_pending(item[1].names).any():
                break
        else:
            self._ended = True
        if not self._ended and len(self._head) == len(wanted):
            self._ended = True
        return any(self._in_pending(chunk.names).any() for _, chunk in self._head)

    def _chunks_holding(self, positions: np.ndarray) -> list[int]:
        """The shard's chunks holding any of ``positions`` (ascending positions of the shard), in order: a look-up
        of each chunk's first position, no array the size of ``positions``."""
        chunks = self.plan.chunks(self.num_shards, self.shard_index)
        starts = self.shard_index + np.arange(chunks + 1, dtype=np.int64) * (CHUNK_ROWS * self.num_shards)
        return np.flatnonzero(np.diff(np.searchsorted(positions, starts))).tolist()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self.plan.close()

    def _in_pending(self, names: np.ndarray) -> np.ndarray:
        """Which of ``names`` are pending (a binary search in the sorted pending positions)."""
        at = np.searchsorted(self._pending, names)
        hit = at < len(self._pending)
        hit[hit] = self._pending[at[hit]] == np.asarray(names)[hit]
        return hit

    def _pending_in(self, k: int) -> int:
        positions = self.plan.chunk_positions(self.num_shards, self.shard_index, k)
        lo = np.searchsorted(self._pending, positions.start)
        hi = np.searchsorted(self._pending, positions.stop)
        return int(((self._pending[lo:hi] - self.shard_index) % self.num_shards == 0).sum())

    def _chunks(self):
        head, self._head = self._head, []
        yield from head
        if not self._ended:
            yield from self._stream
            self._ended = True

    def head_samples(self):
        """``(position, ids)`` of the pending samples tokenized before the engine starts (the first chunk's)."""
        for _, chunk in self._head:
            for j in np.flatnonzero(self._in_pending(chunk.names)):
                yield int(chunk.names[j]), chunk.ids[int(chunk.offsets[j]) : int(chunk.offsets[j + 1])].tolist()

    def settle(self) -> None:
        """Read what is left of the stream (after the engine; none where all was fed): its counts."""
        for _ in self.feed(None):
            pass

    def feed(self, pending):
        """``(position, ids)`` of the pending samples, as the chunks come; the counts as they go."""
        for k, chunk in self._chunks():
            sel = self._in_pending(chunk.names)
            self.skipped.update(chunk.skipped)
            self.truncated += int(chunk.cut[sel].sum())
            gone = self._pending_in(k) - int(sel.sum())
            self.dropped += gone
            self._new_dropped += gone
            if self.token_counts is not None and len(chunk.ids):
                trained = np.asarray(chunk.ids)[np.asarray(chunk.masks) == 1]
                values, counts = np.unique(trained, return_counts=True)
                self.token_counts.update(dict(zip(values.tolist(), counts.tolist(), strict=True)))
            if pending is None:
                continue
            for j in np.flatnonzero(sel):
                start, stop = int(chunk.offsets[j]), int(chunk.offsets[j + 1])
                name = int(chunk.names[j])
                self._masks[name] = np.array(chunk.masks[start:stop])
                yield name, chunk.ids[start:stop].tolist()

    def tokens(self, pending) -> int | None:
        """The pending samples' tokens where every one is tokenized already (one chunk), else None (the bar
        counts samples)."""
        if not self._ended:
            return None
        return sum(int((np.diff(c.offsets)[self._in_pending(c.names)]).sum()) for _, c in self._head)

    def estimated_tokens(self, pending) -> tuple[int, int]:
        """``(tokens, rows it is from)``: the pending samples' tokens, from the rows tokenized so far."""
        rows = tokens = 0
        for k, chunk in self._head:
            sel = self._in_pending(chunk.names)
            rows += self._pending_in(k)
            tokens += int(np.diff(chunk.offsets)[sel].sum())
        return (tokens if rows >= len(pending) else round(tokens / max(rows, 1) * len(pending))), rows

    def finish(self, index: int, ids: list[int], engine) -> tuple[torch.Tensor, None, None]:
        mask = self._masks.pop(index)[: len(ids)]
        return torch.from_numpy(mask.astype(np.int64)), None, None

    def take_cut(self) -> list:
        return []

    def take_dropped(self) -> int:
        """Pending positions found dropped since the last call (the bar counts them as done)."""
        gone, self._new_dropped = self._new_dropped, 0
        return gone


def token_counts_kept(path: str) -> bool:
    """Whether ``path`` (--token-freq-path) already names something, kept as upstream keeps it: a file, or a link
    (dangling or not: never written through); said as a warning, since its counts are not this run's."""
    if not os.path.lexists(path):
        return False
    logger.warning(
        "--token-freq-path {} exists and is kept (as upstream keeps it): its counts are not this run's; remove it, or "
        "name another path, for this dataset's",
        path,
    )
    return True


def save_token_counts(counts: Counter, path: str) -> bool:
    """Upstream's token_freq.pt (a dict: token id -> how often it is trained); an existing file is kept, as
    upstream keeps it (:func:`token_counts_kept`). Written under a temporary name and renamed, never through a
    link: shards finishing together leave one whole file. True where written."""
    target = Path(path)
    if token_counts_kept(path):
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({int(k): int(v) for k, v in counts.items()}, buffer)
    write_atomic(target.parent, target.name, buffer.getvalue())
    logger.info("token frequencies of {} tokens written to {}", len(counts), target)
    return True
