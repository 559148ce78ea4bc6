"""The service's API key, as vLLM's server has it: ``Authorization: Bearer <key>`` on every request.

The key comes from ``--api-key`` (its variable ``SPECULATORS_DATA_GEN_SERVE_API_KEY``, which the
consumer's :class:`~speculators_v016.online.client.ProducerClient` reads too) or ``--api-key-file``
(a file's first line: the key stays out of the process list). A request's key is compared in
constant time (:func:`hmac.compare_digest`). Without a key, anyone who reaches the port may ask;
binding beyond loopback so is warned of at start.
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path

#: The variable that carries the key to the service (``--api-key``'s own) and to its clients.
API_KEY_VARIABLE = "SPECULATORS_DATA_GEN_SERVE_API_KEY"


class ApiKeyError(ValueError):
    """The key cannot be had as given (an empty key, a key file that cannot be read); the message says which."""


def api_key_of(api_key: str | None, api_key_file: Path | None) -> str | None:
    """The service's key: ``--api-key``, or the first line of ``--api-key-file``; None: no key (open)."""
    if api_key is not None and api_key_file is not None:
        raise ApiKeyError("give --api-key or --api-key-file, not both")
    if api_key_file is not None:
        try:
            lines = Path(api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeyError(f"--api-key-file {api_key_file}: cannot read it ({exc})") from None
        api_key = lines[0].strip() if lines else ""
        if not api_key:
            raise ApiKeyError(f"--api-key-file {api_key_file}: its first line is empty")
    if api_key is not None and not api_key.strip():
        raise ApiKeyError("--api-key is empty")
    return api_key


def authorized(header: str | None, api_key: str) -> bool:
    """Does an ``Authorization`` header carry ``Bearer <api_key>``? (constant-time comparison)"""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to warn of where the service listens beyond loopback without a key; None otherwise."""
    if api_key is not None or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # a host name: beyond loopback as far as we know
    return (
        f"listening on {host} without --api-key: anyone who reaches this port can ask for samples and read "
        "the service's info; give --api-key (or --api-key-file) and the same key to the clients"
    )
