"""``data_config.json``: upstream's fields, plus what makes a run checkable and resumable.

Upstream's ``DataGenerationConfig`` fields are kept as they are. Our section
``speculators_v016`` adds the layer ids in both conventions (and the vLLM
serving ids a draft trained on the data must carry), the sample file format,
the shard, a run summary, and a *fingerprint* of everything that decides the
samples' contents: model, dataset, preprocessing and generation arguments.
A resume whose fingerprint differs is refused, naming what differs.

The target's weights are fingerprinted at a cost that stays small for a 600 GB checkpoint
(:func:`weight_digest`): each weight file's size, its safetensors header whole (every tensor's name,
dtype, shape and offsets) and :data:`CHUNKS` reads of :data:`CHUNK` bytes at fixed, evenly spaced
offsets of its data (the first and last MiB among them); a file no larger than those reads is hashed
whole. A checkpoint replaced in place (another training run, another step, a re-quantization: the
same names and sizes, other values) changes every sampled chunk. What is not caught: a change confined
to bytes outside the sampled chunks (one tensor edited by hand, one byte flipped): a full hash of
the weights would read the whole checkpoint at every resume. Config, tokenizer and the folder's other
small files (``*.json``, ``*.py``, ``*.jinja``, ``*.model``, ``*.tiktoken``) are hashed whole.
Nothing written holds a secret (:mod:`speculators_v016.redact`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from speculators_v016.redact import redact, without_secrets
from speculators_v016.store import no_links
from speculators_v016.store.atomic_files import write_atomic
from speculators_v016.store.outdir import CONFIG
from speculators_v016.store.sample_format import MODEL_ARGS_KEY

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
#: The files of a model folder that a tokenizer reads (their sha256 are in the fingerprint).
TOKENIZER_FILES = _TOKENIZER_FILES


class ResumeMismatchError(RuntimeError):
    """The folder holds samples made with other settings."""


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in blocks (dataset files can be large)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


#: The sampled reads of a weight file: CHUNKS reads of CHUNK bytes (see the module's docstring).
CHUNK = 1 << 20
CHUNKS = 4
#: safetensors' own limit on a header's length (a larger "header" is not one: the file is sampled as bytes)
_HEADER_LIMIT = 100_000_000
#: The method of :func:`weight_digest`, in each digest: another method's digests are never compared as equal.
DIGEST_METHOD = "sampled-sha256-v1"
#: Small files of a model folder hashed whole, beside config.json and the tokenizer's files.
_SMALL_FILES = (".json", ".py", ".jinja", ".model", ".tiktoken")
#: The fingerprint field an earlier release's folder lacks: its weights were fingerprinted by size alone.
WEIGHT_DIGESTS = "weight_digests"


def _is_weight_file(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt")) or name.endswith(".index.json")


def chunk_offsets(length: int) -> list[tuple[int, int]]:
    """The ``(offset, size)`` reads of a file's ``length`` data bytes: all of it where that is no more than
    CHUNKS x CHUNK, else CHUNKS reads of CHUNK bytes, evenly spaced from the first byte to the last."""
    if length <= CHUNKS * CHUNK:
        return [(0, length)] if length > 0 else []
    step = (length - CHUNK) // (CHUNKS - 1)
    return [(i * step, CHUNK) for i in range(CHUNKS - 1)] + [(length - CHUNK, CHUNK)]


def weight_digest(path: Path) -> str:
    """``sampled-sha256-v1:<hex>`` of a weight file: its size, its safetensors header whole (where it has a
    valid one), and the reads :func:`chunk_offsets` gives of the rest; a few MiB read, whatever the size."""
    path = Path(path)
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        size = _size(fh)
        digest.update(b"size %d\n" % size)
        start = 0
        if path.name.endswith(".safetensors") and size >= 8:
            head = fh.read(8)
            length = struct.unpack("<Q", head)[0]
            if length <= min(_HEADER_LIMIT, size - 8):
                digest.update(b"header ")
                digest.update(head + fh.read(length))
                start = 8 + length
        for offset, count in chunk_offsets(size - start):
            fh.seek(start + offset)
            digest.update(b"chunk %d\n" % (start + offset))
            digest.update(fh.read(count))
    return f"{DIGEST_METHOD}:{digest.hexdigest()}"


def _size(fh) -> int:
    fh.seek(0, 2)
    size = fh.tell()
    fh.seek(0)
    return size


def model_fingerprint(model: str) -> dict:
    """What identifies the target: for a folder, its config, tokenizer and other small files (hashed whole) and
    its weight files (sizes, and :func:`weight_digest`)."""
    path = Path(model)
    if not path.is_dir():
        return {"name": model}
    entries = sorted(p for p in path.iterdir() if p.is_file())
    weights = [p for p in entries if _is_weight_file(p.name)]
    named = {"config.json", *_TOKENIZER_FILES}
    return {
        "path": str(path.resolve()),
        "config_sha256": file_sha256(path / "config.json") if (path / "config.json").exists() else None,
        "tokenizer_sha256": {n: file_sha256(path / n) for n in _TOKENIZER_FILES if (path / n).exists()},
        "weight_files": {p.name: p.stat().st_size for p in weights},
        WEIGHT_DIGESTS: {p.name: weight_digest(p) for p in weights},
        "file_sha256": {
            p.name: file_sha256(p)
            for p in entries
            if p.name.endswith(_SMALL_FILES) and p.name not in named and not _is_weight_file(p.name)
        },
    }


def files_fingerprint(given: str) -> dict:
    """What identifies a tokenizer or config that ``--engine-args`` names (``tokenizer``, ``hf_config_path``):
    a local file's sha256, a local folder's config, tokenizer and other small files' (hub ids: the name)."""
    path = Path(given)
    if path.is_file():
        return {"path": str(path.resolve()), "sha256": file_sha256(path)}
    if not path.is_dir():
        return {"name": given}
    named = [p for p in sorted(path.iterdir()) if p.is_file() and p.name.endswith((*_SMALL_FILES, ".txt"))]
    return {"path": str(path.resolve()), "sha256": {p.name: file_sha256(p) for p in named}}


