"""Helpers of the CLI and fault tests: data files, running the real command, reading results."""

import atexit
import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from speculators_v016.run import huge_pages
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
# The command starts itself again with glibc asked for huge pages on a CPU build (speculators_v016/run/huge_pages.py);
# the runs here, warm or cold, start with that setting already, as the command's own process runs.
# tests/cli/test_default_dtype.py leaves it out: there the command sets it itself.
if (_tunables := huge_pages.wanted(os.environ)) is not None:
    CPU["GLIBC_TUNABLES"] = _tunables


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
    """Run the real command in a fresh process, as a user would (``timeout``: seconds, then TimeoutExpired).

    The process is forked from a warm interpreter (helpers/warm_start.py) where its environment differs
    from the tests' only in the command's own variables; otherwise it starts cold.
    """
    module = "speculators_v016.testing.faults" if FAULT in (env or {}) else "speculators_v016.run.cli"
    args, full_env = [str(a) for a in args], {**os.environ, **CPU, **(env or {})}
    warm = _warm()
    if warm is not None and warm.takes(full_env):
        return warm.run(module, args, full_env, timeout)
    cmd = [sys.executable, "-m", module, *args]
    return Result(subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout))


# The variables a warm run may set apart from the warm interpreter's: read by the command as it runs, never
# by the imports the interpreter made (torch reads TORCHDYNAMO_DISABLE on import, vLLM some of its own).
# PYTEST_CURRENT_TEST is pytest's name of the test under way, new in every test (the interpreter keeps the
# one of the test that started it): none of those imports reads it, and the run gets the current one.
# Without it, every run after the first test of a pytest process started cold.
WARM_VARIABLES = ("SPECULATORS_DATA_GEN_", FAULT, "PYTEST_CURRENT_TEST")


class _WarmInterpreter:
    """One warm interpreter per pytest process, started on first use (helpers/warm_start.py)."""

    def __init__(self):
        self.env = {**os.environ, **CPU}
        script = Path(__file__).with_name("warm_start.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env=self.env,
            cwd="/",
        )
        if "ready" not in self._answer(600):
            raise RuntimeError(f"the warm interpreter did not start (exit {self.proc.poll()})")

    def takes(self, env: dict) -> bool:
        """Would a run in ``env`` see what a cold start would? Only the command's own variables may differ."""
        keys = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) for k in keys if not k.startswith(WARM_VARIABLES))

    def run(self, module: str, args: list[str], env: dict, timeout: float) -> Result:
        with tempfile.TemporaryDirectory(prefix="warm-run-") as where:
            out, err = Path(where, "stdout"), Path(where, "stderr")
            request = dict(module=module, args=args, env=env, cwd=os.getcwd(), stdout=str(out), stderr=str(err))
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            pid = self._answer(60)["pid"]
            answer = self._answer(timeout)
            if not answer:  # past its time: killed, as subprocess.run kills
                os.kill(pid, signal.SIGKILL)
                self._answer(60)
            text = [p.read_text(errors="replace") if p.exists() else "" for p in (out, err)]
            if not answer:
                raise subprocess.TimeoutExpired([module, *args], timeout, output=text[0], stderr=text[1])
            return Result(subprocess.CompletedProcess(args, answer["status"], text[0], text[1]))

    def _answer(self, timeout: float) -> dict:
        """The next line from the interpreter ({} when none came within ``timeout`` seconds). Unbuffered: one
        read never takes the next answer along, so select() sees it."""
        line = b""
        deadline = time.monotonic() + timeout
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return {}
            byte = self.proc.stdout.read(1)
            if not byte:
                raise RuntimeError(f"the warm interpreter ended (exit {self.proc.wait()})")
            line += byte
        return json.loads(line)


_WARM: list[_WarmInterpreter] = []


def _warm() -> _WarmInterpreter | None:
    """The pytest process's warm interpreter (none with SPECULATORS_TESTS_COLD_START=1: every run cold)."""
    if os.environ.get("SPECULATORS_TESTS_COLD_START") == "1":
        return None
    if not _WARM or _WARM[0].proc.poll() is not None:
        _WARM[:] = [_WarmInterpreter()]
        atexit.register(_WARM[0].proc.stdin.close)
    return _WARM[0]


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
