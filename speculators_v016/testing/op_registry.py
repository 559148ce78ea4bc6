"""Registering torch stand-ins under the names of vLLM's compiled ops (tests only), where no compiled op is loaded.

The GPU kit (``../shared/gpu-vllm``) carries vLLM 0.16's Python code without its compiled libraries;
:mod:`~speculators_v016.testing.moe_ops`, :mod:`~speculators_v016.testing.mla_ops`,
:mod:`~speculators_v016.testing.act_ops` and :mod:`~speculators_v016.testing.wna16_ops` hold torch
implementations of the kernels vLLM's GPU path reaches. Two ways of putting one in place:

* :func:`register`: a real ``torch.library`` op under the kernel's qualified name (``_moe_C::topk_softmax``),
  for ops vLLM may call where torch.compile traces (a fake implementation given, or a trivial one for
  ops that only write their arguments) or looks up as ``torch.ops.NS.NAME.default``;
* :func:`set_attribute`: the function set as an attribute of the ``torch.ops`` namespace (as the kit sets its
  placeholders), for ops called only inside vLLM's opaque attention op, never traced, whose kernels return
  one of their arguments (a ``torch.library`` op may not return an alias of an input).

Both leave a compiled op of that name in place (a real vLLM build keeps its kernels): :func:`compiled`.
This module is a test kit: no run imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

_MINE: dict[str, object] = {}  # qualified name -> our torch.library op (kept alive)


def load_vllm_kernels() -> None:
    """Import vLLM's kernel libraries (what its platform does at start) before anything is registered: a
    compiled library loaded after our registration of a name it defines would abort the process, and the
    GPU kit's ``vllm/_C.py`` sets its placeholders when imported."""
    import vllm._C  # noqa: F401, PLC0415 - vLLM's kernels (or the kit's placeholders), only when installing

    with contextlib.suppress(ImportError):
        import vllm._moe_C  # noqa: F401, PLC0415 - absent from the CPU build and the GPU kit
    with contextlib.suppress(ImportError):
        import vllm.vllm_flash_attn  # noqa: F401, PLC0415 - CUDA builds only (the kit's imports, without kernels)


def compiled(namespace: str, name: str) -> bool:
    """Is an op of this name registered (a real vLLM build, or ours), not a placeholder or nothing?"""
    return isinstance(getattr(getattr(torch.ops, namespace), name, None), torch._ops.OpOverloadPacket)


def register(
    namespace: str, name: str, fn: Callable, mutates: Sequence[str], fake: Callable | None, report: dict
) -> None:
    """``fn`` as the ``torch.library`` op ``namespace::name`` (``mutates``: the arguments it writes; ``fake``: its
    shapes for tracing) unless a compiled op of that name is loaded; ``report["installed"]`` or ``["kept"]``
    gains the qualified name. Idempotent (our own op counts as installed)."""
    qualified = f"{namespace}::{name}"
    if qualified not in _MINE:
        if compiled(namespace, name):
            report["kept"].append(qualified)
            return
        ns = getattr(torch.ops, namespace)
        if name in vars(ns):  # the kit's placeholder, set as an attribute: let the namespace find the op
            delattr(ns, name)
        op = torch.library.custom_op(qualified, fn, mutates_args=tuple(mutates))
        if fake is not None:
            op.register_fake(fake)
        _MINE[qualified] = op
    report["installed"].append(qualified)


def set_attribute(namespace: str, name: str, fn: Callable, report: dict) -> None:
    """``fn`` set as ``torch.ops.<namespace>.<name>`` unless a compiled op of that name is loaded (report as
    :func:`register`)."""
    if compiled(namespace, name):
        report["kept"].append(f"{namespace}::{name}")
        return
    setattr(getattr(torch.ops, namespace), name, fn)
    report["installed"].append(f"{namespace}::{name}")


def empty_report() -> dict[str, list[str]]:
    return {"installed": [], "kept": []}


def set_attributes(ops: dict[tuple[str, str], Callable]) -> dict[str, list[str]]:
    """Every ``(namespace, name) -> fn`` of ``ops`` put in place by :func:`set_attribute`, vLLM's kernels loaded
    first (:func:`load_vllm_kernels`); idempotent. Returns the report (``{"installed": [...], "kept": [...]}``)."""
    load_vllm_kernels()
    report = empty_report()
    for (namespace, name), fn in ops.items():
        set_attribute(namespace, name, fn, report)
    return report
