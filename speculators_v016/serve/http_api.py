"""The service's HTTP front: JSON over the standard library's threaded HTTP server.

* ``GET /v1/info``: the model, layer ids, dtype, hidden size, the backend and its
  folder, the dataset's sample count and token lengths (where the service has a
  dataset), counters.
* ``GET /health``: 200 while the engine serves, 503 naming the failure otherwise.
* ``POST /v1/samples``: ``{"index": i}`` (sample i of the service's dataset) or
  ``{"input_ids": [...], "loss_mask": [...]}``, with ``"consumer": {"host",
  "pid", "start"}`` so that what a dead consumer left can be reclaimed. The
  answer comes once the sample is published: ``{"handle": {"backend",
  "file", "bytes", "blake3", "num_tokens"}}``. 400: the request is wrong (the
  message says how); 503: the service stopped or its engine failed (named).

A request waits while the service is at its bounds (backpressure): clients
set their own timeouts. Upstream 0.9.0's client is answered too (``GET /v1/models``,
``POST /v1/completions``: :mod:`speculators_v016.serve.peer_api`).
"""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from loguru import logger

from speculators_v016.serve import peer_api
from speculators_v016.serve.service import CaptureService, RequestError, ServiceStopped

MAX_BODY = 64 << 20  # bytes of a request body at most (a 16M-token sample as JSON fits)


class _Handler(BaseHTTPRequestHandler):
    service: CaptureService
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        logger.debug("http {}: " + format, self.client_address[0], *args)

    def _answer(self, status: HTTPStatus, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._answer(status, {"error": message})

    def do_GET(self) -> None:  # noqa: N802 - the base class's name
        if self.path == "/v1/info":
            self._answer(HTTPStatus.OK, self.service.info())
        elif self.path == "/v1/models":
            self._answer(HTTPStatus.OK, peer_api.models(self.service))
        elif self.path == "/health":
            if self.service.failure is None and not self.service.stopping:
                self._answer(HTTPStatus.OK, {"ok": True})
            else:
                self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(self.service.down()))
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no such path {self.path!r}: GET /v1/info, /health; POST /v1/samples")

    def do_POST(self) -> None:  # noqa: N802 - the base class's name
        if self.path not in ("/v1/samples", "/v1/completions"):
            self._error(HTTPStatus.NOT_FOUND, f"no such path {self.path!r}: POST /v1/samples, /v1/completions")
            return
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            self._error(HTTPStatus.BAD_REQUEST, f"a request body of 1 to {MAX_BODY} bytes is needed, got {length}")
            return
        try:
            body = json.loads(self.rfile.read(length))
            if not isinstance(body, dict):
                raise RequestError("the request must be a JSON object")
            if self.path == "/v1/completions":
                self._answer(HTTPStatus.OK, peer_api.completion(self.service, body))
                return
            if "index" in body:
                ids, mask = self.service.sample_of(body["index"])
            else:
                ids, mask = body.get("input_ids"), body.get("loss_mask")
            consumer = body.get("consumer") if isinstance(body.get("consumer"), dict) else None
            handle = self.service.submit(ids, mask, consumer).result()
        except (RequestError, ValueError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except ServiceStopped as exc:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
        except Exception as exc:  # noqa: BLE001 - the client is told; the service goes on or is already down
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
        else:
            self._answer(HTTPStatus.OK, {"handle": handle})


class HttpFront:
    """The HTTP server of a :class:`CaptureService`, serving on its own threads."""

    def __init__(self, service: CaptureService, host: str, port: int):
        handler = type("Handler", (_Handler,), {"service": service})
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.host, self.port = self.server.server_address[:2]
        self._thread = threading.Thread(target=self.server.serve_forever, name="serve-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> HttpFront:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
