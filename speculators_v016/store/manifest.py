"""The manifest: one JSON line per finished sample, appended only after its file is in place.

A line is written (and fsynced) after the sample file was fsynced and renamed
to its final name and the rename made durable (the folder fsynced), so the
manifest never lists a file that is not complete. Lines come in batches, one
write and one fsync each (:mod:`~speculators_v016.store.group_commit`). A
crash can leave a final file without its line (it is then written again on
resume) or a torn last line (ignored, and cut off by the next run's
:meth:`Manifest.reconcile`, even when it is the only line), never the reverse.
Any other line that is not an entry (garbage, bytes that are not UTF-8) means
something else changed the file: :class:`ManifestError`, naming the line. The
manifest is read and appended to without following a link, and appended to only
where it is a regular file of one link (:mod:`~speculators_v016.store.no_links`).

A line is ``{"bytes", "file", "index", <algorithm>, "tokens"}``: the key of the
file's digest names its algorithm (``blake3``, or ``sha256`` as every earlier
release wrote: their lines read as they are; :mod:`~speculators_v016.store.checksum`).
"""

from __future__ import annotations

import json
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from speculators_v016.store import checksum, no_links
from speculators_v016.store.atomic_files import write_atomic

NAME = "manifest.jsonl"


class ManifestError(ValueError):
    """The manifest cannot be read as ours (not a file, or a line that is not an entry); names path and line."""


@dataclass(frozen=True)
class Entry:
    index: int
    file: str
    bytes: int
    digest: str  # hex, of the file's bytes
    tokens: int
    algorithm: str  # of ``digest``: one of checksum.ALGORITHMS

    def __post_init__(self) -> None:
        for name in ("index", "bytes", "tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TypeError(f"{name} must be a whole number, got {value!r}")
        if not isinstance(self.file, str) or not isinstance(self.digest, str):
            raise TypeError("file and digest must be strings")
        if self.algorithm not in checksum.ALGORITHMS:
            raise TypeError(f"unknown checksum algorithm {self.algorithm!r}")

    def record(self) -> dict:
        """The manifest line's fields: the digest under its algorithm's name."""
        return {
            "index": self.index,
            "file": self.file,
            "bytes": self.bytes,
            self.algorithm: self.digest,
            "tokens": self.tokens,
        }

    def line(self) -> str:
        return json.dumps(self.record(), sort_keys=True) + "\n"

    @classmethod
    def parse(cls, record) -> Entry:
        """The entry of a manifest line's fields; TypeError unless exactly one digest of a known algorithm."""
        if not isinstance(record, dict):
            raise TypeError(f"a manifest line is an object, got {type(record).__name__}")
        fields = dict(record)
        named = [a for a in checksum.ALGORITHMS if a in fields]
        if len(named) != 1:
            raise TypeError(f"a manifest line holds one digest of {list(checksum.ALGORITHMS)}, got {named}")
        digest = fields.pop(named[0])
        return cls(**fields, digest=digest, algorithm=named[0])


def _regular_size(path: Path) -> int | None:
    """The size of the regular file at ``path`` (a link is not followed: None), None where there is none."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


class Manifest:
    def __init__(self, directory: Path):
        self.path = Path(directory) / NAME
        self._lock = threading.Lock()

    def _read(self) -> tuple[dict[int, Entry], bool]:
        """(entries by sample index, whether the file ends in a torn line)."""
        entries, torn, _ = self._parse()
        return entries, torn

    def duplicates(self) -> list[tuple[int, int, int]]:
        """``(line, sample index, line that listed it first)`` for each line listing a sample again."""
        return self._parse()[2]

    def _parse(self) -> tuple[dict[int, Entry], bool, list[tuple[int, int, int]]]:
        try:
            data = no_links.read_bytes(self.path)
        except FileNotFoundError:
            return {}, False, []
        except OSError as exc:
            raise ManifestError(f"{self.path}: cannot be read ({exc.strerror or exc})") from exc
        out: dict[int, Entry] = {}
        first: dict[int, int] = {}
        again: list[tuple[int, int, int]] = []
        lines = data.split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = Entry.parse(json.loads(line.decode("utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as exc:
                if number == len(lines):  # last line without newline: torn append
                    break
                raise ManifestError(
                    f"{self.path}:{number}: not a manifest entry of this tool ({type(exc).__name__}: {str(exc)[:120]})"
                ) from exc
            if entry.index in first:
                again.append((number, entry.index, first[entry.index]))
            first.setdefault(entry.index, number)
            out[entry.index] = entry
        return out, bool(lines[-1]), again

    def entries(self) -> dict[int, Entry]:
        """Entries by sample index; a torn last line (crash mid-append) is ignored."""
        return self._read()[0]

    def append(self, *entries: Entry) -> None:
        """Append the lines of ``entries`` in one write, then fsync (one commit for a batch of files)."""
        data = "".join(e.line() for e in entries).encode()
        with self._lock:
            fd = no_links.open_in_place(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # never through a link
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)

    def reconcile(self) -> dict[int, Entry]:
        """Entries whose files are in place with the recorded size; the manifest is rewritten to exactly
        those when any is missing or the last line is torn, the only line included (the rest is redone by the
        run; appending after a torn line would glue the next entry onto it)."""
        entries, torn = self._read()
        folder = self.path.parent
        good = {i: e for i, e in entries.items() if _regular_size(folder / e.file) == e.bytes}
        if len(good) != len(entries) or torn:
            self.compact(good)
        return good

    def compact(self, keep: dict[int, Entry]) -> None:
        """Rewrite the manifest with exactly ``keep`` (atomically): drops torn or stale lines."""
        text = "".join(keep[i].line() for i in sorted(keep))
        with self._lock:
            write_atomic(self.path.parent, NAME, text.encode())
