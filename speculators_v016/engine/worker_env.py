"""The variables vLLM's workers read: checked before the workers start, and the CPU cores bound where vLLM cannot.

vLLM reads two of its variables only inside the workers it starts, so a bad value fails after the
engine's start-up, with a stack trace (exit 5, "WorkerProc initialization failed"):

* ``VLLM_PP_LAYER_PARTITION`` (the layers per pipeline stage, e.g. ``3,5``): vLLM checks it as each
  stage builds its layers. :func:`check` checks it first: one whole number >= 1 per stage, summing to
  the target's layer count; a usage error (exit 2) naming the variable and what is wrong.
* ``VLLM_CPU_OMP_THREADS_BIND`` (the cores of each CPU worker, ``0-15|16-31``): unset, vLLM binds each
  worker to a NUMA node of its own (also when it is ``auto``) and asserts that there are as many nodes as workers, so a CPU run
  with several workers (``--tensor-parallel-size 2``, ``--pipeline-parallel-size 2``) dies on a
  machine of one node, every laptop and most VMs. Where vLLM's binding would assert, :func:`cpu_binding`
  names it from the cores this process may use (``os.sched_getaffinity``): each worker a contiguous
  share of them, or, with fewer cores than workers, one core each in turn. The variable is set only
  while the workers start (they inherit it), and the log says which binding was chosen. Set, it is
  the user's: :func:`check` only refuses one with fewer entries than workers (vLLM's IndexError).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from loguru import logger

from speculators_v016.config import ConfigError

PARTITION = "VLLM_PP_LAYER_PARTITION"
BIND = "VLLM_CPU_OMP_THREADS_BIND"
#: vLLM's own values of BIND: its automatic binding, and none
_VLLM_VALUES = ("auto", "nobind")


def check(
    environ: Mapping[str, str], *, cpu: bool, workers: int, stages: int, num_layers: Callable[[], int] | int
) -> None:
    """ConfigError naming the variable where ``VLLM_PP_LAYER_PARTITION`` does not split ``num_layers`` (a
    number, or a function giving it: read only when the variable is set) into ``stages`` stages, or where a
    CPU engine's ``VLLM_CPU_OMP_THREADS_BIND`` names fewer cores than it has ``workers``."""
    partition = environ.get(PARTITION)
    if partition is not None:
        layers = num_layers() if callable(num_layers) else num_layers
        problem = partition_problem(partition, stages, layers)
        if problem:
            raise ConfigError(
                f"environment variable {PARTITION}={partition!r}: {problem} (vLLM's layers per pipeline stage, "
                f"e.g. {_example(stages, layers)}; or unset it for vLLM's even split)"
            )
    binding = environ.get(BIND)
    if cpu and workers > 1 and binding and binding not in _VLLM_VALUES:
        entries = binding.split("|")
        if len(entries) < workers or any(not e.strip() for e in entries[:workers]):
            raise ConfigError(
                f"environment variable {BIND}={binding!r} names the cores of {len(entries)} workers "
                f"(entries split by '|', none empty); this engine has {workers} (TP x PP): give one entry per "
                "worker, e.g. '0-15|16-31', or unset it to have the cores this process may use split among them"
            )


def partition_problem(value: str, stages: int, num_layers: int) -> str | None:
    """What is wrong with ``VLLM_PP_LAYER_PARTITION=value`` for ``stages`` stages of ``num_layers`` layers."""
    parts = [p.strip() for p in value.split(",")]
    bad = [p for p in parts if not p.isdigit() or int(p) < 1]
    if bad:
        return f"{', '.join(repr(p) for p in bad)} not a whole number >= 1 (each stage holds at least one layer)"
    counts = [int(p) for p in parts]
    if len(counts) != stages:
        return f"{len(counts)} entries, --pipeline-parallel-size is {stages}: one entry per stage"
    if sum(counts) != num_layers:
        return f"the entries sum to {sum(counts)}, the target has {num_layers} layers"
    return None


def _example(stages: int, num_layers: int) -> str:
    if stages < 1 or num_layers < stages:
        return "'3,5' for 8 layers in 2 stages"
    share, extra = divmod(num_layers, stages)
    return repr(",".join(str(share + (i < extra)) for i in range(stages)))


def cpu_binding(cores: set[int] | frozenset[int], workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` CPU workers on ``cores``: contiguous shares (the first
    ``len(cores) % workers`` workers one core more), or with fewer cores than workers, one core each in turn."""
    ordered = sorted(cores)
    if not ordered or workers < 1:
        raise ValueError(f"no binding of {workers} workers to cores {ordered}")
    if len(ordered) < workers:
        return "|".join(str(ordered[i % len(ordered)]) for i in range(workers))
    share, extra = divmod(len(ordered), workers)
    groups, start = [], 0
    for i in range(workers):
        size = share + (i < extra)
        groups.append(_ranges(ordered[start : start + size]))
        start += size
    return "|".join(groups)


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    out, first = [], None
    for i, core in enumerate(ids):
        if first is None:
            first = core
        if i + 1 == len(ids) or ids[i + 1] != core + 1:
            out.append(str(first) if first == core else f"{first}-{core}")
            first = None
    return ",".join(out)


def needs_binding(environ: Mapping[str, str], cpu: bool, workers: int, numa_nodes: Callable[[], int]) -> bool:
    """Would vLLM's automatic binding assert for this engine (CPU, several workers, the variable unset or
    ``auto``, fewer NUMA nodes than workers; ``numa_nodes`` is asked only then)?"""
    if not cpu or workers <= 1 or environ.get(BIND, "auto") != "auto":
        return False
    if environ.get("VLLM_CPU_SIM_MULTI_NUMA", "0") != "0":  # vLLM's own test mode binds without nodes
        return False
    return numa_nodes() < workers


def _allowed_numa_nodes() -> int:
    """The NUMA nodes of the cores this process may use, as vLLM's binding counts them (0 if it cannot)."""
    from vllm.platforms.cpu import CpuPlatform  # noqa: PLC0415 - vLLM only when an engine starts

    try:
        return len(CpuPlatform.get_allowed_cpu_core_node_list()[0])
    except Exception:  # noqa: BLE001 - no lscpu, or its output unreadable: vLLM's binding would fail the same way
        return 0


@contextmanager
def workers_bound(cpu: bool, workers: int, environ=os.environ) -> Iterator[str | None]:
    """While the workers of an engine start: ``VLLM_CPU_OMP_THREADS_BIND`` set where vLLM's own binding would
    assert (see the module), restored after; yields the binding set, or None."""
    if not needs_binding(environ, cpu, workers, _allowed_numa_nodes):
        yield None
        return
    before = environ.get(BIND)
    binding = cpu_binding(os.sched_getaffinity(0), workers)
    logger.info(
        "{} workers on CPU, fewer NUMA nodes than workers (vLLM's automatic binding would refuse): "
        "{}={} from the cores this process may use",
        workers,
        BIND,
        binding,
    )
    environ[BIND] = binding
    try:
        yield binding
    finally:
        if before is None:
            environ.pop(BIND, None)
        else:
            environ[BIND] = before
