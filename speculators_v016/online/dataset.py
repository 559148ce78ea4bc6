"""``OnlineSampleDataset``: upstream 0.3.0's ``Eagle3SampleFileDataset``, with each file asked of a service.

It *is* upstream's dataset (a subclass): its ``data`` list, instead of paths
found on disk, is a sequence whose item ``i`` asks the service for sample ``i``
and gives the path of the published file, so ``__getitem__`` is upstream's own
(the same loading, standardization, dtype, ``lengths``, ``position_ids``,
transform and shift): an item equals what upstream's dataset gives for the
same file written by an offline run. Afterwards the file is deleted (online),
or kept in ``cache_dir`` while the cache is under ``cache_bytes`` (hybrid: a
later epoch reads it there and asks nothing).

``approx_lengths`` (what upstream's multipack sampler packs by) are the token
counts known before anything is generated: the service's dataset's, or the
given samples'. A sample that cannot be had is an error naming it and the
producer (:class:`~speculators_v016.online.client.ProducerError`), never an
empty item. It works in forked DataLoader workers and on every rank: each
process asks for the items its sampler gives it.
"""

from __future__ import annotations

import operator
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from speculators.train.data import Eagle3SampleFileDataset, standardize_data_v1

from speculators_v016.online.client import ProducerClient, ProducerError
from speculators_v016.online.readers import HandleError, StaleFile, Taken, reader_for

MODES = ("online", "hybrid")


class _RequestedFiles(Sequence):
    """Upstream's ``data``: item ``i`` is the local path of sample ``i``'s file, asked for when read."""

    def __init__(self, dataset: OnlineSampleDataset, count: int):
        self._dataset, self._count = dataset, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        return str(self._dataset._path_of(index))


