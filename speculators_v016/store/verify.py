"""``speculators-data-gen verify DIR``: is every sample there, intact, and what the config says?

Checks, per folder (or per shard folder, plus their union): ``data_config.json``
is present; no temporary leftovers, no foreign files and no symbolic links
(those are reported, never opened or followed); every sample listed once in the manifest; every manifest entry's
file exists, is a regular file (a link in its place is reported, never
followed) with the recorded size and
digest (BLAKE3 or sha256, as the entry names it; one that cannot be read is a
finding, and the others are still checked); every file parses (safetensors, or ``.pt`` with ``weights_only``),
has the recorded number of layers, ``[T, hidden_size]`` states of the recorded
dtype, a 0/1 loss mask as long as ``input_ids``, no NaN/Inf (FP8 storage:
e4m3 codes ``[T, hidden_size]``, float32 scales ``[T]`` that are finite and
> 0, no NaN code, finite once dequantized), and no row that
no real model produces (all zeros, the same row for different tokens:
:mod:`~speculators_v016.checks.degenerate`; a zero row of a token whose input
embedding row is zero, as the run recorded them, is the model's own); no sample file lacks a manifest
entry; across shards every index exists exactly once; the folder holds one
layout (shard folders of one count, or one unsharded run: upstream's trainer
reads the folder recursively and would mix them).

Whatever the folder holds, the answer is a list of findings, never an
exception: a config that is not valid JSON or lacks a field, an unknown
format, a manifest line that is not an entry, a manifest that is a folder are
each a finding naming the file.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speculators_v016 import fp8
from speculators_v016.checks.degenerate import degenerate_layers
from speculators_v016.redact import redact
from speculators_v016.store import checksum, no_links, regenerated, run_config
from speculators_v016.store.manifest import Manifest, ManifestError
from speculators_v016.store.outdir import CONFIG, SHARD_DIR, is_our_tmp, is_ours, unsharded_run_files
from speculators_v016.store.run_config import file_sha256
from speculators_v016.store.sample_format import (
    FORMATS,
    MODEL_ARGS_KEY,
    header_metadata,
    load_sample,
    parse_sample_name,
    read_header_metadata,
)


@dataclass
class Report:
    folders: list[str] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.samples > 0


class ConfigError(ValueError):
    """``data_config.json`` is not one that this tool writes (the message names the file and field)."""


@dataclass(frozen=True)
class FolderSettings:
    """What verify needs of a folder's ``data_config.json``."""

    format: str
    layer_ids: list[int]
    hidden_size: int
    dtype: str
    shard_index: int
    shard_count: int
    dataset_samples: int
    start_idx: int
    skipped: int  # samples the last run did not write (NaN/Inf; --regenerate: turns without room; gaps)
    storage: str = "auto"  # hidden_states_dtype: "auto" (the engine's dtype) or "fp8_e4m3"
    regenerated: bool = False  # a --regenerate run's folder: its text is checked against its samples
    zero_ids: frozenset[int] = frozenset()  # tokens whose input embedding row is zero (the run recorded them)
    model: dict | None = None  # the fingerprint's target: its folder and tokenizer files' sha256
    model_args: dict = field(default_factory=dict)  # engine arguments that changed the model (in every header)


def _field(config: dict, path: str, kind):
    value = config
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ConfigError(f"no field {path}")
        value = value[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"field {path} is {value!r}, not a {getattr(kind, '__name__', kind)}")
    return value


