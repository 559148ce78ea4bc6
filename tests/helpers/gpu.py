"""The GPU tier's helpers: whether vLLM's CUDA platform loads here, the engine arguments the GPU build needs,
the real command with a GPU's settings, and vLLM's own loop (``LLMEngine``) in a process of its own.

The engine arguments come from ``SPECULATORS_GPU_ENGINE_ARGS`` (JSON; the GPU kit, ``../shared/gpu-vllm``,
exports the attention backend and native norms its build needs; empty with a full vLLM install).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.cli import Result

VLLM_LOOP = Path(__file__).resolve().parent / "vllm_loop.py"
#: Each engine's share of the GPU: the tier runs several test processes on one GPU at once.
GPU_MEMORY = 0.12


@functools.cache
def vllm_on_cuda() -> str | None:
    """None where vLLM's CUDA platform loads here, else why not (the GPU tier's skip reason)."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        from vllm.platforms import current_platform  # noqa: PLC0415 - vLLM only where a GPU is
    except Exception as exc:  # noqa: BLE001 - any failure to load means: not here
        return f"vLLM does not load: {type(exc).__name__}: {exc}"
    return None if current_platform.is_cuda() else f"vLLM's platform here is {current_platform.device_type}"


requires_vllm_gpu = pytest.mark.skipif(vllm_on_cuda() is not None, reason=str(vllm_on_cuda()))


def engine_args(**more) -> dict:
    """The GPU build's engine arguments (``SPECULATORS_GPU_ENGINE_ARGS``), with ``more`` merged in."""
    args = json.loads(os.environ.get("SPECULATORS_GPU_ENGINE_ARGS") or "{}")
    return {**args, **more}


#: The command's environment on a GPU: what users run (bf16 from the checkpoint, compiled, CUDA graphs),
#: the GPU build's engine arguments, a share of the GPU, no progress bar.
def command_env(**more) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULATORS_DATA_GEN_")}
    for command in ("", "SERVE_", "CHECK_"):  # a subcommand's options read their own variables
        env[f"SPECULATORS_DATA_GEN_{command}ENGINE_ARGS"] = json.dumps(engine_args())
    for command in ("", "SERVE_"):  # check has no --gpu-memory-utilization
        env[f"SPECULATORS_DATA_GEN_{command}GPU_MEMORY_UTILIZATION"] = str(GPU_MEMORY)
    env.update(SPECULATORS_DATA_GEN_NO_PROGRESS="1", SPECULATORS_DATA_GEN_NUM_PREPROCESSING_WORKERS="1")
    env["SPECULATORS_DATA_GEN_SERVE_NUM_PREPROCESSING_WORKERS"] = "1"
    env.update(more)
    return env


def invoke_gpu(*args, env=None, fault: str | None = None, stand_ins: bool = False, timeout=600) -> Result:
    """The real command in a fresh process with :func:`command_env` (``fault``: armed through the test kit;
    ``stand_ins``: with every GPU-kit stand-in installed in its processes, :mod:`speculators_v016.testing.gpu_kit`)."""
    if fault and stand_ins:
        raise ValueError("invoke_gpu: a fault and the kit's stand-ins run through different modules; choose one")
    module = "speculators_v016.testing.gpu_kit" if stand_ins else "speculators_v016.run.cli"
    module = "speculators_v016.testing.faults" if fault else module
    extra = {"SPECULATORS_V016_FAULT": fault} if fault else {}
    cmd = [sys.executable, "-m", module, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=command_env(**extra, **(env or {})), timeout=timeout)
    return Result(proc)


def vllm_loop(
    where: Path, model: str, prompts: list[list[int]], engine: dict, sampling: dict, stand_ins: bool = False
) -> dict:
    """vLLM's own loop (``LLMEngine``: add_request, step) on ``prompts`` in a process of its own: its tokens
    (``stand_ins``: with every GPU-kit stand-in registered there, :mod:`speculators_v016.testing.gpu_kit`, its core
    in that process)."""
    args = {"model": model, "prompts": prompts, "engine": engine, "sampling": sampling, "stand_ins": stand_ins}
    (where / "loop-args.json").write_text(json.dumps(args))
    proc = subprocess.run(
        [sys.executable, str(VLLM_LOOP), str(where / "loop-args.json"), str(where / "loop-out.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((where / "loop-out.json").read_text())


def save_figures(name: str, figures: dict) -> None:
    """Print a test's figures (``-s``) and, where ``SPECULATORS_GPU_FIGURES`` names a folder, keep them there as
    ``NAME.json`` (tools/gpu/tier_page.py makes docs/benchmarks/gpu_tier.md of that folder)."""
    print(f"\n{name}: {json.dumps(figures, sort_keys=True)}")
    where = os.environ.get("SPECULATORS_GPU_FIGURES")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / f"{name}.json").write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
