"""A client of the service's HTTP front (:mod:`speculators_v016.serve.http_api`): the standard library's
``urllib``, a connection per request (safe in forked DataLoader workers).

A request that fails for a reason that may pass (the producer unreachable, a
timeout, 503, a published file reclaimed before it was read) is tried again,
``retries`` times with a growing pause; then :class:`ProducerError` names the
sample and the producer. A request the service calls wrong (400) or refuses
(401: the API key) is not retried.

The tries of one sample's call carry one ``request_id``: the service answers a
retry with what the first try published, never a second file. A call that
fails after all its tries tells the service to release what its tries may still
publish (``POST /v1/release``), so nothing it asked for is left unread.
``api_key`` (default: ``$SPECULATORS_DATA_GEN_SERVE_API_KEY``) goes with every
request as ``Authorization: Bearer <key>``, as the service's ``--api-key`` wants.

The key goes to the producer and nowhere else: requests go straight to the producer's address,
never through a proxy (``http_proxy``, ``https_proxy`` and ``no_proxy`` are not read: the service
speaks plain HTTP, and a proxy would see every request, the key included), and a redirect is never
followed (:class:`ProducerError` naming where it pointed, not retried): give the producer's own
address.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
import uuid

from speculators_v016.serve.auth import API_KEY_VARIABLE
from speculators_v016.serve.publications import this_consumer

__all__ = ["API_KEY_VARIABLE", "ProducerClient", "ProducerError"]
RELEASE_TIMEOUT = 10.0  # seconds the release after a failed call may take (best effort)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are not followed (the key would go with them): the 3xx answer is raised as an HTTPError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


#: Straight to the producer: no proxy (an empty ProxyHandler replaces the one reading the environment), no redirect.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


class ProducerError(RuntimeError):
    """The producer could not give a sample (or its info): the message names both, and why."""


class ProducerClient:
    def __init__(
        self, url: str, timeout: float = 600.0, retries: int = 3, pause: float = 1.0, api_key: str | None = None
    ):
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.pause = timeout, retries, pause
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_VARIABLE) or None

    def _open(self, path: str, data: bytes | None, timeout: float) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.url + path, data=data, headers=headers, method="GET" if data is None else "POST"
        )
        with _OPENER.open(request, timeout=timeout) as response:
            return json.loads(response.read())

    def _call(self, what: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.pause * attempt)
            try:
                return self._open(path, data, self.timeout)
            except urllib.error.HTTPError as exc:
                if 300 <= exc.code < 400:
                    where = (exc.headers.get("Location") or "nowhere")[:200] if exc.headers is not None else "nowhere"
                    raise ProducerError(
                        f"{what}: the producer {self.url} answered HTTP {exc.code}, a redirect to {where}: not "
                        "followed (the API key would go with it); give the producer's own address"
                    ) from None
                message = _error_of(exc)
                if exc.code in (400, 401):
                    raise ProducerError(f"{what}: the producer {self.url} refused the request: {message}") from None
                last = f"HTTP {exc.code}: {message}"
            except (urllib.error.URLError, OSError, ValueError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}"
        raise ProducerError(f"{what}: the producer {self.url} did not answer after {self.retries + 1} tries ({last})")

    def info(self) -> dict:
        return self._call("info", "/v1/info")

    def request(self, what: str, index: int | None = None, input_ids=None, loss_mask=None) -> dict:
        """Ask for one sample (by the service's dataset index, or by token ids); return its handle."""
        body: dict = {"consumer": this_consumer(), "request_id": uuid.uuid4().hex}
        if index is not None:
            body["index"] = index
        else:
            body["input_ids"], body["loss_mask"] = list(input_ids), None if loss_mask is None else list(loss_mask)
        try:
            return self._call(what, "/v1/samples", body)["handle"]
        except ProducerError:
            self.release(body["request_id"])
            raise

    def release(self, request_id: str) -> bool:
        """Tell the service to delete what request ``request_id`` published (or will), unless taken; one try,
        best effort: False where the service did not answer (its lease reclaims it then)."""
        data = json.dumps({"request_id": request_id}).encode()
        try:
            return bool(self._open("/v1/release", data, min(self.timeout, RELEASE_TIMEOUT)).get("released"))
        except (urllib.error.URLError, OSError, ValueError):
            return False


def _error_of(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read()).get("error", "")
    except (ValueError, OSError, AttributeError):
        return exc.reason
