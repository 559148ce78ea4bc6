"""Connections a stranger can open, bounded: how many, for how long, how many bytes of head, and who goes first.

* :class:`BoundedHTTPServer`: the standard library's threaded HTTP server holding at most
  ``max_connections`` connections, a handler thread each. A connection is *served* from the moment
  its request is known to be a client's (its key checked, with ``--api-key``; read whole, without)
  until its answer is written; otherwise it *waits* (for its request's line and headers, idle
  between two requests, or, without a key, for its body). When every place is taken, a newcomer
  takes the place of a waiting one, which is cut (closed, unanswered): first the one waiting longest
  that never carried the key (without ``--api-key``: that never had a request served), then the one
  idle longest of a client that did. Only where every connection is being served is the newcomer answered
  503, at once and from the accepting thread (no thread is spawned for it), and ``/health`` says so
  for :data:`SATURATION_SECONDS` after (:meth:`BoundedHTTPServer.saturation`). The listen backlog is
  :data:`BACKLOG` (a burst of clients waits there to be accepted, not reset).
* :class:`DeadlineReader`: a connection's reads end at a deadline: a request's line and headers must
  arrive within ``header_timeout`` of the connection's opening or its previous answer (an idle
  connection is cut then), the body within ``read_timeout`` of that moment in all, not per byte.
* :class:`HeadReader`: a request's line and headers are read to at most :data:`MAX_HEAD_BYTES` in all;
  a longer head is refused (431 naming the limit) before more of it is kept.

Why not uvicorn (installed with vLLM, which serves its API with it): uvicorn 0.55's h11 protocol
bounds a head's bytes (``h11_max_incomplete_event_size``; vLLM's launcher raises it to 4 MiB, and the
default ``auto`` protocol is httptools, which has no such bound), but arms no timer before a request
(its keep-alive timer starts only after a response, and any byte received cancels it), so a client
sending nothing, or a byte at a time, holds its connection without end; the body has no deadline
either; and ``limit_concurrency`` answers 503 to newcomers while idle connections hold every place,
the very failure cut here. Each bound would be code of ours on uvicorn's internals.
"""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer

from loguru import logger

BACKLOG = 1024  # the listen backlog (the kernel caps it at net.core.somaxconn)
MAX_HEAD_BYTES = 32 << 10  # a request's line and headers, in all
CUT_WAIT = 2.0  # seconds the accepting thread waits for a cut connection's thread to end
SATURATION_SECONDS = 10.0  # /health reports newcomers refused (every connection served) for this long


class HeadTooLarge(Exception):
    """A request's line and headers exceed :data:`MAX_HEAD_BYTES` (the message says so)."""


class DeadlineReader(io.RawIOBase):
    """A socket's reads that end at :attr:`deadline` (``time.monotonic()``): TimeoutError after it."""

    def __init__(self, sock: socket.socket):
        super().__init__()
        self.sock = sock
        self.deadline = float("inf")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the client did not send its request within the read timeout")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class HeadReader(io.BufferedReader):
    """A buffered reader whose lines, while :attr:`head_left` is set, take at most that many bytes in all
    (:class:`HeadTooLarge` beyond): what the request line and the headers are read with."""

    head_left: int | None = None

    def readline(self, size: int | None = -1) -> bytes:
        if self.head_left is None:
            return super().readline(size)
        limit = self.head_left + 1 if size is None or size < 0 else min(size, self.head_left + 1)
        line = super().readline(limit)
        self.head_left -= len(line)
        if self.head_left < 0:
            raise HeadTooLarge(f"a request's line and headers take at most {MAX_HEAD_BYTES:,} bytes in all")
        return line


