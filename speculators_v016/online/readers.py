"""How a consumer gets the file of a handle: from the serve folder, or out of the Mooncake store.

Either way the dataset gets a local path that upstream's reader opens, and deletes it once read
(the served file itself, or the private copy of a Mooncake object). A Mooncake object is removed
from the store as soon as it is copied out: taken, as a deleted file is.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

from speculators_v016.online.client import ProducerError
from speculators_v016.serve.mooncake import local_address_towards, local_buffer_for

SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") else None


class FolderReader:
    """Files in the service's ``--serve-dir``, seen here at ``folder``."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def fetch(self, handle: dict) -> Path | None:
        """The served file, or None where it is gone (reclaimed before it was read)."""
        path = self.folder / handle["file"]
        return path if path.exists() else None

    def where(self, handle: dict) -> str:
        return (
            f"{handle['file']} is not in {self.folder}: is its --serve-dir seen here under another path (folder=...)?"
        )


class MooncakeReader:
    """Objects of the service's Mooncake store; one store client per process (DataLoader workers fork)."""

    def __init__(self, master: str, max_object_bytes: int):
        self.master, self.buffer = master, local_buffer_for(int(max_object_bytes))
        self._store, self._pid = None, None
        self._lock = threading.Lock()  # one client per process, used by one thread at a time

    def _client(self):
        if self._pid != os.getpid():  # forked: a client of this process's own
            os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # a dead master fails in seconds, not 90
            from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415 - an optional dependency

            store = MooncakeDistributedStore()
            me = local_address_towards(self.master.rsplit(":", 1)[0])
            code = store.setup(me, "P2PHANDSHAKE", 0, self.buffer, "tcp", "", self.master)
            if code != 0:
                raise ProducerError(f"cannot reach the Mooncake store at master {self.master} (setup: code {code})")
            self._store, self._pid = store, os.getpid()
        return self._store

    def fetch(self, handle: dict) -> Path | None:
        with self._lock:
            return self._fetch(handle)

    def _fetch(self, handle: dict) -> Path | None:
        store = self._client()
        data = store.get(handle["key"])
        if len(data) != handle["bytes"]:
            return None  # gone (reclaimed), or the store failed: Mooncake's get says which only in its log
        # a private copy for upstream's reader, deleted once read (no folder: forked workers never run atexit)
        fd, name = tempfile.mkstemp(prefix=f"speculators-online-{os.getpid()}-", suffix=".safetensors", dir=SCRATCH)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        path = Path(name)
        store.remove(handle["key"], True)  # taken
        return path

    def where(self, handle: dict) -> str:
        return f"{handle['key']} could not be read from the Mooncake store at master {self.master}"


def reader_for(info: dict, folder) -> FolderReader | MooncakeReader:
    backend = info["backend"]
    if backend["kind"] == "folder":
        return FolderReader(Path(folder if folder is not None else backend["dir"]))
    if backend["kind"] == "mooncake":
        return MooncakeReader(backend["master"], backend["max_object_bytes"])
    raise ProducerError(f"the producer publishes to a backend this client does not know: {backend['kind']!r}")
