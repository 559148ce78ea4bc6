"""Shared helpers of the benchmark scripts: a bench model, prompts, one measured child process."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

from speculators_v016.run import huge_pages


def bench_model(where: Path, hidden: int = 512, layers: int = 8, **overrides) -> Path:
    """A random Llama of benchmark size (built once); ``overrides`` go to its config."""
    from speculators_v016.testing.tiny_models import (  # noqa: PLC0415 - --before children import it on older checkouts
        build_tiny_model,
    )

    where = Path(where)
    if not (where / "config.json").exists():
        fields = dict(intermediate_size=4 * hidden, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128)
        build_tiny_model(where, "llama", num_layers=layers, hidden_size=hidden, **{**fields, **overrides})
    return where


def prompts(count: int, length: int, vocab: int = 400, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (count, length), generator=gen).tolist()


def engine_env(code_from: str | None = None) -> dict:
    """The environment of a measured engine process: every mode gets the same CPU KV cache (vLLM's
    default is half the RAM), quiet vLLM logs, and ``code_from``'s speculators_v016 first on the path."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    if tunables := huge_pages.wanted(env):  # every side as the command runs itself (SPECULATORS_V016_HUGE_PAGES=0: not)
        env["GLIBC_TUNABLES"] = tunables
    if code_from:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(code_from).resolve()), env.get("PYTHONPATH")]))
    return env


def pages_text() -> str:
    """How the measured processes' glibc pages memory (:func:`engine_env`), for a benchmark's header."""
    return huge_pages.describe(engine_env().get("GLIBC_TUNABLES", "")).split(" (")[0]


def child(script: str, args: dict, code_from: str | None = None) -> dict:
    """Run ``script`` with ``args`` (JSON) in a fresh process; return its last JSON line.

    ``code_from``: a checkout whose ``speculators_v016`` the child imports instead of this one's
    (e.g. the previous release, for before/after figures in one run).
    """
    proc = subprocess.run(
        [sys.executable, script, json.dumps(args)], capture_output=True, text=True, env=engine_env(code_from)
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {args} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