@dataclass(eq=False)
class Connection:
    """One accepted connection, as the server weighs it when it needs a place."""

    sock: socket.socket
    waiting_since: float = field(default_factory=time.monotonic)  # when it began waiting for its current request
    served: bool = False  # its request read whole, being answered: never cut
    keyed: bool = False  # a request on it carried the key (without a key: a request was served on it)
    cut: bool = False


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server of at most ``max_connections`` connections; a newcomer takes a waiting one's place
    (the longest waiting without the key first), or is answered 503 where every one is being served."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(self, address, handler, max_connections: int):
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, Connection] = {}
        self.cut = 0  # connections cut to make room
        self.refused = 0  # newcomers answered 503: every connection was being served
        self._refused_at = float("-inf")  # when the last one was
        super().__init__(address, handler)

    # -- places ----------------------------------------------------------------------------------
    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            if self._cut_one() is None or not self._slots.acquire(timeout=CUT_WAIT):
                self._refuse(request)
                return
        with self._lock:
            self._connections[request] = Connection(request)
        try:
            super().process_request(request, client_address)  # a thread that releases its place at the end
        except BaseException:
            with self._lock:
                self._connections.pop(request, None)
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def shutdown_request(self, request) -> None:
        with self._lock:  # forgotten before it is closed: a cut never reaches a closed (or reused) socket
            self._connections.pop(request, None)
        super().shutdown_request(request)

    def _cut_one(self) -> Connection | None:
        """Cut the waiting connection that goes first (never keyed, then the longest waiting); None: every
        connection is being served."""
        with self._lock:
            waiting = [c for c in self._connections.values() if not c.served and not c.cut]
            if not waiting:
                return None
            victim = min(waiting, key=lambda c: (c.keyed, c.waiting_since))
            victim.cut = True
            self.cut += 1
            try:
                victim.sock.shutdown(socket.SHUT_RDWR)  # its thread's read ends now; the thread closes it
            except OSError:
                pass
        return victim

    # -- what a connection's handler says of it --------------------------------------------------------
    def connection(self, sock: socket.socket) -> Connection:
        with self._lock:
            return self._connections.get(sock) or Connection(sock, cut=True)

    def waiting(self, connection: Connection) -> bool:
        """``connection`` waits for its next request (cuttable again); False: it was cut."""
        with self._lock:
            connection.served, connection.waiting_since = False, time.monotonic()
            return not connection.cut

    def serving(self, connection: Connection) -> bool:
        """``connection``'s request was read whole: it is served, never cut now; False: it was cut first."""
        with self._lock:
            if connection.cut:
                return False
            connection.served = True
            return True

    def keyed(self, connection: Connection) -> None:
        with self._lock:
            connection.keyed = True

    # -- refusing --------------------------------------------------------------------------------
    def saturation(self) -> tuple[dict, str | None]:
        """The connections' counters, and why the front is saturated (a newcomer was refused within the last
        :data:`SATURATION_SECONDS`: every connection was being served), None when it is not."""
        with self._lock:
            served = sum(c.served for c in self._connections.values())
            counters = {"open": len(self._connections), "served": served, "max": self.max_connections,
                        "cut": self.cut, "refused": self.refused}  # fmt: skip
            since = time.monotonic() - self._refused_at
        if since >= SATURATION_SECONDS:
            return counters, None
        return counters, (
            f"a connection was refused {since:.0f} s ago: every one of --max-connections {self.max_connections} "
            f"was being served ({self.refused} refused so far)"
        )

    def _refuse(self, sock: socket.socket) -> None:
        """503 and close, from the accepting thread: never blocks (a full send buffer drops the answer)."""
        with self._lock:
            self.refused += 1
            self._refused_at = time.monotonic()
        body = json.dumps(
            {
                "error": f"every one of this service's --max-connections {self.max_connections} connections is "
                "being served: try again shortly"
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            sock.setblocking(False)
            try:
                sock.recv(65536)  # what it sent already: read, so that closing does not reset the answer away
            except OSError:
                pass
            sock.send(head + body)
        except OSError:
            pass
        finally:
            self.shutdown_request(sock)

    def handle_error(self, request, client_address) -> None:
        """One log line, no traceback on the terminal: a client's connection failing is the client's."""
        exc = sys.exception()
        logger.debug("http {}: {}: {}", client_address[0], type(exc).__name__, exc)