def differences(old, new, prefix: str = "") -> list[str]:
    """Human-readable paths where two fingerprints differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += differences(old.get(key), new.get(key), f"{prefix}{key}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')}: {old!r} -> {new!r}"]


#: Fingerprint fields left out where they hold their default (so folders of earlier releases still resume),
#: compared and named as that default: a refused resume says ``'fp8_e4m3' -> 'auto'``, never ``-> None``.
FINGERPRINT_DEFAULTS = {("generation", "hidden_states_dtype"): "auto", ("generation", "engine_args"): {}}


def _with_defaults(fingerprint) -> dict:
    if not isinstance(fingerprint, dict):
        return fingerprint
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in fingerprint.items()}
    for (section, key), value in FINGERPRINT_DEFAULTS.items():
        if isinstance(out.get(section), dict):
            out[section].setdefault(key, value)
    return out


def load(directory: Path) -> dict | None:
    path = Path(directory) / CONFIG
    try:
        return json.loads(no_links.read_bytes(path).decode("utf-8"))  # never through a link
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResumeMismatchError(f"{path} is not valid JSON ({exc}); not a folder of ours to resume") from exc
    except OSError as exc:
        raise ResumeMismatchError(
            f"{path} cannot be read ({exc.strerror or exc}); not a folder of ours to resume"
        ) from exc


def check_resume(directory: Path, fingerprint: dict, has_samples: bool) -> dict | None:
    """The existing config if it matches ``fingerprint``; raise if it does not."""
    existing = load(directory)
    if existing is None:
        if has_samples:
            raise ResumeMismatchError(
                f"{directory} holds sample files but no {CONFIG}: not a run of this tool to resume; use another folder"
            )
        return None
    ours = existing.get("speculators_v016", {}).get("fingerprint")
    if ours is None:
        raise ResumeMismatchError(
            f"{directory}/{CONFIG} was not written by speculators-data-gen (no fingerprint); use another folder"
        )
    _refuse_sizes_only(directory, ours, fingerprint)
    diff = differences(without_secrets(_with_defaults(ours)), without_secrets(_with_defaults(fingerprint)))
    if diff:
        notes = [note for prefix, note in _HINTS.items() if any(d.startswith(prefix) for d in diff)]
        raise ResumeMismatchError(
            f"{directory} was generated with other settings; resuming would mix samples. Differs:\n  "
            + "\n  ".join(redact(diff))
            + "".join(f"\n({note})" for note in notes)
            + "\nUse another --output-dir, or the original settings."
        )
    return existing


#: What a difference under a fingerprint path means, said after the list.
_HINTS = {
    "preprocessing.conversations": "this release reads conversation rows otherwise than the one that made the "
    "folder (a row's system prompt, fields not read: see the CHANGELOG), so its samples and new ones would differ",
    "generation.regenerate.rows_read": "this release reads conversation rows otherwise than the one that made the "
    "folder (a row's system prompt, fields not read: see the CHANGELOG)",
    f"model.{WEIGHT_DIGESTS}.": "the target's weight files hold other contents than when the folder's samples were "
    "made: the checkpoint was replaced in place (same names and sizes, other weights)",
    "model.file_sha256.": "a small file of the target's folder (generation_config.json, its code, ...) changed",
    "engine_arg_files.": "a file --engine-args names (tokenizer, hf_config_path) changed",
}


def _refuse_sizes_only(directory: Path, ours, fingerprint: dict) -> None:
    """A folder of an earlier release fingerprinted its target's weights by their sizes only: a checkpoint
    replaced in place since cannot be told apart, so the resume is refused, saying so."""
    old, new = (f.get("model") if isinstance(f, dict) else None for f in (ours, fingerprint))
    if isinstance(old, dict) and "weight_files" in old and WEIGHT_DIGESTS not in old and WEIGHT_DIGESTS in (new or {}):
        raise ResumeMismatchError(
            f"{directory}/{CONFIG} was written by an earlier release, whose fingerprint holds the target's weight "
            f"files by size only (no model.{WEIGHT_DIGESTS}): whether {old.get('path')} still holds the weights "
            "its samples came from cannot be proven, and a checkpoint replaced in place would mix two models' "
            "samples. Finish the folder with the release that started it, or use another --output-dir."
        )


#: Engine arguments naming a tokenizer or a config whose contents the fingerprint holds (``engine_arg_files``).
ENGINE_ARG_FILES = ("tokenizer", "hf_config_path")


class ShardMismatchError(ResumeMismatchError):
    """Another shard folder of the same ``--output-dir`` was made with other settings."""


def shared_settings(fingerprint) -> dict:
    """What every shard of one run must share: the fingerprint less the shard's own index, less the places files
    were read from (``path``: a model or a dataset mounted elsewhere on another host; their contents' digests
    kept) and less the engine arguments (those that change the model are compared as the run recorded them:
    :func:`shard_differences`); secrets left out as the resume check leaves them."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "path"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    out = strip(without_secrets(_with_defaults(fingerprint)))
    if isinstance(out, dict) and isinstance(out.get("generation"), dict):
        out["generation"].pop("shard_index", None)
        # a host's memory or batching settings may differ: the engine arguments that change the model are compared
        # as the run recorded them (shard_differences)
        out["generation"].pop("engine_args", None)
    return out


