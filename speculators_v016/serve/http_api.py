"""The service's HTTP front: JSON over the standard library's threaded HTTP server.

* ``GET /v1/info``: the model, layer ids, dtype, hidden size, the backend and its
  folder, the dataset's sample count and token lengths (where the service has a
  dataset), counters.
* ``GET /health``: 200 while the engine serves, 503 naming why otherwise: the engine failed, the
  service is stopping, publishing has waited at ``--max-published-bytes`` for
  ``publications.BLOCKED_SECONDS`` with nothing taken (consumers that ask and do not read), or a
  connection was refused within ``connections.SATURATION_SECONDS`` (every one was being served);
  its body counts the connections (open, served, the most, cut, refused).
* ``POST /v1/samples``: ``{"index": i}`` (sample i of the service's dataset) or
  ``{"input_ids": [...], "loss_mask": [...]}``, with ``"consumer": {"host",
  "pid", "start"}`` so that what a dead consumer left can be reclaimed. The
  answer comes once the sample is published: ``{"handle": {"backend",
  "file", "bytes", "blake3", "num_tokens"}}``. 400: the request is wrong (the
  message says how); 503: the service stopped or its engine failed (named).
  ``"request_id"`` (at most 64 of ``[A-Za-z0-9._-]``): the tries of one call
  carry one id, and a try whose id the service already has is answered with
  that request's handle, never a second publication.
* ``POST /v1/release``: ``{"request_id": id}``: what that request published (or
  will) is deleted unless taken: a client that gave up on it says so.

A request waits while the service is at its bounds (backpressure): clients
set their own timeouts. What a stranger can make the front hold is bounded
(:mod:`~speculators_v016.serve.connections`): ``--max-connections`` handler
threads (a newcomer takes a waiting connection's place, keyless ones first; 503
only where every one is being served, which ``/health`` reports), a head of
32 KiB (431) within ``--header-timeout``, ``--read-timeout`` for a request's
line, headers and body, a body of :func:`max_body_bytes` (413 above it:
``seq_length`` token ids and a mask as JSON fit), the fields a request may have
and their lengths (400 naming them). With ``--api-key`` every path but ``/health`` needs
``Authorization: Bearer <key>`` (401): :mod:`~speculators_v016.serve.auth`. Upstream 0.9.0's client is answered too (``GET /v1/models``,
``POST /v1/completions``: :mod:`speculators_v016.serve.peer_api`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

from loguru import logger

from speculators_v016.config import ServeConfig, default_of
from speculators_v016.serve import peer_api
from speculators_v016.serve.auth import authorized
from speculators_v016.serve.connections import (
    MAX_HEAD_BYTES,
    BoundedHTTPServer,
    DeadlineReader,
    HeadReader,
    HeadTooLarge,
)
from speculators_v016.serve.service import RequestError, ServiceStopped

SAMPLE_FIELDS = ("index", "input_ids", "loss_mask", "consumer", "request_id")
DISCARD_BYTES = 64 << 20  # a refused request's body read and dropped, at most (its client then gets the answer)
STOP_POLL = 0.05  # seconds: how often the serving loop looks for stop() (the standard library's 0.5 held every stop)
MAX_HOST = 255  # characters of consumer.host (a DNS name at most)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def max_body_bytes(seq_length: int) -> int:
    """The largest request body served: 64 KiB and 32 bytes a token (``seq_length`` token ids and a loss mask
    as JSON take at most 12 a token: an id of 7 digits and its separator, a mask digit and its)."""
    return (64 << 10) + 32 * seq_length


def consumer_of(value) -> dict | None:
    """The ``consumer`` field as the record keeps it, or RequestError naming what is wrong and the limit."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("consumer: an object {host, pid, start} is needed")
    if set(value) - {"host", "pid", "start"}:
        names = ", ".join(repr(k[:40]) for k in sorted(value)[:4])
        raise RequestError(f"consumer: keys host, pid and start only, got {names}")
    host, pid, start = value.get("host"), value.get("pid"), value.get("start")
    if not isinstance(host, str) or len(host) > MAX_HOST:
        raise RequestError(f"consumer.host: at most {MAX_HOST} characters of text")
    for name, number in (("pid", pid), ("start", start)):
        if number is not None and (isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < 2**63):
            raise RequestError(f"consumer.{name}: an integer in [0, 2**63)")
    return {"host": host, "pid": pid, "start": start}


