"""A ``--seq-length`` the model's context cannot hold, named with the option to change.

A sample of ``L`` tokens runs as a prompt of ``L`` tokens plus the one token
vLLM samples after it, so the engine asks vLLM for ``max_model_len = L + 1``.
``--seq-length`` equal to the model's context (the usual choice: 8192 on a
Llama-3) then exceeds what vLLM derives from the checkpoint, and vLLM 0.16
refuses the config with a pydantic ``ValidationError`` about
``max_model_len``. That is turned into :class:`ContextLengthError`, which says
which value fits. The sampled token's room is not taken from the prompt: the
samples would silently be one token shorter than asked.
"""

from __future__ import annotations

import re

from speculators_v016.target import ContextLengthError

_VLLM_TOO_LONG = re.compile(
    r"max_model_len \((?P<asked>\d+)\) is greater than the derived max_model_len \((?P<why>[^)]*)\)"
)


def context_length_error(exc: BaseException) -> ContextLengthError | None:
    """Our error for vLLM's refusal of a ``max_model_len`` longer than the model's context, else None."""
    found = _VLLM_TOO_LONG.search(str(exc))
    if found is None:
        return None
    asked = int(found["asked"])
    numbers = [float(v) for v in re.findall(r"=\s*([0-9.]+)", found["why"])]
    allowed = int(min(numbers)) if numbers else None
    fits = (f"--seq-length {allowed - 1} or less (generator API: max_model_len {allowed} or less)" if allowed
            else "a smaller --seq-length (generator API: a smaller max_model_len)")  # fmt: skip
    return ContextLengthError(
        f"--seq-length {asked - 1} does not fit the model's context: a sample of {asked - 1} tokens runs as "
        f"a prompt of that length plus the one token vLLM samples after it (max_model_len {asked}), and vLLM "
        f"derives a maximum of {allowed if allowed else 'less'} from the checkpoint ({found['why']}). "
        f"Give {fits}; longer rows are truncated and counted"
    )
