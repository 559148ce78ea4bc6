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

Each source yields ``(where, row)``: ``where`` names the file and line (``a.jsonl:12``, ``a.jsonl.gz:12``) or row
(``a.json row 3``, ``data.parquet row 7``, ``org/name@train row 7``); a row that cannot be read arrives as a
:class:`BadRowError` (skippable with ``--skip-bad-rows``). A source that cannot be read at all (no such file, a
Parquet file without the columns rows need, a corrupt archive, an empty folder, an unknown dataset id) raises
:class:`SourceError` naming the file or id, and the row reached: never a silently short dataset. Every source is
opened (checked) before any is read, all before anything is written.

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

from speculators_v016.run.turns import BadRowError
from speculators_v016.store.run_config import file_sha256

#: the fields of a conversation row that are read (speculators_v016.run.turns): its content, for duplicates
CONVERSATION_FIELDS = ("conversations", "messages", "tools")
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
    """The digests of the rows taken so far, across the run's sources: :meth:`seen` is True for a row whose
    content (its used fields, canonical JSON) an earlier row had. ``keep``: never a duplicate."""

    def __init__(self, keep: bool = False):
        self.keep, self._digests = keep, set()

    def seen(self, row) -> bool:
        if self.keep or not isinstance(row, dict):
            return False
        fields = PRETOKENIZED_FIELDS if "input_ids" in row else CONVERSATION_FIELDS
        content = {k: row[k] for k in fields if k in row}
        try:
            text = json.dumps(content, sort_keys=True, ensure_ascii=True, separators=(",", ":"))
        except (TypeError, ValueError):  # not JSON content (bytes from a binary column): the reader refuses it
            return False
        digest = hashlib.blake2b(text.encode("ascii"), digest_size=16).digest()
        if digest in self._digests:
            return True
        self._digests.add(digest)
        return False


@dataclass
class Source:
    """One ``--train-data-path`` value, checked; :meth:`rows` reads it once, :meth:`describe` says what was read."""

    given: str
    max_rows: int | None
    read: Callable[[], Iterator[tuple[str, object]]]  # (where, row or BadRowError), in the source's order
    description: Callable[[], dict]
    skipped: Counter = field(default_factory=Counter)

    def rows(self, duplicates: Duplicates) -> Iterator[tuple[str, object]]:
        """(where, row or BadRowError): the source's rows up to its cap, duplicates dropped and counted."""
        taken = 0
        for where, row in self.read():
            if duplicates.seen(row):
                self.skipped[DUPLICATE] += 1
                continue
            yield where, row
            taken += 1
            if self.max_rows is not None and taken >= self.max_rows:
                return

    def describe(self) -> dict:
        """For data_config.json's ``sources`` (and the resume fingerprint): what was read, by content."""
        out = self.description()
        if self.max_rows is not None:
            out["max_rows"] = self.max_rows
        if self.skipped[DUPLICATE]:  # absent without: a folder of an earlier release, same rows, still resumes
            out["duplicate_rows"] = self.skipped[DUPLICATE]
        return out


@dataclass(frozen=True)
class JsonReaders:
    """The JSON readers (speculators_v016.run.dataset): ``file(path)`` a .json/.jsonl file, ``lines(path, fh)``
    JSON Lines from a binary stream."""

    file: Callable
    lines: Callable


def open_source(given: str, hf_cache_dir: str | None, readers: JsonReaders) -> Source:
    """``given`` (a ``--train-data-path`` value) checked and ready to read, or SourceError naming it."""
    what, max_rows = split_cap(given)
    path = Path(what)
    if path.is_dir():
        read, description = _folder(given, path, None)
    elif path.exists():
        read, description = _file(given, path, readers)
    elif what.lower().endswith(_JSON_SUFFIXES):
        raise SourceError(f"--train-data-path {given}: no such file")
    elif "@" in what and Path(what.rpartition("@")[0]).is_dir():
        folder, _, split = what.rpartition("@")
        read, description = _folder(given, Path(folder), _split_name(given, split))
    elif "@" in what:
        read, description = _hub(given, what, hf_cache_dir)
    else:
        read, description = _upstream(given, what, hf_cache_dir)
    return Source(given, max_rows, read, description)


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


def _sha(path: Path) -> dict:
    return {"path": str(path.resolve()), "sha256": file_sha256(path)}


def _files_sha(folder: Path, files: list[Path]) -> list[dict]:
    return [{"name": str(f.relative_to(folder)), "sha256": file_sha256(f)} for f in files]


# --- files ---------------------------------------------------------------------------------------------------


