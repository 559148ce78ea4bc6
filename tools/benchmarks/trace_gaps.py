"""Where a GPU waited for its host: the idle gaps of a torch profiler trace and what the host did in them.

A Chrome trace of one pass (torch.profiler with CPU and CUDA activities, ``export_chrome_trace``) holds the
device's kernels and copies, the host's CUDA runtime calls and its aten ops, linked by correlation ids. A gap is
a stretch with no kernel and no copy on the device but those to the host (they run beside the forward on a
stream of their own). For each gap of at least ``min_gap_us``, :func:`gap_report` finds the runtime call that
launched the work ending it: launched after the gap began, the device waited for the host (host-bound); then it
adds up what the launching thread ran from the gap's start to that launch, by outermost op, and which
synchronizing calls ended just before the gap (the host waiting for the device, then finding nothing queued).

    python3 tools/benchmarks/trace_gaps.py TRACE.json[.gz]   # the report of a trace, as JSON
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

#: trace categories of work on the device
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: trace categories of the host's calls into CUDA
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
#: trace categories of the host's own work (ops, annotations, runtime calls)
HOST_CATS = ("cpu_op", "user_annotation", "python_function", *RUNTIME_CATS)
#: a synchronizing call that ended this long (µs) before a gap began is counted as its cause's candidate
SYNC_WINDOW_US = 1000.0


def to_host(name: str) -> bool:
    """A copy from the device to the host (our capture's; it runs beside the forward)."""
    return "DtoH" in name or "Device -> Pinned" in name or "Device -> Pageable" in name


def synchronizing(name: str) -> bool:
    """A runtime call that blocks the host until the device has done something."""
    return "Synchronize" in name or name in ("cudaMemcpy", "cuMemcpyDtoH_v2", "cudaStreamWaitEvent_blocking")


def load(path: Path) -> dict:
    """A Chrome trace, gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _complete(trace: dict, cats) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in cats and "ts" in e]


def _outermost(events: list[dict]) -> list[dict]:
    """The events of one thread not inside another (sorted by start)."""
    out, end = [], float("-inf")
    for e in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e.get("dur", 0)
    return out


def _overlap(e: dict, start: float, stop: float) -> float:
    return max(0.0, min(e["ts"] + e.get("dur", 0), stop) - max(e["ts"], start))


def gap_report(trace: dict, min_gap_us: float = 100.0, top: int = 8) -> dict:
    """The device's idle gaps of at least ``min_gap_us`` and the host's share in them (see the module)."""
    device = sorted((e for e in _complete(trace, DEVICE_CATS) if not to_host(e.get("name", ""))), key=lambda e: e["ts"])
    if not device:
        return {}
    runtime = {}
    for e in _complete(trace, RUNTIME_CATS):
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            runtime[corr] = e
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in _complete(trace, HOST_CATS):
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    top_level = {key: _outermost(events) for key, events in by_thread.items()}
    syncs = sorted((e for e in _complete(trace, RUNTIME_CATS) if synchronizing(e["name"])), key=lambda e: e["ts"])

    gaps, end = [], device[0]["ts"] + device[0].get("dur", 0)
    for e in device[1:]:
        if e["ts"] - end >= min_gap_us:
            gaps.append((end, e["ts"], e))
        end = max(end, e["ts"] + e.get("dur", 0))
    window = end - device[0]["ts"]

    to_host_copies = [e for e in _complete(trace, DEVICE_CATS) if to_host(e.get("name", ""))]
    host_bound, host_ms, by_op, before, untraced, launched = 0, 0.0, defaultdict(float), defaultdict(int), 0.0, 0.0
    queued, queued_ms, copying_ms, unlinked = 0, 0.0, 0.0, 0
    for start, stop, first in gaps:
        launch = runtime.get((first.get("args") or {}).get("correlation"))
        if launch is None:
            unlinked += 1
            continue
        if launch["ts"] + launch.get("dur", 0) <= start:  # queued before the device went idle: a wait on the device
            queued += 1
            queued_ms += (stop - start) / 1e3
            copying_ms += sum(_overlap(c, start, stop) for c in to_host_copies) / 1e3
            continue
        host_bound += 1
        host_ms += (stop - start) / 1e3
        upto = max(start, launch["ts"])
        launched += (stop - upto) / 1e3
        traced = 0.0
        for e in top_level.get((launch.get("pid"), launch.get("tid")), []):
            part = _overlap(e, start, upto)
            if part:
                by_op[e["name"]] += part / 1e3
                traced += part
        untraced += (upto - start - traced) / 1e3
        for s in syncs:
            if start - SYNC_WINDOW_US <= s["ts"] + s.get("dur", 0) <= start + 1.0:
                before[s["name"]] += 1
    all_sync = defaultdict(float)
    for s in syncs:
        all_sync[s["name"]] += s.get("dur", 0) / 1e3
    return {
        "window_ms": window / 1e3,
        "gaps": len(gaps),
        "gap_ms": sum(b - a for a, b, _ in gaps) / 1e3,
        "unlinked_gaps": unlinked,
        "queued_gaps": queued,
        "queued_ms": queued_ms,
        "to_host_copies_in_queued_gaps_ms": copying_ms,
        "host_bound_gaps": host_bound,
        "host_bound_ms": host_ms,
        "host_ops_in_gaps_ms": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:top]),
        "host_untraced_in_gaps_ms": untraced,
        "launch_to_start_in_gaps_ms": launched,
        "syncs_ending_just_before_gaps": dict(sorted(before.items(), key=lambda kv: -kv[1])[:top]),
        "sync_calls_in_pass_ms": dict(sorted(all_sync.items(), key=lambda kv: -kv[1])[:top]),
    }


def describe(report: dict) -> str:
    """One paragraph of a :func:`gap_report`."""
    if not report:
        return "no device events in the trace"
    ops = ", ".join(f"{k} {v:.1f}" for k, v in report["host_ops_in_gaps_ms"].items()) or "none"
    syncs = ", ".join(f"{k} x{v}" for k, v in report["syncs_ending_just_before_gaps"].items()) or "none"
    calls = ", ".join(f"{k} {v:.1f}" for k, v in report["sync_calls_in_pass_ms"].items()) or "none"
    return (
        f"{report['gaps']} gaps of the device ({report['gap_ms']:.1f} ms of {report['window_ms']:,.0f}); "
        f"{report['queued_gaps']} with their work queued before they began ({report['queued_ms']:.1f} ms: the device "
        f"waited on itself, copies to the host running {report['to_host_copies_in_queued_gaps_ms']:.1f} ms of it), "
        f"{report['unlinked_gaps']} not linked to a launch; {report['host_bound_gaps']} host-bound ({report['host_bound_ms']:.1f} ms: the work ending them was "
        f"launched after they began); the launching thread in them, by outermost op (ms): {ops}; outside any "
        f"traced op {report['host_untraced_in_gaps_ms']:.1f} ms; from the launch to the device starting "
        f"{report['launch_to_start_in_gaps_ms']:.1f} ms; synchronizing calls that ended within "
        f"{SYNC_WINDOW_US / 1e3:g} ms before a gap: {syncs}; synchronizing calls in the pass (ms): {calls}"
    )


if __name__ == "__main__":
    print(json.dumps(gap_report(load(Path(sys.argv[1]))), indent=1))
