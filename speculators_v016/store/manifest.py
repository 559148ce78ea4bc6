"""The manifest: one JSON line per finished sample, appended only after its file is in place.

A line is written (and fsynced) after the sample file was fsynced and renamed
to its final name and the rename made durable (the folder fsynced), so the
manifest never lists a file that is not complete. Lines come in batches, one
write and one fsync each (:mod:`~speculators_v016.store.group_commit`). A
crash can leave a final file without its line (it is then written again on
resume) or a torn last line (ignored), never the reverse.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from speculators_v016.store.atomic_files import write_atomic

NAME = "manifest.jsonl"


@dataclass(frozen=True)
class Entry:
    index: int
    file: str
    bytes: int
    sha256: str
    tokens: int


class Manifest:
    def __init__(self, directory: Path):
        self.path = Path(directory) / NAME
        self._lock = threading.Lock()

    def entries(self) -> dict[int, Entry]:
        """Entries by sample index; a torn last line (crash mid-append) is ignored."""
        if not self.path.exists():
            return {}
        out: dict[int, Entry] = {}
        lines = self.path.read_text().split("\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = Entry(**json.loads(line))
            except (json.JSONDecodeError, TypeError) as exc:
                if number == len(lines):  # last line without newline: torn append
                    break
                raise ValueError(f"{self.path}:{number}: not a manifest entry ({exc})") from exc
            out[entry.index] = entry
        return out

    def append(self, *entries: Entry) -> None:
        """Append the lines of ``entries`` in one write, then fsync (one commit for a batch of files)."""
        text = "".join(json.dumps(asdict(e), sort_keys=True) + "\n" for e in entries)
        with self._lock, self.path.open("a") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    def reconcile(self) -> dict[int, Entry]:
        """Entries whose files are in place with the recorded size; the manifest is rewritten to exactly
        those when any is missing or the last line is torn (the rest is redone by the run)."""
        entries = self.entries()
        folder = self.path.parent
        good = {i: e for i, e in entries.items()
                if (folder / e.file).is_file() and (folder / e.file).stat().st_size == e.bytes}
        torn = self.path.exists() and not self.path.read_text().endswith("\n") and entries
        if len(good) != len(entries) or torn:
            self.compact(good)
        return good

    def compact(self, keep: dict[int, Entry]) -> None:
        """Rewrite the manifest with exactly ``keep`` (atomically): drops torn or stale lines."""
        text = "".join(json.dumps(asdict(keep[i]), sort_keys=True) + "\n" for i in sorted(keep))
        with self._lock:
            write_atomic(self.path.parent, NAME, text.encode())
