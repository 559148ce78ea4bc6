"""A client of the service's HTTP front (:mod:`speculators_v016.serve.http_api`): the standard library's
``urllib``, a connection per request (safe in forked DataLoader workers).

A request that fails for a reason that may pass (the producer unreachable, a
timeout, 503, a published file reclaimed before it was read) is tried again,
``retries`` times with a growing pause; then :class:`ProducerError` names the
sample and the producer. A request the service calls wrong (400) is not retried.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from speculators_v016.serve.publications import this_consumer


class ProducerError(RuntimeError):
    """The producer could not give a sample (or its info): the message names both, and why."""


class ProducerClient:
    def __init__(self, url: str, timeout: float = 600.0, retries: int = 3, pause: float = 1.0):
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.pause = timeout, retries, pause

    def _call(self, what: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.pause * attempt)
            request = urllib.request.Request(
                self.url + path,
                data=data,
                headers={"Content-Type": "application/json"},
                method="GET" if data is None else "POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                message = _error_of(exc)
                if exc.code == 400:
                    raise ProducerError(f"{what}: the producer {self.url} refused the request: {message}") from None
                last = f"HTTP {exc.code}: {message}"
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}"
        raise ProducerError(f"{what}: the producer {self.url} did not answer after {self.retries + 1} tries ({last})")

    def info(self) -> dict:
        return self._call("info", "/v1/info")

    def request(self, what: str, index: int | None = None, input_ids=None, loss_mask=None) -> dict:
        """Ask for one sample (by the service's dataset index, or by token ids); return its handle."""
        body: dict = {"consumer": this_consumer()}
        if index is not None:
            body["index"] = index
        else:
            body["input_ids"], body["loss_mask"] = list(input_ids), None if loss_mask is None else list(loss_mask)
        return self._call(what, "/v1/samples", body)["handle"]


def _error_of(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read()).get("error", "")
    except (ValueError, OSError, AttributeError):
        return exc.reason