def request_id_of(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _REQUEST_ID.match(value):
        raise RequestError("request_id: at most 64 characters of [A-Za-z0-9._-]")
    return value


class _Handler(BaseHTTPRequestHandler):
    service = None  # a CaptureService (set per front)
    api_key: str | None = None
    read_timeout: float = 30.0
    header_timeout: float = 10.0
    max_body: int = 0
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self._reader = DeadlineReader(self.connection)
        self.rfile = HeadReader(self._reader)
        self._place = self.server.connection(self.connection)
        self._body_deadline = float("inf")

    def handle_one_request(self) -> None:
        if not self.server.waiting(self._place):  # cut to make room for a newcomer
            self.close_connection = True
            return
        now = time.monotonic()
        self._reader.deadline = now + min(self.header_timeout, self.read_timeout)  # the line and headers
        self._body_deadline = now + self.read_timeout  # and the body: this long in all
        self.rfile.head_left = MAX_HEAD_BYTES
        self.requestline, self.request_version, self.command, self.headers = "", "HTTP/1.1", "", None
        try:
            super().handle_one_request()
        except HeadTooLarge as exc:
            self.rfile.head_left = None
            self.request_version = "HTTP/1.1"  # answered as HTTP/1.1 whatever part of its line was read
            self._error(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, str(exc), close=True)

    def parse_request(self) -> bool:
        """The standard library's parsing of the line and headers (read within the header bound); then the body's
        deadline applies."""
        parsed = super().parse_request()
        self.rfile.head_left = None
        self._reader.deadline = self._body_deadline
        return parsed

    def _serving(self) -> bool:
        """The request is a client's (its key checked, or read whole): the connection is served now, never cut;
        False where it was cut first."""
        if self.server.serving(self._place):
            return True
        self.close_connection = True
        return False

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        logger.debug("http {}: " + format, self.client_address[0], *args)

    def _answer(self, status: HTTPStatus, body: dict, close: bool = False, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.connection.settimeout(self.read_timeout)  # a client that does not read is not waited for longer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if close:  # its body was not read: the connection cannot carry another request
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)
        if close:
            self._discard_body()

    def _discard_body(self) -> None:
        """Read and drop the body of a refused request (up to ``DISCARD_BYTES``, within the read deadline), so that
        closing does not reset the connection before its client reads the answer; never kept. A head refused
        before its end: what already arrived is dropped, nothing more is waited for."""
        if self.headers is None:
            self._drop_arrived()
            return
        raw = (self.headers.get("Content-Length") or "").strip()
        left = int(raw) if raw.isascii() and raw.isdigit() else 0
        if left > DISCARD_BYTES:
            return
        try:
            while left > 0:
                chunk = self.rfile.read1(min(left, 1 << 16))
                if not chunk:
                    return
                left -= len(chunk)
        except (TimeoutError, OSError):
            return

    def _drop_arrived(self) -> None:
        """Read and drop what the client sent already (at most 1 MiB), waiting for nothing."""
        try:
            self.connection.setblocking(False)
            for _ in range(16):
                if not self.connection.recv(1 << 16):
                    return
        except OSError:
            return

    def _error(self, status: HTTPStatus, message: str, close: bool = False, headers: dict | None = None) -> None:
        self._answer(status, {"error": message}, close, headers)

    def _authorized(self) -> bool:
        if self.api_key is None:
            self.server.keyed(self._place)  # no key: a connection that served a request goes after new ones
            return True
        if authorized(self.headers.get("Authorization"), self.api_key):
            self.server.keyed(self._place)  # idle later, it goes after those of clients without the key
            return self._serving()  # a keyed request, its body still to come: never cut
        self._error(
            HTTPStatus.UNAUTHORIZED,
            "this service needs its API key: send the header Authorization: Bearer <key> (the service's --api-key)",
            close=True,
            headers={"WWW-Authenticate": "Bearer"},
        )
        return False

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        if not self._serving():
            return
        if self.path == "/health":
            connections, saturated = self.server.saturation()
            problem = self.service.health() or saturated
            if problem is None:
                self._answer(HTTPStatus.OK, {"ok": True, "connections": connections})
            else:
                self._answer(HTTPStatus.SERVICE_UNAVAILABLE, {"error": problem, "connections": connections})
        elif not self._authorized():
            return
        elif self.path == "/v1/info":
            self._answer(HTTPStatus.OK, self.service.info())
        elif self.path == "/v1/models":
            self._answer(HTTPStatus.OK, peer_api.models(self.service))
        else:
            self._error(HTTPStatus.NOT_FOUND, "no such path: GET /v1/info, /health; POST /v1/samples")

    def _body(self) -> dict | None:
        """The request's JSON object, or None once the client was answered why not."""
        if self.headers.get("Transfer-Encoding") is not None:
            self._error(HTTPStatus.BAD_REQUEST, "Transfer-Encoding is not served: send a Content-Length", close=True)
            return None
        lengths = self.headers.get_all("Content-Length") or []
        if len(lengths) != 1:
            self._error(HTTPStatus.LENGTH_REQUIRED, "one Content-Length header is needed", close=True)
            return None
        raw = lengths[0].strip()
        if not (raw.isascii() and raw.isdigit()):
            self._error(HTTPStatus.BAD_REQUEST, f"Content-Length header {raw[:40]!r} is not a byte count", close=True)
            return None
        length = int(raw)
        if length > self.max_body:
            self._error(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"a request body of at most {self.max_body:,} bytes is served (64 KiB and 32 a token of "
                f"--seq-length), got {length:,}",
                close=True,
            )
            return None
        data = self.rfile.read(length)
        if len(data) < length:
            self.close_connection = True  # the client went away mid-body
            return None
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, f"the body is not JSON: {str(exc)[:200]}")
            return None
        if not isinstance(body, dict):
            self._error(HTTPStatus.BAD_REQUEST, "the request must be a JSON object")
            return None
        return body

    def do_POST(self) -> None:  # noqa: N802 - the base class's name
        if self.path not in ("/v1/samples", "/v1/completions", "/v1/release"):
            message = "no such path: POST /v1/samples, /v1/release, /v1/completions"
            self._error(HTTPStatus.NOT_FOUND, message, close=True)
            return
        if not self._authorized():
            return
        body = self._body()
        if body is None or not self._serving():
            return
        try:
            if self.path == "/v1/completions":
                self._answer(HTTPStatus.OK, peer_api.completion(self.service, body))
            elif self.path == "/v1/release":
                self._answer(HTTPStatus.OK, {"released": self.service.release(request_id_of(body.get("request_id")))})
            else:
                self._answer(HTTPStatus.OK, {"handle": self._sample(body)})
        except (RequestError, ValueError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except ServiceStopped as exc:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
        except Exception as exc:  # noqa: BLE001 - the client is told; the service goes on or is already down
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    def _sample(self, body: dict) -> dict:
        unknown = sorted(set(body) - set(SAMPLE_FIELDS))
        if unknown:
            raise RequestError(f"unknown field {unknown[0][:40]!r}: a request has {', '.join(SAMPLE_FIELDS)}")
        consumer, request_id = consumer_of(body.get("consumer")), request_id_of(body.get("request_id"))
        if "index" in body:
            ids, mask = self.service.sample_of(body["index"])
        else:
            ids, mask = body.get("input_ids"), body.get("loss_mask")
        return self.service.submit(ids, mask, consumer, request_id=request_id).result()


class HttpFront:
    """The HTTP server of a :class:`CaptureService`, serving on its own threads (at most ``max_connections``)."""

    def __init__(
        self,
        service,
        host: str,
        port: int,
        *,
        api_key: str | None = None,
        read_timeout: float = default_of(ServeConfig, "read_timeout"),
        header_timeout: float = default_of(ServeConfig, "header_timeout"),
        max_connections: int = default_of(ServeConfig, "max_connections"),
        max_body: int | None = None,
    ):
        if max_body is None:
            max_body = max_body_bytes(default_of(ServeConfig, "seq_length"))
        limits = {"service": service, "api_key": api_key, "read_timeout": read_timeout,
                  "header_timeout": header_timeout, "max_body": max_body}  # fmt: skip
        handler = type("Handler", (_Handler,), limits)
        self.server = BoundedHTTPServer((host, port), handler, max_connections)
        self.host, self.port = self.server.server_address[:2]
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": STOP_POLL}, name="serve-http", daemon=True
        )

    @classmethod
    def for_config(cls, service, config: ServeConfig, api_key: str | None) -> HttpFront:
        """The front as ``config`` bounds it (``--read-timeout``, ``--header-timeout``, ``--max-connections``, the
        body by ``--seq-length``)."""
        return cls(service, config.host, config.port, api_key=api_key, read_timeout=config.read_timeout,
                   header_timeout=config.header_timeout, max_connections=config.max_connections,
                   max_body=max_body_bytes(config.seq_length))  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> HttpFront:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