def _file(given: str, path: Path, readers: JsonReaders):
    if not path.is_file():
        raise SourceError(f"--train-data-path {given}: not a regular file")
    name = path.name.lower()
    if name.endswith(".parquet"):
        _parquet_columns(path)
        return (lambda: _parquet_rows(path)), (lambda: _sha(path))
    if name.endswith(".jsonl.gz"):
        return (lambda: _archive_rows(path, gzip.open(path, "rb"), "gzip", readers.lines)), (lambda: _sha(path))
    if name.endswith(".jsonl.zst"):
        zstandard = _zstandard(given)
        return (
            (
                lambda: _archive_rows(
                    path, _zstd_stream(path, zstandard), "Zstandard", readers.lines, (zstandard.ZstdError,)
                )
            ),
            (lambda: _sha(path)),
        )
    if path.suffix in (".json", ".jsonl"):
        return (lambda: readers.file(path)), (lambda: _sha(path))
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
            for where, row in lines(path, fh):
                yield where, row
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
    """(where, row) of Arrow record batches; ``label`` names the file or dataset."""
    index = start
    for batch in batches:
        for row in batch.to_pylist():
            yield f"{label} row {index}", _without_nulls(row)
            index += 1


def _parquet_rows(path: Path):
    parquet = _parquet_file(path)
    columns = _needed(parquet.schema_arrow.names, str(path))
    where = None
    try:
        for where, row in _batch_rows(str(path), parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns)):
            yield where, row
    except BadRowError:
        raise
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise SourceError(f"{path}: not a readable Parquet file ({exc}; after {where or 'no row'})") from None
    finally:
        parquet.close()


def _arrow_rows(label: str, dataset, columns: list[str]):
    """(where, row) of a ``datasets.Dataset``, its used columns a batch at a time (the dataset is memory-mapped)."""
    batches = dataset.select_columns(columns).with_format("arrow").iter(batch_size=BATCH_ROWS)
    yield from _batch_rows(label, (table for table in batches))


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


def _folder(given: str, folder: Path, split: str | None):
    if (folder / "dataset_dict.json").exists() or (folder / "state.json").exists():
        return _saved(given, folder, split)
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

    def read():
        for f in files:
            yield from _parquet_rows(f)

    def description():
        out = {"path": str(folder.resolve()), "files": _files_sha(folder, files)}
        return out if split is None else {**out, "split": split}

    return read, description


def _json_file(path: Path, given: str) -> dict:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise SourceError(f"--train-data-path {given}: {path} is not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise SourceError(f"--train-data-path {given}: {path} is not a JSON object")
    return value


def _saved(given: str, folder: Path, split: str | None):
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
        out = {"path": str(root.resolve()), "files": _files_sha(root, [folder / "state.json", *files])}
        return out if split is None else {**out, "split": split}

    return (lambda: _arrow_rows(label, dataset, columns)), description


# --- datasets by name ----------------------------------------------------------------------------------------


def _hub(given: str, what: str, hf_cache_dir: str | None):
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
            "files": [{"name": f.name, "sha256": file_sha256(f)} for f in files],
        }

    return (lambda: _arrow_rows(f"{base}@{split}", dataset, columns)), description


#: the builders of ``datasets`` a hub dataset may be read by: data files that are data, never code or pickles
#: (``cache``: a copy in the datasets cache, Arrow files)
HUB_BUILDERS = frozenset({"arrow", "cache", "csv", "json", "parquet"})


def _builder_kind(builder) -> str:
    """The packaged module a ``datasets`` builder comes from (``parquet``, ``json``, ``cache``...)."""
    module = type(builder).__module__
    return module.rsplit(".", 1)[-1] if module.startswith("datasets.packaged_modules.") else module


def _upstream(given: str, name: str, hf_cache_dir: str | None):
    """A dataset name upstream's loader knows (it normalizes the rows to ``conversations``)."""
    from speculators.data_generation.preprocessing import (  # noqa: PLC0415 - upstream is slow to import
        DATASET_CONFIGS,
        load_raw_dataset,
    )

    if name not in DATASET_CONFIGS:
        raise SourceError(
            f"--train-data-path {given}: no such file, and not a dataset name upstream knows "
            f"({', '.join(sorted(DATASET_CONFIGS))}) nor a dataset id with its split (ORG/NAME@SPLIT, "
            "ORG/NAME:CONFIG@SPLIT)"
        )

    def read():
        logger.info("loading dataset {} with upstream's loader", name)
        for i, row in enumerate(load_raw_dataset(name, cache_dir=hf_cache_dir)):
            yield f"{name} row {i}", row

    return read, (lambda: {"name": name})