def folder_settings(folder: Path) -> FolderSettings | None:
    """The folder's settings from ``data_config.json``; None without one; ConfigError naming the file."""
    path = Path(folder) / CONFIG
    try:
        raw = no_links.read_bytes(path)  # never through a link
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    try:
        config = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    try:
        if not isinstance(config, dict) or "speculators_v016" not in config:
            raise ConfigError("no speculators_v016 section (not written by speculators-data-gen)")
        fmt = _field(config, "speculators_v016.format", str)
        if fmt not in FORMATS:
            raise ConfigError(f"unknown sample format {fmt!r} (this version reads {sorted(FORMATS)})")
        layer_ids = _field(config, "speculators_v016.layers.layer_ids", list)
        if not layer_ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids):
            raise ConfigError(f"field speculators_v016.layers.layer_ids is {layer_ids!r}, not a list of integers")
        last_run = config["speculators_v016"].get("last_run") or {}
        storage = config["speculators_v016"].get("hidden_states_dtype", "auto")  # absent: earlier releases
        if storage not in ("auto", fp8.NAME):
            raise ConfigError(f"field speculators_v016.hidden_states_dtype is {storage!r}, not 'auto' or {fp8.NAME!r}")
        model_args = config["speculators_v016"].get(MODEL_ARGS_KEY) or {}  # absent: earlier releases, or none
        if not isinstance(model_args, dict):
            raise ConfigError(f"field speculators_v016.{MODEL_ARGS_KEY} is {model_args!r}, not an object")
        zero_ids = config["speculators_v016"].get("zero_embedding_token_ids") or []  # absent: earlier releases
        if not isinstance(zero_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in zero_ids):
            raise ConfigError("field speculators_v016.zero_embedding_token_ids is not a list of token ids")
        return FolderSettings(
            format=fmt,
            layer_ids=layer_ids,
            hidden_size=_field(config, "model.hidden_size", int),
            dtype=_field(config, "speculators_v016.dtype", str),
            shard_index=_field(config, "speculators_v016.shard.index", int),
            shard_count=_field(config, "speculators_v016.shard.count", int),
            dataset_samples=_field(config, "speculators_v016.dataset_samples", int),
            start_idx=_field(config, "speculators_v016.start_idx", int),
            skipped=_skipped(last_run),
            storage=storage,
            regenerated=bool(config["speculators_v016"].get("regenerate")),
            zero_ids=frozenset(zero_ids),
            model=_model_of(config),
            model_args=model_args,
        )
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _model_of(config: dict) -> dict | None:
    fingerprint = config["speculators_v016"].get("fingerprint")
    model = fingerprint.get("model") if isinstance(fingerprint, dict) else None
    return model if isinstance(model, dict) else None


def _tokenizer_of(folder: Path, settings: FolderSettings, report: Report):
    """The target's tokenizer, where the folder names the target's folder and it is here with the tokenizer files
    the run used (sha256 as recorded); else None, and a note says why the text is not checked."""
    model = settings.model or {}
    where, recorded = model.get("path"), model.get("tokenizer_sha256")
    unchecked = f"{folder}: regenerated text not checked against the sampled ids"
    if not isinstance(where, str) or not isinstance(recorded, dict) or not recorded:
        report.notes.append(f"{unchecked}: data_config.json names no target folder with tokenizer files")
        return None
    path = Path(where)
    if not path.is_dir():
        report.notes.append(f"{unchecked}: the target {where} is not here")
        return None
    changed = sorted(n for n, d in recorded.items() if not (path / n).is_file() or file_sha256(path / n) != d)
    if changed:
        report.notes.append(f"{unchecked}: {', '.join(changed)} in {where} differ from the run's")
        return None
    from transformers import AutoTokenizer  # noqa: PLC0415 - slow to import; only a regenerated folder needs it

    try:
        return AutoTokenizer.from_pretrained(where)
    except Exception as exc:  # noqa: BLE001 - a tokenizer that does not load is a note, not a crash
        report.notes.append(f"{unchecked}: the tokenizer at {where} does not load ({type(exc).__name__})")
        return None


def _shards_agree(folders: list[Path], report: Report) -> None:
    """Shard folders made with other shared settings (another seed, layers, sequence length, target, dataset,
    model-changing engine arguments: a trainer would mix them as one dataset) are a finding, naming the first
    folder and what differs."""
    made = []
    for folder in folders:
        try:
            config = run_config.load(folder)
        except run_config.ResumeMismatchError:
            continue  # the folder's own check names it
        ours = config.get("speculators_v016") if isinstance(config, dict) else None
        if isinstance(ours, dict) and isinstance(ours.get("fingerprint"), dict):
            made.append((folder, ours))
    for folder, ours in made[1:]:
        diff = run_config.shard_differences(made[0][1], ours["fingerprint"], ours.get(MODEL_ARGS_KEY) or {})
        if diff:
            report.problems.append(
                f"{folder}: made with other settings than {made[0][0]}, yet in one folder: "
                + "; ".join(redact(diff[:6]))
                + (f"; and {len(diff) - 6} more" if len(diff) > 6 else "")
            )


