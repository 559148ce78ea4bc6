"""The pinned upstream release: read the pin, fetch, verify and unpack it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

#: Environment variable naming a local copy of the artifact (a file, or a
#: directory holding it) for builds without network.
LOCAL_ARTIFACT_ENV = "SPECULATORS_V016_UPSTREAM_ARTIFACT"


class ArtifactError(RuntimeError):
    """The upstream artifact could not be found, fetched or verified."""


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    filename: str
    sha256: str

    @classmethod
    def load(cls, path: Path) -> Pin:
        data = json.loads(path.read_text())
        return cls(**{k: data[k] for k in ("name", "version", "filename", "sha256")})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "speculators-v016" / "artifacts"


def _verified(path: Path, pin: Pin) -> Path:
    got = sha256_of(path)
    if got != pin.sha256:
        raise ArtifactError(
            f"upstream artifact {pin.filename} at {path} has sha256 {got}, "
            f"but patches/upstream.json pins {pin.sha256}; refusing to build from it"
        )
    return path


def _local_copy(pin: Pin) -> Path | None:
    given = os.environ.get(LOCAL_ARTIFACT_ENV)
    if not given:
        return None
    path = Path(given)
    if path.is_dir():
        path = path / pin.filename
    if not path.is_file():
        raise ArtifactError(f"{LOCAL_ARTIFACT_ENV}={given}: no upstream artifact {pin.filename} there")
    return _verified(path, pin)


def download(name: str, version: str | None, dest: Path) -> Path:
    """Download the wheel of ``name==version`` (None: the newest) with pip (honours pip's config)."""
    spec = name if version is None else f"{name}=={version}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        spec,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ArtifactError(
            f"could not download upstream artifact {spec} from the package index "
            f"(set {LOCAL_ARTIFACT_ENV} to a local copy for offline builds):\n{proc.stderr.strip()}"
        )
    return wheels[0]


def fetch(pin: Pin) -> Path:
    """Return a path to the verified artifact: local copy, cache, or download."""
    local = _local_copy(pin)
    if local is not None:
        return local
    cached = cache_dir() / pin.sha256 / pin.filename
    if cached.is_file():
        return _verified(cached, pin)
    with tempfile.TemporaryDirectory() as tmp:
        got = download(pin.name, pin.version, Path(tmp))
        if got.name != pin.filename:
            raise ArtifactError(f"the index served {got.name}, but the pin names {pin.filename}")
        _verified(got, pin)
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".partial")
        shutil.copyfile(got, partial)
        os.replace(partial, cached)
    return cached


def unpack_wheel(wheel: Path, dest: Path) -> None:
    """Unpack the importable tree of a pure-Python wheel and its LICENSE into ``dest``.

    Wheel metadata (``*.dist-info``) is left out except for the licence file,
    which is placed at ``dest/LICENSE`` so it travels with the assembled tree.
    """
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            parts = Path(info.filename).parts
            if not parts or info.is_dir() or ".." in parts or Path(info.filename).is_absolute():
                continue
            if parts[0].endswith(".dist-info"):
                if parts[-1].startswith("LICENSE"):
                    (dest / "LICENSE").write_bytes(zf.read(info))
                continue
            target = dest.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(info))
