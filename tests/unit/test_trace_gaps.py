"""tools/benchmarks/trace_gaps.py: the device's idle gaps in a profiler trace, and the host's part in them."""

import gzip
import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "tools" / "benchmarks"


def _module():
    spec = importlib.util.spec_from_file_location("bench_trace_gaps", BENCHMARKS / "trace_gaps.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _x(cat, name, ts, dur, pid=1, tid=1, corr=None):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": {} if corr is None else {"correlation": corr}}  # fmt: skip


def _trace():
    """A host thread and a device, in µs: a host-bound gap (300-760) and one the device spent waiting on itself
    while a copy to the host ran (900-1500); the copy itself is not work that closes a gap."""
    return {
        "traceEvents": [
            _x("cpu_op", "step", 0, 100),
            _x("cuda_runtime", "cudaLaunchKernel", 10, 5, corr=1),
            _x("kernel", "forward_a", 20, 180, pid=0, tid=7, corr=1),
            _x("cuda_driver", "cuLaunchKernel", 150, 5, corr=2),
            _x("kernel", "forward_b", 200, 100, pid=0, tid=7, corr=2),
            _x("cuda_runtime", "cudaStreamSynchronize", 160, 140),
            _x("cpu_op", "aten::copy_", 310, 390),
            _x("cpu_op", "aten::empty", 320, 10),
            _x("cuda_runtime", "cudaLaunchKernel", 750, 5, corr=3),
            _x("kernel", "forward_c", 760, 140, pid=0, tid=7, corr=3),
            _x("cuda_runtime", "cudaMemcpyAsync", 780, 5, corr=5),
            _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 900, 1100, pid=0, tid=9, corr=5),
            _x("cuda_runtime", "cudaLaunchKernel", 800, 5, corr=4),
            _x("kernel", "forward_d", 1500, 100, pid=0, tid=7, corr=4),
            _x("kernel", "tiny_gap", 1650, 10, pid=0, tid=7),  # 50 µs after forward_d: under the threshold
        ]
    }


def test_a_gap_whose_work_was_launched_late_is_host_bound_with_the_ops_that_ran_in_it():
    """The gap 300-760 µs: host-bound, the outermost op in it (aten::copy_) and the untraced rest, the sync before."""
    r = _module().gap_report(_trace())
    assert r["gaps"] == 2 and abs(r["gap_ms"] - (0.46 + 0.6)) < 1e-9
    assert r["host_bound_gaps"] == 1 and abs(r["host_bound_ms"] - 0.46) < 1e-9
    assert r["host_ops_in_gaps_ms"] == {"aten::copy_": 0.39}
    assert abs(r["host_untraced_in_gaps_ms"] - 0.06) < 1e-9
    assert abs(r["launch_to_start_in_gaps_ms"] - 0.01) < 1e-9
    assert r["syncs_ending_just_before_gaps"] == {"cudaStreamSynchronize": 1}
    assert abs(r["sync_calls_in_pass_ms"]["cudaStreamSynchronize"] - 0.14) < 1e-9


def test_a_gap_whose_work_was_queued_is_the_devices_own_wait_and_copies_to_the_host_do_not_close_gaps():
    """The gap 900-1500 µs: its kernel was launched at 800, so the device waited on itself beside the DtoH copy."""
    r = _module().gap_report(_trace())
    assert r["queued_gaps"] == 1 and abs(r["queued_ms"] - 0.6) < 1e-9
    assert abs(r["to_host_copies_in_queued_gaps_ms"] - 0.6) < 1e-9
    assert r["unlinked_gaps"] == 0
    assert abs(r["window_ms"] - 1.64) < 1e-9


def test_a_trace_file_is_read_gzipped_and_described_in_one_paragraph(tmp_path):
    """load() reads a .json.gz as torch writes it; describe() names the figures; no device events: said so."""
    m = _module()
    path = tmp_path / "pass.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    text = m.describe(m.gap_report(m.load(path)))
    assert "2 gaps of the device (1.1 ms" in text and "1 host-bound (0.5 ms" in text and "aten::copy_ 0.4" in text
    assert m.describe(m.gap_report({"traceEvents": [_x("cpu_op", "step", 0, 100)]})) == "no device events in the trace"
