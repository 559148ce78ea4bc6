"""Every stand-in of the GPU kit, in every process of a run: ``python -m speculators_v016.testing.gpu_kit ARGS``.

The GPU kit (``../shared/gpu-vllm``) is vLLM's Python code without its compiled libraries; the test
kit stands in for the kernels its tests reach (:mod:`~speculators_v016.testing.moe_ops`: fused-MoE
routing, alignment, activations; :mod:`~speculators_v016.testing.mla_ops`: MLA's cache and prefill
ops; ``cache_ops``: the FlexAttention backend's KV-cache write; ``act_ops``: ``_C``'s activations;
``wna16_ops``: ``_moe_C.moe_wna16_gemm`` and the steering away from Marlin's INT4 MoE where Marlin is absent). A test that starts the engine in its own process calls
:func:`install` first. The real command runs in a fresh process: run this module with the command's
arguments and it installs them, then runs the installed ``speculators-data-gen`` through its entry
point (as :mod:`~speculators_v016.testing.faults` does, never importing the CLI). vLLM's worker
processes are spawned: each imports this module as ``__mp_main__`` and installs them too. Each
``install`` keeps a compiled kernel where one is loaded, so on a full vLLM build this changes nothing.
This module is a test kit: no run imports it.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

COMMAND = "speculators-data-gen"


def install() -> dict[str, dict]:
    """Register every stand-in of the kit in this process (idempotent); return each module's report."""
    from speculators_v016.testing import (  # noqa: PLC0415 - the kit's kernels only where an engine runs
        act_ops,
        cache_ops,
        mla_ops,
        moe_ops,
        wna16_ops,
    )

    return {
        "moe": moe_ops.install(),
        "mla": mla_ops.install(),
        "act": act_ops.install(),
        "wna16": wna16_ops.install(),
        "cache": cache_ops.install(),
    }


def main() -> None:
    """Install the stand-ins, then run the installed command with this process's arguments."""
    install()
    (command,) = entry_points(group="console_scripts", name=COMMAND)
    sys.argv[0] = COMMAND
    command.load()()


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # a vLLM worker process spawned by a run started through this module
    install()