def _skipped(last_run) -> int:
    """Samples the last run counted and did not write: NaN/Inf states, turns --regenerate had no room for, names
    whose rows were dropped after tokenizing."""
    if not isinstance(last_run, dict):
        return 0
    reasons = last_run.get("skipped") if isinstance(last_run.get("skipped"), dict) else {}
    cut = [reasons.get(r, 0) for r in (regenerated.NOT_GENERATED, regenerated.STOPPED)]
    dropped = last_run.get("dropped", 0)  # names without a sample: rows dropped after tokenizing (prefill runs)
    cut.append(dropped if isinstance(dropped, int) and not isinstance(dropped, bool) else 0)
    return len(last_run.get("non_finite", [])) + sum(n for n in cut if isinstance(n, int))


def _folders(root: Path, report: Report) -> list[Path]:
    """The shard folders of ``root``, or ``root`` itself; a layout mixing both (or shard counts) is a finding."""
    linked = sorted(p for p in root.iterdir() if SHARD_DIR.match(p.name) and p.is_symlink())
    report.problems += [
        f"{p}: a symbolic link (-> {os.readlink(p)}), not a shard folder of ours (not followed)" for p in linked
    ]
    shards = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and SHARD_DIR.match(p.name))
    if shards:
        counts = sorted({SHARD_DIR.match(p.name).group(2) for p in shards})
        if len(counts) > 1:
            report.problems.append(
                f"{root}: shard folders of runs split {' and '.join(str(int(c)) for c in counts)} "
                "ways: a trainer reading the folder would mix them"
            )
        beside = unsharded_run_files(os.listdir(root))
        if beside:
            report.problems.append(
                f"{root}: holds shard folders and an unsharded run's files "
                f"({', '.join(beside[:3])}{', ...' if len(beside) > 3 else ''}): a trainer "
                "reading the folder recursively would mix both"
            )
    return shards or [root]


def _check_sample(
    path: Path,
    layer_ids: list[int],
    hidden: int,
    dtype: str,
    storage: str = "auto",
    zero_ids: frozenset[int] = frozenset(),
    model_args: dict | None = None,
) -> tuple[int, list[str]]:
    try:
        data = load_sample(path, dequantize_to=None)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a finding
        return 0, [f"{path}: cannot be read safely ({type(exc).__name__}: {str(exc)[:200]})"]
    ids, mask, states = data["input_ids"], data["loss_mask"], data["hidden_states"]
    problems = []
    if ids.dim() != 1 or ids.dtype != torch.long:
        problems.append(f"{path}: input_ids is {tuple(ids.shape)} {ids.dtype}, expected [T] int64")
        return 0, problems
    length = ids.shape[0]
    if tuple(mask.shape) != (length,) or not bool(((mask == 0) | (mask == 1)).all()):
        problems.append(f"{path}: loss_mask is not a 0/1 vector aligned with input_ids ({length})")
    if len(states) != len(layer_ids):
        problems.append(f"{path}: {len(states)} hidden-state tensors, data_config.json says {len(layer_ids)}")
        return length, problems
    for j, h in enumerate(states):
        if isinstance(h, fp8.Fp8States) != (storage == fp8.NAME):
            stored = "FP8 codes and scales" if isinstance(h, fp8.Fp8States) else str(h.dtype)
            problems.append(
                f"{path}: hidden_states[{j}] is {stored}, data_config.json says hidden_states_dtype {storage}"
            )
        elif isinstance(h, fp8.Fp8States):
            problems += [f"{path}: hidden_states[{j}]: {p}" for p in _fp8_problems(h, length, hidden)]
        elif tuple(h.shape) != (length, hidden):
            problems.append(f"{path}: hidden_states[{j}] is {tuple(h.shape)}, expected ({length}, {hidden})")
        elif str(h.dtype).removeprefix("torch.") != dtype:
            problems.append(f"{path}: hidden_states[{j}] is {h.dtype}, data_config.json says {dtype}")
        elif not bool(torch.isfinite(h).all()):
            problems.append(f"{path}: hidden_states[{j}] has NaN or Inf")
    if not problems and path.suffix == ".safetensors":
        written = header_metadata(layer_ids, storage == fp8.NAME, model_args)
        found = read_header_metadata(path)
        if found != written:
            changed = sorted(k for k in written.keys() | found.keys() if written.get(k) != found.get(k))
            problems.append(
                f"{path}: header metadata differs from what this tool writes for data_config.json's settings "
                f"(fields {', '.join(changed)})"
            )
    if not problems:
        for j, what in degenerate_layers(ids, states, zero_ids):
            problems.append(
                f"{path}: hidden_states[{j}] (layer {layer_ids[j]}): {what}; no model produces "
                "this: the capture was broken"
            )
    return length, problems


