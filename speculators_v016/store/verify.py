"""``speculators-data-gen verify DIR``: is every sample there, intact, and what the config says?

Checks, per folder (or per shard folder, plus their union): ``data_config.json``
is present; no temporary leftovers and no foreign files (those are reported,
never opened); every manifest entry's file exists with the recorded size and
sha256; every file parses (safetensors, or ``.pt`` with ``weights_only``),
has the recorded number of layers, ``[T, hidden_size]`` states of the recorded
dtype, a 0/1 loss mask as long as ``input_ids``, and no NaN/Inf; no sample file
lacks a manifest entry; across shards every index exists exactly once.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speculators_v016.store import run_config
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.outdir import CONFIG, SHARD_DIR, is_ours
from speculators_v016.store.sample_format import FORMATS, load_sample, parse_sample_name
from speculators_v016.store.atomic_files import TMP_PREFIX


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


def _folders(root: Path) -> list[Path]:
    shards = sorted(p for p in root.iterdir() if p.is_dir() and SHARD_DIR.match(p.name))
    return shards or [root]


def _check_sample(path: Path, layers: int, hidden: int, dtype: str) -> tuple[int, list[str]]:
    try:
        data = load_sample(path)
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
    if len(states) != layers:
        problems.append(f"{path}: {len(states)} hidden-state tensors, data_config.json says {layers}")
    for j, h in enumerate(states):
        if tuple(h.shape) != (length, hidden):
            problems.append(f"{path}: hidden_states[{j}] is {tuple(h.shape)}, expected ({length}, {hidden})")
        elif str(h.dtype).removeprefix("torch.") != dtype:
            problems.append(f"{path}: hidden_states[{j}] is {h.dtype}, data_config.json says {dtype}")
        elif not bool(torch.isfinite(h).all()):
            problems.append(f"{path}: hidden_states[{j}] has NaN or Inf")
    return length, problems


def verify_folder(folder: Path, report: Report, seen: dict[int, Path], partial: bool = False,
                  deep: bool = True) -> dict | None:
    report.folders.append(str(folder))
    config = run_config.load(folder)
    if config is None or "speculators_v016" not in config:
        report.problems.append(f"{folder}: no {CONFIG} written by speculators-data-gen")
        return None
    ours = config["speculators_v016"]
    fmt, ext = ours["format"], FORMATS[ours["format"]]
    layers = len(ours["layers"]["layer_ids"])
    hidden, dtype = config["model"]["hidden_size"], ours["dtype"]
    names = sorted(os.listdir(folder))
    leftovers = [f"{folder / n}: temporary file left by an interrupted write" for n in names
                 if n.startswith(TMP_PREFIX)]
    (report.notes if partial else report.problems).extend(leftovers)  # the next run removes them
    report.problems += [f"{folder / n}: not a file of this tool (not opened)" for n in names
                        if not is_ours(n) and not SHARD_DIR.match(n)]
    entries = Manifest(folder).entries()
    listed = {e.file for e in entries.values()}
    for name in names:
        parsed = parse_sample_name(name)
        if parsed and (name not in listed or parsed[1] != fmt):
            finding = f"{folder / name}: sample file not in the manifest (or of another format)"
            # a crash between rename and manifest line leaves one; the next run rewrites it
            (report.notes if partial and parsed[1] == fmt else report.problems).append(finding)
    for index, entry in sorted(entries.items()):
        path = folder / entry.file
        if parse_sample_name(entry.file) != (index, fmt):
            report.problems.append(f"{folder}: manifest entry {index} names {entry.file!r}, not data_{index}{ext}")
            continue
        if index in seen:
            report.problems.append(f"sample {index} exists twice: {seen[index]} and {path}")
        seen[index] = path
        if not path.is_file():
            report.problems.append(f"{path}: listed in the manifest but missing")
            continue
        if not deep:  # quick: names, sizes, completeness; contents were checked as they were made
            if path.stat().st_size != entry.bytes:
                report.problems.append(f"{path}: size differs from the manifest")
            report.samples += 1
            report.tokens += entry.tokens
            continue
        data = path.read_bytes()
        if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            report.problems.append(f"{path}: size or sha256 differs from the manifest")
            continue
        length, problems = _check_sample(path, layers, hidden, dtype)
        report.problems += problems
        if length != entry.tokens and not problems:
            report.problems.append(f"{path}: {length} tokens, the manifest says {entry.tokens}")
        report.samples += 1
        report.tokens += length
    return config


def verify(root: str | Path, partial: bool = False, deep: bool = True) -> Report:
    """Check a folder (and its shard folders).

    ``partial`` skips the completeness checks (an interrupted run); ``deep=False``
    skips reading the files (sha256, parsing, shapes, NaN): what a run does right
    after writing, since re-reading terabytes there would double the I/O.
    """
    root, report, seen = Path(root), Report(), {}
    if not root.is_dir():
        report.problems.append(f"{root}: no such folder")
        return report
    configs = [c for c in (verify_folder(f, report, seen, partial, deep) for f in _folders(root)) if c]
    if configs and not partial:
        ours = [c["speculators_v016"] for c in configs]
        counts = {o["shard"]["count"] for o in ours}
        totals = {o["dataset_samples"] for o in ours}
        starts = {o["start_idx"] for o in ours}
        if len(counts) == len(totals) == len(starts) == 1:
            count, total, start = counts.pop(), totals.pop(), starts.pop()
            present = {o["shard"]["index"] for o in ours}
            missing_shards = sorted(set(range(count)) - present)
            if missing_shards:
                report.problems.append(f"{root}: shards {missing_shards} of {count} are missing")
            skipped = sum(len(o.get("last_run", {}).get("non_finite", [])) for o in ours)
            wanted = set(range(start, start + total))
            absent = sorted(wanted - set(seen))
            if len(absent) > skipped:
                report.problems.append(f"{root}: {len(absent)} of {total} samples are missing "
                                       f"(first: {absent[:5]})")
        else:
            report.problems.append(f"{root}: shard folders disagree on shard count, dataset size or start index")
    return report
