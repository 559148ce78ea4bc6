"""How vLLM's worker processes start: spawned wherever they use a GPU, vLLM's own choice on CPU.

vLLM 0.16 forks its multiprocess workers unless CUDA *is initialised* in the driving process
(``torch.cuda.is_initialized()``), and a forked child can use CUDA only if the parent's state allows
it: torch refuses it ("Cannot re-initialize CUDA in forked subprocess") once the parent poisoned
fork, which ``is_initialized()`` does not always show. Every tensor-parallel run of the GPU issue
(36) died so in each worker's ``init_device``; its trace blamed ``torch.cuda.is_available()`` run
while ``torch._inductor`` was imported. On the H200 of 2026-12-02 (torch 2.11) a driving process
that had called ``is_available()`` forked working workers, so which call poisons depends on the
build: the hazard is real, its trigger is not ours to know. What the driving process imports
before the workers start (torch._inductor, transformers, a user's program around the library) is
not ours to control either.

So the rule is structural: the workers of an engine on a GPU platform are spawned, as vLLM does
itself once CUDA is initialised, and as its documentation recommends with CUDA. A spawned worker
re-imports the driving program's main module, which therefore needs its ``if __name__ ==
"__main__":`` guard (the CLI's module has it). On CPU, vLLM's platform hook already chooses spawn
for its workers: its choice stands there, as it always did.
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
