"""How vLLM's worker processes start: spawned wherever they use a GPU, forked on CPU.

vLLM 0.16 forks its multiprocess workers unless CUDA *is initialised* in the driving process
(``torch.cuda.is_initialized()``). But torch refuses CUDA in every forked child as soon as the parent
has merely *counted* devices: ``torch.cuda.is_available()`` and ``device_count()`` poison fork and
leave ``is_initialized()`` False. Importing ``torch._inductor`` asks ``is_available()``, so does our
own default tensor-parallel size (``visible_gpus``), and so may any library the driving process
imports. vLLM then forks, and every worker dies in ``init_device`` ("Cannot re-initialize CUDA in
forked subprocess"): every tensor-parallel run on GPUs did, before this module.

Keeping the driving process from ever counting GPUs before the workers exist cannot be promised
(an import anywhere breaks it, silently, until the next TP run), so the rule is structural: the
workers of an engine on a GPU platform are spawned, as vLLM does itself once CUDA is initialised.
A spawned worker re-imports the driving program's main module, which therefore needs its
``if __name__ == "__main__":`` guard (the CLI's module has it). On CPU, vLLM's platform hook
already chooses spawn for its workers: its choice stands there, as it always did.
"""

from __future__ import annotations

import os

from loguru import logger

#: vLLM's variable for its workers' start method (``fork`` by default).
VARIABLE = "VLLM_WORKER_MULTIPROC_METHOD"


def start_method(device_type: str, executor_kind: str) -> str | None:
    """The start method the workers of an engine must use, or None where vLLM's own choice stands."""
    if executor_kind != "mp" or device_type == "cpu":
        return None
    return "spawn"


def set_start_method(device_type: str, executor_kind: str) -> str | None:
    """Make vLLM start this engine's workers as :func:`start_method` says (before its executor exists).

    vLLM caches its environment once an engine core is up (``enable_envs_cache``); a later engine in
    this process would still read the cached method, so the cache is reset when the method changes."""
    method = start_method(device_type, executor_kind)
    given = os.environ.get(VARIABLE)
    if method is None or given == method:
        return method
    if given:
        logger.warning(
            "{}={} replaced by {}: torch refuses CUDA in forked workers once the driving process counted GPUs",
            VARIABLE,
            given,
            method,
        )
    os.environ[VARIABLE] = method
    from vllm import envs  # noqa: PLC0415 - vLLM only when an engine starts

    envs.disable_envs_cache()
    return method
