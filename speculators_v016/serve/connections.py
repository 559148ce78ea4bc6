"""Connections a stranger can open, bounded: a thread per connection up to a cap, a deadline on reading.

* :class:`BoundedHTTPServer`: the standard library's threaded HTTP server with at most
  ``max_connections`` handler threads. A connection beyond them is answered 503 at once, from the
  accepting thread, and closed: no thread is ever spawned for it. The listen backlog is
  ``BACKLOG`` (a burst of clients waits there to be accepted, not reset).
* :class:`DeadlineReader`: a connection's reads, each request's request line, headers and body
  within ``read_timeout`` seconds in all (a client sending a byte at a time is cut at the
  deadline, not at each byte's own timeout). Writes are bounded by the same timeout.
"""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from loguru import logger

BACKLOG = 1024  # the listen backlog (the kernel caps it at net.core.somaxconn)


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


class BoundedHTTPServer(ThreadingHTTPServer):
    """A threaded HTTP server with at most ``max_connections`` handler threads; more connections get 503."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(self, address, handler, max_connections: int):
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # a thread that releases its slot at the end
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, sock: socket.socket) -> None:
        """503 and close, from the accepting thread: never blocks (a full send buffer drops the answer)."""
        body = json.dumps(
            {"error": f"the service has its --max-connections {self.max_connections} open: try again shortly"}
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
