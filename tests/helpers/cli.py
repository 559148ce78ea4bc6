"""Helpers of the CLI and fault tests: data files, running the real command, reading results."""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

from speculators_v016.run.demo import corpus_lines
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import load_sample
from speculators_v016.testing.faults import VARIABLE as FAULT

# TORCHDYNAMO_DISABLE: an eager engine compiles one thing, vLLM's prompt-logprob rank kernel
# (``batched_count_greater_than``), and inductor's CPU ISA probe (g++ and a Python start per ISA)
# makes that 16 s of every CLI process, two thirds of a small run. Eager, the kernel counts the same
# integers. The in-process engine tests, the compiled-path tests and test_default_dtype.py (the path
# users run) keep it compiled.
CPU = {
    "SPECULATORS_DATA_GEN_DTYPE": "float32",
    "TORCHDYNAMO_DISABLE": "1",
    "SPECULATORS_DATA_GEN_ENFORCE_EAGER": "1",
    "SPECULATORS_DATA_GEN_NO_PROGRESS": "1",
    "SPECULATORS_DATA_GEN_NUM_PREPROCESSING_WORKERS": "1",
}


def conversations(count: int, seed: int = 0) -> list[dict]:
    """Synthetic chats from the demo corpus, in both row shapes."""
    rng, lines = random.Random(seed), corpus_lines()
    rows = []
    for i in range(count):
        turns = [(("human", "user"), rng.choice(lines)), (("gpt", "assistant"), " ".join(rng.sample(lines, 2)))]
        if i % 2:
            rows.append({"messages": [{"role": r[1], "content": t} for r, t in turns]})
        else:
            rows.append({"conversations": [{"from": r[0], "value": t} for r, t in turns]})
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Result:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.exit_code, self.output = proc.returncode, proc.stdout + proc.stderr


def invoke(*args, env=None, timeout=600) -> Result:
    """Run the real command in a fresh process, as a user would (``timeout``: seconds, then TimeoutExpired)."""
    module = "speculators_v016.testing.faults" if FAULT in (env or {}) else "speculators_v016.run.cli"
    cmd = [sys.executable, "-m", module, *map(str, args)]
    return Result(
        subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **CPU, **(env or {})}, timeout=timeout)
    )


def generate(model_dir, data, out, *extra, env=None, timeout=600) -> Result:
    """A run of the real command as the fault tests make it: 256 tokens, no token-frequency file."""
    return invoke(
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--token-freq-path",
        "",
        *extra,
        env=env,
        timeout=timeout,
    )


def load_all(folder: Path) -> dict[int, dict]:
    return {i: load_sample(folder / e.file) for i, e in Manifest(folder).entries().items()}


# What third-party code prints during a run; none of it may reach the terminal.
THIRD_PARTY = [
    "[Gloo]",
    "NUMA binding",
    "No CUDA runtime",
    "torch_dtype",
    "Map (num_proc",
    "logging_utils",
    "[core.py",
    "[scheduler.py",
    "empty_cache",
    "Loading safetensors checkpoint",
    "Counting token",
]


def assert_one_voice(output: str, log_dirs, dtype: str = "float32") -> Path:
    """Terminal: our start line, progress, summary and log path only; the log: vLLM's lines. Returns the log."""
    for line in THIRD_PARTY:
        assert line not in output, f"{line!r} reached the terminal:\n{output[-3000:]}"
    assert re.search(rf"layers \[[\d, ]+\] \(vLLM aux ids \[[\d, ]+\]\), {dtype}, TP 1, uni executor", output)
    assert re.search(r"\d+/\d+ samples: .*tok/s", output), output[-2000:]  # the progress bar
    assert "written:" in output and "verify:" in output
    logs = sorted(p for d in log_dirs for p in Path(d).glob("*.log"))
    assert len(logs) == 1, logs
    assert f"log:        {logs[0]}" in output
    text = logs[0].read_text(errors="replace")
    assert "Initializing a V1 LLM engine" in text and "[Gloo]" in text  # vLLM's and C++ lines, kept
    return logs[0]