def _fp8_problems(h: fp8.Fp8States, length: int, hidden: int) -> list[str]:
    if tuple(h.shape) != (length, hidden):
        return [f"codes are {tuple(h.shape)}, expected ({length}, {hidden})"]
    problems = h.problems()
    if not problems and not bool(torch.isfinite(h.dequantize()).all()):
        problems.append("not finite once dequantized (a scale too large)")
    return problems


def _file_kind(path: Path) -> str | None:
    """Why ``path`` is not a sample file as this tool writes them (a regular file, not a link), or None."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "listed in the manifest but missing"
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link, not the file this tool wrote (not followed)"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    return None


def _read_regular(path: Path) -> bytes:
    """The bytes of ``path``, never through a link that replaced it since it was checked."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def verify_folder(
    folder: Path, report: Report, seen: dict[int, Path], partial: bool = False, deep: bool = True
) -> FolderSettings | None:
    """Check one folder into ``report``; its settings, or None where it cannot be checked (said in ``report``)."""
    report.folders.append(str(folder))
    try:
        return _verify_folder(folder, report, seen, partial, deep)
    except (ConfigError, ManifestError) as exc:
        report.problems.append(str(exc))
    except Exception as exc:  # noqa: BLE001 - whatever the folder holds, a finding, not a traceback
        report.problems.append(f"{folder}: cannot be verified ({type(exc).__name__}: {str(exc)[:200]})")
    return None


