"""The Mooncake store as the service's backend: each sample one object, in the service's own pool.

The layout (Mooncake's distributed store, ``mooncake-transfer-engine`` on GPUs,
``mooncake-transfer-engine-non-cuda`` here, over TCP; RDMA where a cluster has
it): a ``mooncake_master`` (``--mooncake-master auto`` starts one beside the
service on a free port and stops it at exit; ``HOST:PORT`` uses a running one),
the service as a store client that contributes the memory (a segment of the
cap's size plus one object) and puts each sample there, pinned (``with_hard_pin``:
never evicted, so a full store is an error, never a silent loss) and kept in its
own segment; consumers attach with no memory of their own, ``get`` the object
and remove it (:mod:`speculators_v016.online.readers`). Metadata goes peer to
peer (``P2PHANDSHAKE``): no metadata server.

Keys are ``speculators/{host}/{pid}-{start}/online_{n}``: a service's keys are
its own by construction; the pool, and what is in it, goes with the service.
What is not yet taken is found with ``batch_is_exist`` (the records of
:mod:`~speculators_v016.serve.publications`), and a dead consumer's objects are
removed by record, as in the folder.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from speculators_v016.serve.publications import Publications, process_start
from speculators_v016.store.checksum import DEFAULT as DEFAULT_CHECKSUM
from speculators_v016.store.checksum import new as new_digest

FULL = -200  # Mooncake's "not enough space"
MIN_SEGMENT = 64 << 20
MASTER_START_SECONDS = 30.0


class MooncakeError(RuntimeError):
    """The Mooncake store could not be set up or used; the message names the master and the code."""


def local_buffer_for(object_bytes: int) -> int:
    """A client's staging buffer for objects up to ``object_bytes``: Mooncake's allocator needs room
    beyond the object (a 112 MiB put fails in a buffer 64 KiB larger, passes in one twice its size)."""
    return max(2 * object_bytes, 16 << 20)


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what a peer-to-peer Mooncake client advertises)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))  # no packet is sent: only the route is looked up
        return sock.getsockname()[0]


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise MooncakeError(f"{name} not found (pip install mooncake-transfer-engine-non-cuda, or the CUDA build)")
    return found


def _die_with_parent() -> None:
    """In the master's process: SIGTERM when the service dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


class MasterProcess:
    """A ``mooncake_master`` started for the service, on a free port; its log beside the service's."""

    def __init__(self, host: str, log_dir: Path):
        self.host, self.port = host, free_port(host)
        self.log = Path(log_dir) / f"mooncake-master-{os.getpid()}.log"
        cmd = [_binary("mooncake_master"), f"--rpc_address={host}", f"--rpc_port={self.port}",
               f"--metrics_host={host}", f"--metrics_port={free_port(host)}", "--rpc_thread_num=4"]  # fmt: skip
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + MASTER_START_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MooncakeError(f"mooncake_master exited with {self.proc.returncode} at start; see {self.log}")
            try:
                socket.create_connection((host, self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise MooncakeError(f"mooncake_master did not listen on {host}:{self.port} within {MASTER_START_SECONDS} s")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class MooncakeBackend(Publications):
    """Samples as objects of the Mooncake store, in the service's own pinned segment."""

    kind = "mooncake"

    def __init__(self, master: str, host: str, max_bytes: int, lease_seconds: float, log_dir: Path,
                 checksum: str = DEFAULT_CHECKSUM):  # fmt: skip
        super().__init__(max_bytes, lease_seconds)
        self.master_arg, self.host, self.log_dir, self.checksum = master, host, Path(log_dir), checksum
        self.master: MasterProcess | None = None
        self.address = master
        self.store = None
        self.closing = False
        self.object_bytes = 0
        self._next = 0
        self._prefix = f"speculators/{socket.gethostname()}/{os.getpid()}-{process_start(os.getpid())}/"

    def describe(self) -> dict:
        return {"kind": self.kind, "master": self.address, "max_object_bytes": self.object_bytes}

    def open(self, object_bytes: int) -> MooncakeBackend:
        """Start (or reach) the master and set the service up as a store client holding the pool."""
        from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415 - an optional dependency

        self.object_bytes = object_bytes
        if self.master_arg == "auto":
            self.master = MasterProcess(self.host, self.log_dir)
            self.address = self.master.address
        self.store = MooncakeDistributedStore()
        # the cap, and one object over it (it goes alone); Mooncake's least segment is 16 MiB
        segment = max(self.max_bytes + 2 * object_bytes, MIN_SEGMENT)
        me = local_address_towards(self.address.rsplit(":", 1)[0])
        code = self.store.setup(me, "P2PHANDSHAKE", segment, local_buffer_for(object_bytes), "tcp", "", self.address)
        if code != 0:
            self.close()
            raise MooncakeError(f"cannot join the Mooncake store at master {self.address} (setup: code {code})")
        self._segment = self.store.get_hostname()
        return self

    def close(self) -> None:
        self.closing = True
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.master is not None:
            self.master.stop()

    def publish(self, parts: list, nbytes: int, consumer: dict | None) -> dict:
        from mooncake.store import ReplicateConfig  # noqa: PLC0415 - an optional dependency

        with self._cond:
            name = f"{self._prefix}online_{self._next}"
            self._next += 1
        digest = new_digest(self.checksum)
        for part in parts:
            digest.update(part)
        data = b"".join(parts)
        config = ReplicateConfig()
        config.replica_num = 1
        config.with_hard_pin = True  # never evicted: a full store refuses (FULL), it does not drop objects
        config.preferred_segment = self._segment
        code = self.store.put(name, data, config)
        while code == FULL:  # another service's objects, or a consumer slow to remove: wait, never drop
            if self.store is None or self.closing:
                self._unreserve(nbytes)
                raise RuntimeError("the service is stopping")
            time.sleep(0.05)
            code = self.store.put(name, data, config)
        if code != 0:
            self._unreserve(nbytes)
            raise MooncakeError(f"cannot put {name} into the Mooncake store (master {self.address}): code {code}")
        self._record(name, len(data), consumer)
        return {"backend": self.kind, "key": name, "master": self.address, "bytes": len(data),
                self.checksum: digest.hexdigest()}  # fmt: skip

    def _taken(self, names: list[str]) -> set[str]:
        codes = self.store.batch_is_exist(names)
        return {n for n, code in zip(names, codes) if code == 0}

    def _delete(self, name: str) -> None:
        self.store.remove(name, True)
