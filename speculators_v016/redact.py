"""Secrets kept out of everything a run writes or logs (``data_config.json``, headers, the terminal, the log).

vLLM's engine arguments may carry credentials: ``hf_token`` (the hub's access token), and, nested in a
connector's or loader's settings, keys and passwords. None of them changes what a sample holds, so none
is worth a byte on disk: a value under a secret-like name (:func:`is_secret_name`) is written as
:data:`REDACTED`, and a string anywhere that looks like a Hugging Face token (``hf_`` and 30 or more
letters and digits) too. The resume check leaves such names out of its comparison
(:func:`without_secrets`): a rotated token neither refuses a resume nor shows in its message.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"

#: A name that holds a secret: it ends in token, key, secret, password, ... (``hf_token``, ``api_key``,
#: ``aws_secret_access_key``); ``tokenizer``, ``max_num_batched_tokens`` or ``long_prefill_token_threshold`` not.
_SECRET_NAME = re.compile(
    r"(?:^|[_\-.])(?:token|key|secret|password|passwd|passphrase|credentials?|auth|authorization|bearer)$",
    re.IGNORECASE,
)
#: A Hugging Face access token written out anywhere (a value under another name, a message).
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")


def is_secret_name(name: Any) -> bool:
    """Does a field of this name hold a credential?"""
    return isinstance(name, str) and bool(_SECRET_NAME.search(name))


def redact_text(text: str) -> str:
    """``text`` with anything shaped like a Hugging Face token replaced."""
    return _HF_TOKEN.sub(REDACTED, text)


def redact(value: Any) -> Any:
    """A copy of ``value`` (JSON-like: dicts, lists, scalars) safe to write: the string under a secret-like
    name, and any token-shaped string, replaced by :data:`REDACTED`. ``None``, booleans (``hf_token: true``:
    use the login's token) and numbers under such names are kept: they hold no secret."""
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_name(k) and isinstance(v, str) and v else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def without_secrets(value: Any) -> Any:
    """A copy of ``value`` without the entries under secret-like names (what the resume check compares)."""
    if isinstance(value, dict):
        return {k: without_secrets(v) for k, v in value.items() if not is_secret_name(k)}
    if isinstance(value, (list, tuple)):
        return [without_secrets(v) for v in value]
    return value