def _model_args(given) -> dict:
    """The model-changing engine arguments a run recorded (``data_config.json``'s ``MODEL_ARGS_KEY``, vLLM's
    defaults left out), less those naming files, whose contents ``engine_arg_files`` compares."""
    return {k: v for k, v in given.items() if k not in ENGINE_ARG_FILES} if isinstance(given, dict) else {}


def shard_differences(theirs: dict, fingerprint: dict, model_args: dict) -> list[str]:
    """Where a sibling shard's ``speculators_v016`` section (its fingerprint, its model-changing engine
    arguments) differs from this shard's ``fingerprint`` and ``model_args``: the settings every shard of one run
    shares (:func:`shared_settings`)."""
    diff = differences(shared_settings(theirs.get("fingerprint")), shared_settings(fingerprint))
    return diff + differences(_model_args(theirs.get(MODEL_ARGS_KEY)), _model_args(model_args), f"{MODEL_ARGS_KEY}.")


def check_shards_agree(directory: Path, fingerprint: dict, siblings: list[Path], model_args: dict) -> None:
    """Raise ShardMismatchError where a sibling shard folder's ``data_config.json`` holds other shared settings
    (:func:`shared_settings`) than ``fingerprint``: their samples would be one dataset to a trainer, its rows
    drawn in another order, other layers or another target mixed in. A sibling without the file yet (a shard
    starting) is passed over; one whose file is not ours is refused."""
    for other in siblings:
        config = load(other)
        if config is None:
            continue
        ours = config.get("speculators_v016") if isinstance(config, dict) else None
        theirs = ours.get("fingerprint") if isinstance(ours, dict) else None
        if not isinstance(theirs, dict):
            raise ShardMismatchError(
                f"{other}/{CONFIG} was not written by speculators-data-gen (no fingerprint): {directory} cannot be "
                "proven to belong to the same run; use another --output-dir"
            )
        diff = shard_differences(ours, fingerprint, model_args)
        if diff:
            raise ShardMismatchError(
                f"{directory} would be a shard of the same run as {other}, which was made with other settings: "
                "a trainer reading the folder would mix the two. Differs:\n  "
                + "\n  ".join(redact(diff))
                + f"\nGive every shard of {directory.parent} the same settings, or use another --output-dir."
            )


def save(directory: Path, config: dict) -> None:
    """Write ``data_config.json``, secrets redacted (a folder of an earlier release may hold them)."""
    text = json.dumps(redact(config), indent=2, sort_keys=False) + "\n"
    write_atomic(Path(directory), CONFIG, text.encode())
