"""What a service published and no consumer took yet: the records, the cap, and reclaiming by record.

Every backend (:mod:`~speculators_v016.serve.folder`, :mod:`~speculators_v016.serve.mooncake`)
keeps one :class:`Published` record per object it put and did not see taken. The bytes of those
records (and of those being written) are capped: :meth:`Publications.reserve` waits below the
cap, which holds the publisher threads and so the engine (backpressure). A backend deletes an
object only while its record says it is its own and not taken, and only when its consumer is
dead (a process on this host, by pid and start time: a reused pid is not taken for it) or its
lease ran out (a consumer elsewhere that never took it).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Seconds a publisher waits at the cap, nothing taken meanwhile, before ``/health`` says publishing is blocked.
BLOCKED_SECONDS = 30.0


def process_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, /proc), None if it does not run."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def this_consumer() -> dict:
    """Who asks, as the service's record keeps it: host, pid and the process's start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}


@dataclass
class Published:
    name: str
    bytes: int
    consumer: dict | None
    at: float = field(default_factory=time.monotonic)


@dataclass
class ReclaimCounts:
    consumer_dead: int = 0
    lease_expired: int = 0
    dead_service: int = 0
    released: int = 0


class Publications:
    """Records, cap and reclaiming; a backend says what is taken and how an object is deleted."""

    def __init__(self, max_bytes: int, lease_seconds: float):
        self.max_bytes, self.lease_seconds = max_bytes, lease_seconds
        self.records: dict[str, Published] = {}
        self.reclaimed = ReclaimCounts()
        self.published = 0
        self._reserved = 0
        self._waiting: dict[object, float] = {}  # publishers waiting at the cap, since when
        self._cond = threading.Condition()
        self._host = socket.gethostname()

    # -- what a backend provides -------------------------------------------------------------------
    def _taken(self, names: list[str]) -> set[str]:
        """Those of ``names`` a consumer took (deleted, moved): no longer there."""
        raise NotImplementedError

    def _delete(self, name: str) -> None:
        """Delete object ``name`` (it may be gone already)."""
        raise NotImplementedError

    def check_lock(self) -> str:
        """Does this service still hold what keeps others out (the folder's lock)? ``"held"`` here."""
        return "held"

    # -- the cap -----------------------------------------------------------------------------------
    def reserve(self, nbytes: int, stopped: threading.Event) -> None:
        """Wait until ``nbytes`` more fit under the cap (an object larger than the cap goes alone)."""
        token = object()
        with self._cond:
            try:
                while self.outstanding() + nbytes > self.max_bytes and (self.records or self._reserved):
                    if stopped.is_set():
                        raise RuntimeError("the service is stopping")
                    self._waiting.setdefault(token, time.monotonic())
                    self._cond.wait(0.02)
            finally:
                self._waiting.pop(token, None)
            self._reserved += nbytes

    def waiting_seconds(self) -> float:
        """How long the longest-waiting publisher has waited at the cap (0: none waits)."""
        waiting = list(self._waiting.values())
        return time.monotonic() - min(waiting) if waiting else 0.0

    def blocked(self) -> str | None:
        """Why publishing is stuck, where a publisher has waited at the cap for ``BLOCKED_SECONDS`` (nothing
        taken meanwhile): the bytes and files not taken, and the consumer holding most of them. None otherwise."""
        with self._cond:
            waited = self.waiting_seconds()
            if waited < BLOCKED_SECONDS:
                return None
            held = self.outstanding()
            by: dict[tuple, int] = {}
            for record in self.records.values():
                consumer = record.consumer or {}
                key = (consumer.get("host"), consumer.get("pid"))
                by[key] = by.get(key, 0) + 1
        most = max(by.items(), key=lambda item: item[1], default=None)
        who = ""
        if most is not None:
            host, pid = most[0]
            who = f"; {most[1]} of them asked by " + (
                f"pid {pid} on {host}" if host else "a client that named no process"
            )
        return (
            f"publishing has waited {waited:.0f} s at --max-published-bytes {self.max_bytes:,}: {held:,} bytes in "
            f"{len(self.records)} published objects no consumer took{who} (reclaimed when their consumer dies, "
            f"their lease of {self.lease_seconds:g} s runs out, or it releases them)"
        )

    def release(self, name: str) -> bool:
        """Delete object ``name`` where the record says it is ours and not taken (its client gave up on it)."""
        with self._cond:
            self._refresh()
            if name not in self.records:
                return False
            self._delete(name)
            del self.records[name]
            self.reclaimed.released += 1
            self._cond.notify_all()
            return True

    def _unreserve(self, nbytes: int) -> None:
        with self._cond:
            self._reserved -= nbytes
            self._cond.notify_all()

    def _record(self, name: str, nbytes: int, consumer: dict | None) -> None:
        with self._cond:
            self._reserved -= nbytes
            self.records[name] = Published(name, nbytes, consumer)
            self.published += 1

    def _refresh(self) -> None:
        """Forget the records of objects their consumers took."""
        for name in self._taken(list(self.records)) if self.records else ():
            del self.records[name]

    def outstanding(self) -> int:
        """Bytes published and not yet taken, and those reserved for objects being written (under the lock)."""
        self._refresh()
        return sum(r.bytes for r in self.records.values()) + self._reserved

    def not_taken(self) -> int:
        """:meth:`outstanding`, from any thread."""
        with self._cond:
            return self.outstanding()

    # -- reclaiming --------------------------------------------------------------------------------
    def _consumer_dead(self, consumer: dict | None) -> bool:
        if not consumer or consumer.get("host") != self._host or not isinstance(consumer.get("pid"), int):
            return False  # elsewhere, or unknown: only its lease tells
        return process_start(consumer["pid"]) != consumer.get("start")

    def reap(self) -> list[tuple[str, str]]:
        """Delete what the records say is ours, not taken, and whose consumer is dead or lease ran out."""
        gone = []
        with self._cond:
            self._refresh()
            now = time.monotonic()
            for name, record in list(self.records.items()):
                if self._consumer_dead(record.consumer):
                    why = f"its consumer (pid {record.consumer['pid']} on {self._host}) is dead"
                    self.reclaimed.consumer_dead += 1
                elif now - record.at > self.lease_seconds:
                    why = f"not taken within the lease ({self.lease_seconds:g} s)"
                    self.reclaimed.lease_expired += 1
                else:
                    continue
                self._delete(name)
                del self.records[name]
                gone.append((name, why))
            if gone:
                self._cond.notify_all()
        return gone
