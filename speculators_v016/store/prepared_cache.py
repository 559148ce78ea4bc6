"""The cache of prepared rows: numpy arrays in files of ours, named by hex digests, checked before use.

An entry is one file ``<64 hex digits>.prep``: a magic line, the length of a JSON header, the header (the
arrays' names, dtypes, shapes and offsets, the entry's own facts, the payload's size and sha256), then the
arrays' bytes, each at a 64-byte boundary. It is written atomically (a temporary name, fsync, rename:
:mod:`~speculators_v016.store.atomic_files`, never through a link) and read never through a link
(:mod:`~speculators_v016.store.no_links`), never with pickle: the header is JSON and the arrays are raw bytes of
the dtypes the header names (plain numeric ones only), memory-mapped. An entry whose size or sha256 is not its
header's, or whose header does not parse, is reported (:class:`CorruptEntry`) and never used; the caller
rebuilds it. Nothing in the folder that is not an entry of ours (or our temporary file) is read or touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np

from speculators_v016.store import no_links
from speculators_v016.store.atomic_files import TMP_PREFIX, write_atomic

MAGIC = b"speculators_v016 prepared 1\n"
SUFFIX = ".prep"
_NAME = re.compile(r"^[0-9a-f]{64}\.prep$")
_ALIGN = 64
#: the dtypes an entry may hold (a header naming another is corrupt: no object arrays, ever)
DTYPES = frozenset({"uint8", "int8", "uint32", "int32", "int64"})


class CorruptEntry(ValueError):
    """A cache entry that is not what its header says (truncated, changed, not ours): never used."""


def default_folder(environ=os.environ) -> Path:
    """``$XDG_CACHE_HOME/speculators_v016/prepared``, else ``~/.cache/speculators_v016/prepared``."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "speculators_v016" / "prepared"


def entry_name(*parts: str) -> str:
    """The file name of the entry of ``parts``: their sha256, in hex, and nothing else."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() + b"\0")
    return digest.hexdigest() + SUFFIX


def _padding(at: int) -> int:
    return -at % _ALIGN


def write_entry(folder: Path, name: str, arrays: dict[str, np.ndarray], facts: dict) -> int:
    """Write entry ``name`` (from :func:`entry_name`) of ``arrays`` and ``facts`` (JSON), atomically; its bytes."""
    if not _NAME.match(name):
        raise ValueError(f"not a cache entry name: {name!r}")
    folder.mkdir(parents=True, exist_ok=True)
    layout, payload, at = [], [], 0
    digest = hashlib.sha256()
    for key, array in arrays.items():
        array = np.ascontiguousarray(array)
        if array.dtype.name not in DTYPES:
            raise ValueError(f"cache entry array {key}: dtype {array.dtype} is not one of {sorted(DTYPES)}")
        pad = b"\0" * _padding(at)
        data = memoryview(array).cast("B") if array.size else b""
        layout.append({"name": key, "dtype": array.dtype.name, "shape": list(array.shape), "offset": at + len(pad)})
        payload += [pad, data]
        digest.update(pad)
        digest.update(data)
        at += len(pad) + array.nbytes
    header = json.dumps(
        {"arrays": layout, "facts": facts, "payload_bytes": at, "payload_sha256": digest.hexdigest()}
    ).encode()
    head = MAGIC + len(header).to_bytes(8, "little") + header
    head += b"\0" * _padding(len(head))
    size, _ = write_atomic(folder, name, [head, *payload], algorithm="sha256")
    return size


def read_entry(folder: Path, name: str) -> tuple[dict[str, np.ndarray], dict] | None:
    """``(arrays, facts)`` of entry ``name`` (arrays memory-mapped, read-only), None where there is none;
    :class:`CorruptEntry` where it is not what its header says (its size, its payload's sha256)."""
    if not _NAME.match(name):
        raise ValueError(f"not a cache entry name: {name!r}")
    path = folder / name
    try:
        fh = no_links.open_to_read(path)
    except FileNotFoundError:
        return None
    with fh:
        magic = fh.read(len(MAGIC))
        if magic != MAGIC:
            raise CorruptEntry(f"{path}: not a prepared-rows entry (its first bytes)")
        length = int.from_bytes(fh.read(8), "little")
        size = os.fstat(fh.fileno()).st_size
        if length > size:
            raise CorruptEntry(f"{path}: truncated (its header says {length:,} header bytes, the file has {size:,})")
        try:
            header = json.loads(fh.read(length).decode())
            layout, facts = header["arrays"], header["facts"]
            payload_bytes, expected = int(header["payload_bytes"]), str(header["payload_sha256"])
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise CorruptEntry(f"{path}: its header does not parse ({exc})") from None
        start = len(MAGIC) + 8 + length
        start += _padding(start)
        if size != start + payload_bytes:
            raise CorruptEntry(f"{path}: {size:,} bytes, its header says {start + payload_bytes:,} (truncated?)")
        fh.seek(start)
        digest = hashlib.sha256()
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
        if digest.hexdigest() != expected:
            raise CorruptEntry(f"{path}: its bytes' sha256 is not its header's (changed or damaged)")
        arrays = {}
        try:
            for item in layout:
                dtype = str(item["dtype"])
                if dtype not in DTYPES:
                    raise CorruptEntry(f"{path}: array {item['name']} of dtype {dtype!r}, not one of ours")
                shape = tuple(int(n) for n in item["shape"])
                count = int(np.prod(shape)) if shape else 1
                offset = start + int(item["offset"])
                if offset + count * np.dtype(dtype).itemsize > size:
                    raise CorruptEntry(f"{path}: array {item['name']} runs past the file's end")
                arrays[str(item["name"])] = (
                    np.memmap(fh, dtype=dtype, mode="r", offset=offset, shape=shape)
                    if count
                    else np.zeros(shape, dtype)
                )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CorruptEntry):
                raise
            raise CorruptEntry(f"{path}: its header's arrays do not parse ({exc})") from None
    return arrays, facts


def remove_entry(folder: Path, name: str) -> None:
    """Remove entry ``name`` (ours: a hex-digest name), where it is a file, never following a link."""
    if not _NAME.match(name):
        raise ValueError(f"not a cache entry name: {name!r}")
    path = folder / name
    if path.is_file() and not path.is_symlink():
        path.unlink(missing_ok=True)


def folder_size(folder: Path) -> tuple[int, int]:
    """``(entries, bytes)`` of the entries of ours in ``folder`` (0, 0 where it does not exist)."""
    count = total = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0, 0
    for name in names:
        if _NAME.match(name) or (name.startswith(TMP_PREFIX) and SUFFIX + "." in name):
            try:
                info = os.lstat(folder / name)
            except OSError:
                continue
            count += bool(_NAME.match(name))
            total += info.st_size
    return count, total
