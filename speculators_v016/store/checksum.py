"""The per-file digest of the manifest: BLAKE3 (default) or sha256, named where it is recorded.

Both are cryptographic hashes: a manifest proves a file is the one written.
BLAKE3 (the ``blake3`` package) takes about a quarter of sha256's CPU per GiB
on one core, and its hex digest is the standard BLAKE3-256 one, what
``b3sum FILE`` prints. sha256 stays for users whose tooling wants it
(``--checksum sha256``) and for folders of earlier releases, whose manifest
lines carry a ``sha256`` key: a manifest line names its algorithm by its key
(``"blake3": hex`` or ``"sha256": hex``) and ``data_config.json`` says the
folder's (``speculators_v016.checksum``; absent: sha256, as every earlier
release wrote). A folder keeps one algorithm for life: a resume continues with
the folder's.

Both release the GIL on large buffers, so the writer threads hash on as many
cores; each digest is computed on one thread (``blake3``'s own threads stay off).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import blake3

ALGORITHMS = ("blake3", "sha256")
DEFAULT = "blake3"
#: What a folder without a ``checksum`` field in ``data_config.json`` holds: every earlier release wrote sha256.
LEGACY = "sha256"


def new(algorithm: str):
    """A fresh digest object of ``algorithm`` (``update(buffer)``, ``hexdigest()``)."""
    if algorithm == "blake3":
        return blake3.blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; choose from {list(ALGORITHMS)}")


def of_bytes(data, algorithm: str) -> str:
    """Hex digest of a buffer."""
    digest = new(algorithm)
    digest.update(data)
    return digest.hexdigest()


def of_file(path: str | Path, algorithm: str, block: int = 16 << 20) -> str:
    """Hex digest of a file's bytes, read in blocks."""
    digest = new(algorithm)
    with Path(path).open("rb", buffering=0) as fh:
        buffer = bytearray(block)
        view = memoryview(buffer)
        while count := fh.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()