def _verify_folder(
    folder: Path, report: Report, seen: dict[int, Path], partial: bool, deep: bool
) -> FolderSettings | None:
    settings = folder_settings(folder)
    if settings is None:
        report.problems.append(f"{folder}: no {CONFIG} written by speculators-data-gen")
        return None
    fmt, ext = settings.format, FORMATS[settings.format]
    hidden, dtype = settings.hidden_size, settings.dtype
    names = sorted(os.listdir(folder))
    leftovers = [f"{folder / n}: temporary file left by an interrupted write" for n in names if is_our_tmp(n)]
    (report.notes if partial else report.problems).extend(leftovers)  # the next run removes them
    report.problems += [
        f"{folder / n}: not a file of this tool (not opened)"
        for n in names
        if not is_ours(n) and not SHARD_DIR.match(n)
    ]
    manifest = Manifest(folder)
    entries = manifest.entries()
    samples = {e.file for e in entries.values()}  # a listed sample that is a link is named below, with its entry
    report.problems += [
        f"{folder / n}: a symbolic link (-> {os.readlink(folder / n)}), not a file this tool wrote (not followed)"
        for n in no_links.links_in(folder)
        if n not in samples and not SHARD_DIR.match(n)
    ]
    report.problems += [
        f"{manifest.path}:{line}: sample {index} listed again (first on line {first})"
        for line, index, first in manifest.duplicates()
    ]
    listed = {e.file for e in entries.values()}
    journal = regenerated.read_journal(folder, report.problems) if settings.regenerated else {}
    tokenizer = _tokenizer_of(folder, settings, report) if settings.regenerated and deep else None
    if settings.regenerated:
        report.problems += regenerated.folder_problems(folder, set(entries), journal, complete=not partial)
    for name in names:
        parsed = parse_sample_name(name)
        if parsed and (name not in listed or parsed[1] != fmt):
            finding = f"{folder / name}: sample file not in the manifest (or of another format)"
            # a crash between rename and manifest line leaves one; the next run rewrites it
            (report.notes if partial and parsed[1] == fmt else report.problems).append(finding)
    readable: dict[int, Path] = {}  # listed samples whose checks passed: their prompts are checked too
    for index, entry in sorted(entries.items()):
        path = folder / entry.file
        if parse_sample_name(entry.file) != (index, fmt):
            report.problems.append(f"{folder}: manifest entry {index} names {entry.file!r}, not data_{index}{ext}")
            continue
        if index in seen:
            report.problems.append(f"sample {index} exists twice: {seen[index]} and {path}")
        seen[index] = path
        held = sorted(regenerated.folded_into([index], journal))
        for turn in held:  # a folded turn is written in the sample holding it
            if turn in seen or turn in entries:
                report.problems.append(f"turn {turn} is written twice: in {path} and in {seen.get(turn, turn)}")
            seen[turn] = path
        try:
            kind = _file_kind(path)
            if kind:
                report.problems.append(f"{path}: {kind}")
                continue
            if not deep:  # quick: names, sizes, completeness; contents were checked as they were made
                if path.stat().st_size != entry.bytes:
                    report.problems.append(f"{path}: size differs from the manifest")
                report.samples += 1
                report.tokens += entry.tokens
                continue
            data = _read_regular(path)
        except OSError as exc:  # this sample is a finding; the others are still checked
            report.problems.append(f"{path}: cannot be read ({exc.strerror or exc})")
            continue
        if len(data) != entry.bytes or checksum.of_bytes(data, entry.algorithm) != entry.digest:
            report.problems.append(f"{path}: size or {entry.algorithm} differs from the manifest")
            continue
        length, problems = _check_sample(
            path, settings.layer_ids, hidden, dtype, settings.storage, settings.zero_ids, settings.model_args
        )
        report.problems += problems
        if settings.regenerated and not problems:
            found = regenerated.sample_problems(path, journal.get(index), journal)
            if not found and tokenizer is not None:
                for turn in [index, *held]:
                    found += regenerated.text_problems(path, journal[turn], tokenizer)
                if not found:
                    readable[index] = path
            report.problems += found
        if length != entry.tokens and not problems:
            report.problems.append(f"{path}: {length} tokens, the manifest says {entry.tokens}")
        report.samples += 1
        report.tokens += length
    if readable:  # a regenerated folder, read deep, its target's tokenizer here
        report.problems += regenerated.history_problems(folder, journal, readable, tokenizer)
    return settings


def verify(root: str | Path, partial: bool = False, deep: bool = True) -> Report:
    """Check a folder (and its shard folders).

    ``partial`` skips the completeness checks (an interrupted run); ``deep=False``
    skips reading the files (digests, parsing, shapes, NaN): what a run does right
    after writing, since re-reading terabytes there would double the I/O.
    """
    root, report, seen = Path(root), Report(), {}
    if not root.is_dir():
        report.problems.append(f"{root}: no such folder")
        return report
    try:
        folders = _folders(root, report)
    except OSError as exc:
        report.problems.append(f"{root}: cannot be listed ({exc.strerror or exc})")
        return report
    ours = [s for s in (verify_folder(f, report, seen, partial, deep) for f in folders) if s]
    _shards_agree(folders, report)
    if ours and not partial:
        counts = {o.shard_count for o in ours}
        totals = {o.dataset_samples for o in ours}
        starts = {o.start_idx for o in ours}
        if len(counts) == len(totals) == len(starts) == 1:
            count, total, start = counts.pop(), totals.pop(), starts.pop()
            present = {o.shard_index for o in ours}
            missing_shards = sorted(set(range(count)) - present)
            if missing_shards:
                report.problems.append(f"{root}: shards {missing_shards} of {count} are missing")
            skipped = sum(o.skipped for o in ours)
            wanted = set(range(start, start + total))
            absent = sorted(wanted - set(seen))
            if len(absent) > skipped:
                report.problems.append(f"{root}: {len(absent)} of {total} samples are missing (first: {absent[:5]})")
        else:
            report.problems.append(f"{root}: shard folders disagree on shard count, dataset size or start index")
    return report