class OnlineSampleDataset(Eagle3SampleFileDataset):
    """Upstream's sample dataset over a running ``speculators-data-gen serve``.

    ``producer``: the service's URL. ``samples``: ``(input_ids, loss_mask)`` pairs
    to ask for by token ids; None: the service's own dataset (``--train-data-path``),
    asked for by index. ``folder``: where the service's ``--serve-dir`` is seen
    here (default: ``$SPECULATORS_DATA_GEN_SERVE_SERVE_DIR``, the service's own variable), needed with the
    folder backend and checked against the producer's (it must hold the journal of the service start the
    producer names): the producer's word alone never makes this consumer read or delete a file. ``mode``: ``"online"`` (each
    file deleted once read) or ``"hybrid"`` (kept in ``cache_dir``, up to
    ``cache_bytes``, and read from there in later epochs). The backend (the serve folder, or the
    Mooncake store) is the service's, as ``/v1/info`` names it. ``api_key``: the
    service's ``--api-key`` (default: ``$SPECULATORS_DATA_GEN_SERVE_API_KEY``). The other
    arguments are upstream's.
    """

    def __init__(
        self,
        producer: str,
        max_len: int,
        samples: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
        mode: str = "online",
        cache_dir: str | os.PathLike | None = None,
        cache_bytes: int | None = None,
        folder: str | os.PathLike | None = None,
        transform=None,
        hidden_states_dtype=torch.float,
        standardize_fn=standardize_data_v1,
        timeout: float = 600.0,
        retries: int = 3,
        api_key: str | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "hybrid" and cache_dir is None:
            raise ValueError("mode 'hybrid' keeps what it read: it needs cache_dir")
        self.client = ProducerClient(producer, timeout=timeout, retries=retries, api_key=api_key)
        info = self.client.info()
        self.producer_info = info
        self.reader = reader_for(info, folder, self.client.url)
        if samples is None:
            if info.get("num_samples") is None:
                raise ProducerError(
                    f"the producer {self.client.url} has no dataset (--train-data-path): give samples=[(ids, mask)...]"
                )
            lengths = list(info["lengths"])
        else:
            samples = [(list(ids), list(mask)) for ids, mask in samples]
            lengths = [len(ids) for ids, _ in samples]
        self.samples = samples
        self.mode = mode
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.cache_bytes = cache_bytes
        self.requests = 0  # this process's requests (a hybrid epoch read from the cache makes none)
        self._cache_used: int | None = None  # bytes in the cache, as this process last counted them
        self._cache_added = 0
        self._served: dict[tuple[int, int], Taken] = {}  # (thread, index) -> the served file it reads
        # upstream's attributes, as its __init__ sets them (its own __init__ reads every file at start)
        self.data = _RequestedFiles(self, len(lengths))
        self.max_len = max_len
        self.transform = transform
        self.standardize_fn = standardize_fn
        self.hidden_states_dtype = hidden_states_dtype
        self.approx_lengths = lengths

    def __getitem__(self, index):
        try:
            index = operator.index(index)
        except TypeError:
            raise IndexError(f"sample index {index!r} is not an integer") from None
        try:
            item = super().__getitem__(index)  # upstream's: load_sample(self.data[index]), then its steps
            served = self._served.get((threading.get_ident(), index))
            if served is not None and not served.unchanged():
                raise ProducerError(
                    f"sample {index}: the file the producer {self.client.url} published ({served.path}) was replaced "
                    "while it was read: the item is not used"
                )
            return item
        finally:
            served = self._served.pop((threading.get_ident(), index), None)
            if served is not None:
                served.release()  # taken: the service's cap counts it no more

    def _cached(self, index: int) -> Path | None:
        if self.cache_dir is None:
            return None
        path = self.cache_dir / f"data_{index}.safetensors"
        return path if path.exists() else None

    def _path_of(self, index: int) -> Path:
        try:
            index = operator.index(index)  # samplers give numpy integers (upstream's multipack sampler does)
        except TypeError:
            raise IndexError(f"sample index {index!r} is not an integer") from None
        if not 0 <= index < len(self.data):
            raise IndexError(f"sample index {index!r} is not in [0, {len(self.data)})")
        cached = self._cached(index)
        if cached is not None:
            return cached
        taken = self._request(index)
        if self.mode == "hybrid" and self._room_for(taken.path.stat().st_size):
            try:
                return self.reader.keep(taken, self.cache_dir / f"data_{index}.safetensors")
            except OSError as exc:
                taken.release()
                raise ProducerError(
                    f"sample {index}: the file the producer {self.client.url} published cannot be kept in "
                    f"{self.cache_dir} ({exc.strerror or exc})"
                ) from exc
            except StaleFile as exc:
                raise ProducerError(f"sample {index}: the producer {self.client.url} published it, but {exc}") from None
        self._served[threading.get_ident(), index] = taken  # by thread too: two threads may read one index
        return taken.path

    def _request(self, index: int) -> Taken:
        """Ask for sample ``index`` and take its object, checked (:mod:`speculators_v016.online.readers`).

        A handle naming something outside the folder (or store), or lacking a field, is refused at once;
        a file gone (reclaimed: its lease ran out) or not what the handle says (short, altered) is asked
        for once more."""
        what = f"sample {index}"
        for _ in range(2):
            self.requests += 1
            try:
                if self.samples is None:
                    handle = self.client.request(what, index=index)
                else:
                    ids, mask = self.samples[index]
                    handle = self.client.request(what, input_ids=ids, loss_mask=mask)
            except (KeyError, TypeError) as exc:  # a reply without a handle: not the service's answer
                raise ProducerError(
                    f"{what}: the producer {self.client.url} answered without a handle ({type(exc).__name__}: {exc})"
                ) from None
            try:
                taken = self.reader.fetch(handle)
            except HandleError as exc:
                raise ProducerError(
                    f"{what}: the producer {self.client.url} answered a handle refused: {exc}"
                ) from None
            except StaleFile as exc:
                why = str(exc)
                continue
            except ProducerError as exc:
                raise ProducerError(f"{what}: the producer {self.client.url}: {exc}") from None
            if taken is not None:
                return taken
            why = self.reader.where(handle)
        raise ProducerError(f"{what}: the producer {self.client.url} published it, but {why}")

    def _room_for(self, size: int) -> bool:
        """Within ``cache_bytes``? The cache is counted again every 256 files this process adds (other
        ranks and workers add theirs): at most that many files of each process over the budget."""
        if self.cache_bytes is None:
            return True
        if self._cache_used is None or self._cache_added >= 256:
            self._cache_used = sum(p.stat().st_size for p in self.cache_dir.glob("data_*.safetensors"))
            self._cache_added = 0
        if self._cache_used + size > self.cache_bytes:
            return False
        self._cache_used += size
        self._cache_added += 1
        return True
