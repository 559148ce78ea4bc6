"""generator_vs_llm.py's CPU clock: this process and its live descendants (vLLM's engine core under LLM)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "tools" / "benchmarks"
SPIN = "import sys, time\nend = time.process_time() + 1.0\nwhile time.process_time() < end: pass\nprint('spun', flush=True)\nsys.stdin.read()\n"


def _bench():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its neighbours (common, report)
    try:
        spec = importlib.util.spec_from_file_location("bench_generator_vs_llm", BENCHMARKS / "generator_vs_llm.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_a_live_child_process_cpu_time_is_counted():
    """A child that spun one CPU-second, still alive, adds that second to tree_usage()'s CPU (LLM's engine core is one)."""
    bench = _bench()
    before = bench.tree_usage()[0]
    child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spun"
        spent = bench.tree_usage()[0] - before
    finally:
        child.stdin.close()
        child.wait(30)
    assert 0.95 <= spent < 3.0, spent
