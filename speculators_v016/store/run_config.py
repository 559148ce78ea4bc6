"""``data_config.json``: upstream's fields, plus what makes a run checkable and resumable.

Upstream's ``DataGenerationConfig`` fields are kept as they are. Our section
``speculators_v016`` adds the layer ids in both conventions (and the vLLM
serving ids a draft trained on the data must carry), the sample file format,
the shard, a run summary, and a *fingerprint* of everything that decides the
samples' contents: model, dataset, preprocessing and generation arguments.
A resume whose fingerprint differs is refused, naming what differs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from speculators_v016.store.atomic_files import write_atomic
from speculators_v016.store.outdir import CONFIG

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


class ResumeMismatchError(RuntimeError):
    """The folder holds samples made with other settings."""


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in blocks (dataset files can be large)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def model_fingerprint(model: str) -> dict:
    """What identifies the target: for a folder, its config, tokenizer and weight files."""
    path = Path(model)
    if not path.is_dir():
        return {"name": model}
    weights = {
        p.name: p.stat().st_size
        for p in sorted(path.iterdir())
        if p.suffix in (".safetensors", ".bin", ".pt") or p.name.endswith(".index.json")
    }
    return {
        "path": str(path.resolve()),
        "config_sha256": file_sha256(path / "config.json") if (path / "config.json").exists() else None,
        "tokenizer_sha256": {n: file_sha256(path / n) for n in _TOKENIZER_FILES if (path / n).exists()},
        "weight_files": weights,
    }


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
    if not path.exists():
        return None
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
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
    diff = differences(_with_defaults(ours), _with_defaults(fingerprint))
    if diff:
        raise ResumeMismatchError(
            f"{directory} was generated with other settings; resuming would mix samples. Differs:\n  "
            + "\n  ".join(diff)
            + "\nUse another --output-dir, or the original settings."
        )
    return existing


def save(directory: Path, config: dict) -> None:
    write_atomic(Path(directory), CONFIG, (json.dumps(config, indent=2, sort_keys=False) + "\n").encode())
