"""The worker's capture on a GPU: CUDA-graph outputs copied into pinned ring slots, exact, at the real cadence.

vLLM cannot run where the GPUs are lent, so a small stand-in for vLLM's model
runner drives :class:`~speculators_v016.worker.capture.CaptureWorkerExtension`: a
CUDA graph whose aux outputs are overwritten at every replay, as vLLM's graphs
reuse their buffers. Every captured step must equal an eager recompute bit
for bit (no row of the next step, no torn copy). Steps are 448 MiB (8192
tokens x 4 layers x hidden 7168, bf16).

* Copy checks (a synchronization before each call, so the call's own copy is
  timed): both copy paths (``staged``: device-to-device into a GPU staging
  buffer, device-to-host on a copy stream; ``direct``: device-to-host on the
  compute stream), local and ``/dev/shm`` rings, and the path without a ring.
* The real cadence (:func:`test_capture_at_the_real_cadence`): a forward of
  >= 30 ms, no synchronization before the capture call, two steps in flight
  (the host retires step k-1 after launching step k, as the engine does),
  the host copying each reply out of its slot; GPU time per step (CUDA
  events at each step's start on the compute stream) without capture, with
  the staged path and with the direct path, and host time per capture call.
* Release: two capture set-ups one after the other in one process (without
  the release, re-registering the ring's range fails with
  ``cudaErrorHostMemoryAlreadyRegistered``); the registration is gone after
  close (the memory no longer reports as pinned, and the driver registers the
  range again), on re-attach and when a worker is dropped.

Figures are printed (``-s``); set ``SPECULATORS_GPU_FIGURES`` to a folder to
also get them as JSON. Skips without CUDA.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.capture import worker_setup
from speculators_v016.shared.slot_ring import RingSpaceError, SlotRing
from speculators_v016.worker.capture import CaptureWorkerExtension

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, LAYERS, HIDDEN, DTYPE = 8192, 4, 7168, torch.bfloat16
STEP_BYTES = TOKENS * LAYERS * HIDDEN * 2
#: the staged copies' NaN/Inf proof beside their 2 buffers: a float32 sum each and 32 partial sums each for the
#: one-pass fill (66 floats), in the caching allocator's smallest block (512 bytes)
PROOF_SUMS_BYTES = 512
STEP_ROWS = [8192, 5000, 8192, 37, 8192, 6144, 8192, 8192, 1, 8192, 8192, 8192]
GIB = 2**30

#: The real cadence: mixed rows first (checked, not timed), then full 448 MiB steps (checked and timed).
WARMUP_ROWS = STEP_ROWS
TIMED_STEPS = 32
FORWARD_TARGET_S = 0.036
NUM_INPUTS = 8
CADENCE_MODES = ["none", "staged", "direct", "none", "staged"]


class StandInRunner:
    """What the capture reads of vLLM's GPU model runner, fed by a CUDA graph of ``repeats`` matmuls per layer."""

    def __init__(self, repeats: int = 1):
        self.device = torch.device("cuda")
        self.repeats = repeats
        self.model_memory_usage = 0
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.weights = [
            torch.randn(HIDDEN, HIDDEN, device="cuda", generator=gen).to(DTYPE) / HIDDEN**0.5 for _ in range(LAYERS)
        ]
        self.static_input = torch.zeros(TOKENS, HIDDEN, device="cuda", dtype=DTYPE)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up kernels on a side stream before capture, as CUDA graphs need
            for _ in range(2):
                self.forward(self.static_input)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_aux = self.forward(self.static_input)
        self.execute_model_state = None
        self.input_batch = None
        self.query_start_loc = None

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        aux = []
        for weight in self.weights:
            for _ in range(self.repeats):
                hidden = torch.tanh(hidden @ weight) + hidden
            aux.append(hidden)
        return aux

    def step(self, inputs: torch.Tensor, rows: int) -> None:
        """Replay the graph on ``inputs``; expose its outputs and a 3-request batch of ``rows`` tokens."""
        self.static_input.copy_(inputs)
        self.graph.replay()
        self.execute_model_state = SimpleNamespace(aux_hidden_states=self.static_aux)
        cut = sorted({0, rows // 3, (2 * rows) // 3, rows})
        self.input_batch = SimpleNamespace(
            num_reqs=len(cut) - 1,
            req_ids=[f"r{i}" for i in range(len(cut) - 1)],
            num_computed_tokens_cpu=np.zeros(len(cut) - 1, dtype=np.int64),
        )
        self.query_start_loc = SimpleNamespace(np=np.array(cut, dtype=np.int32))


class StandInWorker(CaptureWorkerExtension):
    """The worker the extension is mixed into; ``budget`` plays vLLM's requested memory (None: unknown)."""

    def __init__(self, runner, budget: int | None = None):
        self.model_runner, self.rank = runner, 0
        if budget is not None:
            free, total = torch.cuda.mem_get_info()
            self.init_snapshot = SimpleNamespace(cuda_memory=total - free)
            self.requested_memory = budget


def make_ring(shared: bool, storage: str = "auto") -> SlotRing:
    return SlotRing.create(
        slots=3, num_ids=LAYERS, max_rows=TOKENS, hidden=HIDDEN, dtype=DTYPE, shared=shared, hidden_states_dtype=storage
    )


def attach(runner, ring, staging: str, budget: int | None = 64 * GIB, storage: str = "auto") -> StandInWorker:
    worker = StandInWorker(runner, budget)
    worker.speculators_capture_attach(worker_setup(LAYERS, ring.spec, staging, storage))
    expected = "staged" if staging == "auto" else "direct"
    assert worker._speculators_capture.copy_info["copy_path"] == expected, worker._speculators_capture.copy_info
    assert worker._speculators_capture.ring.pinned
    return worker


def register_code(buffer: torch.Tensor, nbytes: int) -> int:
    """Register ``buffer`` with CUDA and undo it at once; the error code (only ever call it where 0 is expected:
    a failed call leaves the runtime's last error set, which the next kernel launch would report)."""
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    if err == 0:
        assert int(cudart.cudaHostUnregister(buffer.data_ptr())) == 0
    return err


def save_figures(name: str, figures: dict) -> None:
    where = os.environ.get("SPECULATORS_GPU_FIGURES")
    if where:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, f"{name}.json"), "w") as fh:
            json.dump(figures, fh, indent=1)


# -- copy checks: a synchronization before each call --------------------------------------------


def run_steps(runner, worker, ring, rows_plan=STEP_ROWS):
    """Drive the steps, synchronizing before each call; return inputs, captured rows, host times, copy seconds."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs, captured, host, gpu = [], {}, [], []

    def consume(capture):
        if capture is None:
            return
        total = sum(capture.counts)
        states = capture.states if capture.slot is None else ring.slot(capture.slot)[:, :total]
        captured[capture.step] = states.clone()  # the engine's one copy out of the slot
        if capture.slot is not None:
            ring.release(capture.slot)

    staging = getattr(worker._speculators_capture.copier, "staging", None)  # the staged path's copier
    for step, rows in enumerate(rows_plan, 1):
        x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(DTYPE)
        inputs.append(x)
        runner.step(x, rows)
        torch.cuda.synchronize()  # time the capture call itself, not the forward it follows
        slot = ring.acquire() if ring is not None else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        previous = worker.speculators_capture_step(step, slot)
        host.append(time.perf_counter() - t0)
        end.record(staging.copy_stream if staging is not None else torch.cuda.current_stream())
        end.synchronize()
        gpu.append(start.elapsed_time(end) / 1000)
        consume(previous)
    consume(worker.speculators_capture_flush())
    return inputs, captured, host, gpu


def check_and_report(label, runner, inputs, captured, host, gpu, rows_plan=STEP_ROWS):
    assert sorted(captured) == list(range(1, len(rows_plan) + 1))
    for step, (x, rows) in enumerate(zip(inputs, rows_plan), 1):
        expected = runner.forward(x)
        for layer in range(LAYERS):
            assert torch.equal(captured[step][layer].cuda(), expected[layer][:rows]), (label, step, layer)
    full = [i for i, rows in enumerate(rows_plan) if rows == TOKENS][1:]  # 448 MiB steps, after the first
    host_ms = statistics.median(host[i] for i in full) * 1000
    rate = STEP_BYTES / statistics.median(gpu[i] for i in full) / GIB
    print(
        f"\n{label}: {STEP_BYTES / 2**20:.0f} MiB steps, {len(rows_plan)} of {len(rows_plan)} exact: host time "
        f"per capture call {host_ms:.2f} ms (max {max(host[i] for i in full) * 1000:.2f}), copy {rate:.1f} GiB/s"
    )
    return host_ms, rate


@pytest.fixture(scope="module")
def runner():
    return StandInRunner()


@pytest.mark.parametrize("staging", ["auto", "off"], ids=["staged", "direct"])
@pytest.mark.parametrize("shared", [False, True], ids=["local-ring", "shm-ring"])
def test_ring_capture_is_exact_and_fast(runner, shared, staging):
    """Every step equals an eager recompute bit for bit; 448 MiB steps copy at >= 30 GiB/s, < 15 ms host."""
    try:
        ring = make_ring(shared)
    except RingSpaceError as exc:
        pytest.skip(f"/dev/shm too small here for the shared ring: {exc}")
    worker = attach(runner, ring, staging)
    try:
        label = f"ring ({'shm' if shared else 'local'}, {worker._speculators_capture.copy_info['copy_path']})"
        host_ms, rate = check_and_report(label, runner, *run_steps(runner, worker, ring))
    finally:
        worker.speculators_capture_close()
        ring.close()
    save_figures(f"copy-{'shm' if shared else 'local'}-{staging}", {"host_ms": host_ms, "gib_s": rate})
    assert rate >= 30 and host_ms < 15


def test_without_ring_reference(runner):
    """The path without a ring (fresh pinned tensor per step) is exact too; its figures are printed."""
    worker = StandInWorker(runner)
    worker.speculators_capture_attach(worker_setup(LAYERS, None))
    assert worker._speculators_capture.copy_info == {"copy_path": "direct"}
    check_and_report("no ring (fresh pinned tensors)", runner, *run_steps(runner, worker, None))


@pytest.mark.parametrize("storage", ["auto", "fp8_e4m3"], ids=["bf16", "fp8"])
def test_the_staged_path_proves_each_step_finite_and_a_planted_nan_or_inf_fails_it(runner, storage):
    """Staged (bf16 rows or FP8 scales summed): each step's ``finite`` is True for the model's rows, not where a
    NaN, +Inf or -Inf was planted in the aux states before the capture (a value past the step's rows does not
    count); the direct path proves nothing."""
    plant = {3: (float("nan"), 11), 5: (float("inf"), 4999), 6: (-float("inf"), 982), 8: (float("nan"), 7000)}
    ring = make_ring(False, storage)
    try:
        for staging in ("auto", "off"):
            worker = attach(runner, ring, staging, storage=storage)
            finite = {}
            gen = torch.Generator(device="cuda").manual_seed(2)

            def consume(capture, finite=finite):
                if capture is not None:
                    finite[capture.step] = capture.finite
                    ring.release(capture.slot)

            try:
                for step in range(1, 10):
                    runner.step(torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(DTYPE), 5000 + step % 2)
                    if step in plant:  # on the compute stream, after the forward: what the capture then reads
                        value, row = plant[step]
                        runner.static_aux[step % LAYERS][row, step] = value
                    consume(worker.speculators_capture_step(step, ring.acquire()))
                consume(worker.speculators_capture_flush())
            finally:
                worker.speculators_capture_close()
            proven = {s: (s not in plant or plant[s][1] >= 5000 + s % 2) for s in range(1, 10)}
            assert finite == (proven if staging == "auto" else dict.fromkeys(range(1, 10))), staging
    finally:
        ring.close()


def test_staging_is_accounted_and_falls_back_when_it_does_not_fit(runner):
    """Staging bytes count as model memory (before vLLM sizes the KV cache); over a quarter of the budget: direct."""
    ring = make_ring(shared=False)
    try:
        runner.model_memory_usage = 0
        worker = attach(runner, ring, "auto")
        info = worker._speculators_capture.copy_info
        assert info["staging"]["bytes"] == 2 * STEP_BYTES and info["staging_in_model_memory"]
        assert info["staging_fill"] == "copy and sum in one pass (Triton)", info
        assert runner.model_memory_usage == 2 * STEP_BYTES
        worker.speculators_capture_close()
        small = attach(runner, ring, "off", budget=None)  # re-attach on the same ring: direct, un-accounted
        small.speculators_capture_close()
        tight = StandInWorker(runner, budget=3 * GIB)  # 896 MiB of staging > a quarter of ~3 GiB
        tight.speculators_capture_attach(worker_setup(LAYERS, ring.spec))
        info = tight._speculators_capture.copy_info
        print(f"\nfallback: {info}")
        assert info["copy_path"] == "direct" and not info["staging"]["staged"]
        assert "more than 25% of the" in info["staging"]["reason"]
        check_and_report(
            "ring (local, direct by fallback)",
            runner,
            *run_steps(runner, tight, ring, STEP_ROWS[:4]),
            rows_plan=STEP_ROWS[:4],
        )
        tight.speculators_capture_close()
    finally:
        ring.close()


# -- release -------------------------------------------------------------------------------------


def test_two_capture_setups_in_one_process_release_their_registration(runner):
    """Set up, capture, close, twice (and re-attach, and drop a worker): the registration is gone each time."""
    for round_ in range(2):
        ring = make_ring(shared=False)
        buffer, nbytes = ring.buffer, ring.spec.total_bytes
        assert not buffer.is_pinned()
        allocated = torch.cuda.memory_allocated()
        worker = attach(runner, ring, "auto")  # round 2: maybe the addresses round 1 registered
        assert torch.cuda.memory_allocated() - allocated == 2 * STEP_BYTES + PROOF_SUMS_BYTES  # the staging
        assert buffer.is_pinned()  # the check sees a live registration
        check_and_report(
            f"set-up {round_ + 1}", runner, *run_steps(runner, worker, ring, STEP_ROWS[:3]), rows_plan=STEP_ROWS[:3]
        )
        worker.speculators_capture_attach(worker_setup(LAYERS, ring.spec, "auto"))  # re-attach: no 712
        assert buffer.is_pinned()
        held = torch.cuda.memory_allocated()
        worker.speculators_capture_close()
        assert not buffer.is_pinned()  # gone after close...
        assert register_code(buffer, nbytes) == 0  # ...and the driver takes the range again
        assert held - torch.cuda.memory_allocated() == 2 * STEP_BYTES + PROOF_SUMS_BYTES  # staging released
        dropped = attach(runner, ring, "off")
        assert buffer.is_pinned()
        del dropped
        gc.collect()
        assert not buffer.is_pinned()  # the dropped worker's mapping unregistered itself
        ring.close()
        del buffer  # the next round's ring may be mapped at the same addresses


# -- the real cadence ----------------------------------------------------------------------------


def calibrate_repeats() -> int:
    """Matmuls per layer that make the 4-layer forward last about FORWARD_TARGET_S."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(DTYPE)
    w = torch.randn(HIDDEN, HIDDEN, device="cuda", generator=gen).to(DTYPE) / HIDDEN**0.5
    for _ in range(3):
        torch.tanh(x @ w) + x
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        torch.tanh(x @ w) + x
    end.record()
    end.synchronize()
    one = start.elapsed_time(end) / 1000 / 20
    return max(1, math.ceil(FORWARD_TARGET_S / (LAYERS * one)))


def cadence_run(runner, worker, ring, inputs, offset, rows_plan, take):
    """Steps as vLLM drives them: replay k, capture k (no sync before), retire k-1; ``take(capture)`` copies
    each reply out of its slot (as the engine does) before the slot is released. ``worker`` None: no capture."""
    steps = len(rows_plan)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    done = [torch.cuda.Event() for _ in range(steps)]
    host, retire, copy_out, consumed = [], [], [], {}

    def consume(capture):
        if capture is None:
            return
        t0 = time.perf_counter()
        take(capture)
        ring.release(capture.slot)
        consumed[capture.step] = sum(capture.counts)
        copy_out.append(time.perf_counter() - t0)

    torch.cuda.synchronize()
    for k, rows in enumerate(rows_plan):
        starts[k].record()
        runner.step(inputs[(k + offset) % len(inputs)], rows)
        previous = None
        if worker is not None:
            slot = ring.acquire()
            t0 = time.perf_counter()
            previous = worker.speculators_capture_step(k, slot)
            host.append(time.perf_counter() - t0)
        done[k].record()
        consume(previous)
        t0 = time.perf_counter()
        if k >= 1:
            done[k - 1].synchronize()  # the engine retires step k-1 before it launches step k+1
        retire.append(time.perf_counter() - t0)
    if worker is not None:
        consume(worker.speculators_capture_flush())
    torch.cuda.synchronize()
    return starts, {"call": host, "retire": retire, "copy_out": copy_out}, consumed


def test_capture_at_the_real_cadence():
    """No sync before the capture, two steps in flight, >= 30 ms forwards: every step exact; GPU time per step."""
    runner = StandInRunner(calibrate_repeats())
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = [torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(DTYPE) for _ in range(NUM_INPUTS)]
    expected = [torch.stack(runner.forward(x)) for x in inputs]  # eager recompute, [layers, tokens, hidden]
    rows_plan = WARMUP_ROWS + [TOKENS] * (TIMED_STEPS + 1)
    timed = range(len(WARMUP_ROWS), len(WARMUP_ROWS) + TIMED_STEPS)
    store = torch.empty((len(rows_plan), LAYERS, TOKENS, HIDDEN), dtype=DTYPE)
    store.view(torch.int16).fill_(-1)  # NaN everywhere, and every page touched before the timed runs
    ring = make_ring(shared=False)
    results = []
    try:
        for offset, mode in enumerate(CADENCE_MODES):
            worker = attach(runner, ring, "auto" if mode == "staged" else "off") if mode != "none" else None
            try:

                def take(capture):
                    total = sum(capture.counts)
                    store[capture.step][:, :total].copy_(ring.slot(capture.slot)[:, :total])

                starts, host, consumed = cadence_run(runner, worker, ring, inputs, offset, rows_plan, take)
            finally:
                if worker is not None:
                    worker.speculators_capture_close()
            per_step = [starts[k].elapsed_time(starts[k + 1]) for k in timed]
            window = starts[timed[0]].elapsed_time(starts[timed[-1] + 1])  # ms, on the compute stream
            row = {
                "mode": mode,
                "gpu_ms_per_step": window / TIMED_STEPS,
                "gpu_ms_median": statistics.median(per_step),
                "gpu_ms_max": max(per_step),
            }
            row["retire_ms_median"] = statistics.median(host["retire"][k] * 1000 for k in timed)
            if mode != "none":
                calls = sorted(host["call"][k] * 1000 for k in timed)
                copy_out = statistics.median(host["copy_out"][k] * 1000 for k in timed)
                exact = sum(
                    torch.equal(store[k][:, :rows].cuda(), expected[(k + offset) % NUM_INPUTS][:, :rows])
                    for k, rows in enumerate(rows_plan)
                    if consumed.get(k) == rows
                )
                row.update(
                    host_ms_median=statistics.median(calls),
                    host_ms_p90=calls[int(0.9 * len(calls))],
                    host_ms_max=calls[-1],
                    copy_out_ms_median=copy_out,
                    exact=exact,
                    steps=len(rows_plan),
                )
            results.append(row)
    finally:
        ring.close()
    base = statistics.mean(r["gpu_ms_per_step"] for r in results if r["mode"] == "none")
    print(
        f"\nreal cadence: {runner.repeats} matmuls per layer, {STEP_BYTES / 2**20:.0f} MiB steps, "
        f"{TIMED_STEPS} timed steps per run after {len(WARMUP_ROWS)} mixed ones"
    )
    print(
        "GPU: ms per step on the compute stream (mean over the window, median, max step); host: ms per step, "
        "median (capture call: median, p90, max; retire: wait for step k-1; copy out: slot -> host memory)"
    )
    print(
        f"{'mode':8} {'GPU ms/step':>11} {'median':>7} {'max':>7} {'overhead':>9} {'retire':>7} "
        f"{'call':>7} {'p90':>6} {'max':>6} {'copy out':>8} {'exact':>7}"
    )
    for r in results:
        r["overhead"] = r["gpu_ms_per_step"] / base - 1
        line = (
            f"{r['mode']:8} {r['gpu_ms_per_step']:11.2f} {r['gpu_ms_median']:7.2f} {r['gpu_ms_max']:7.2f} "
            f"{r['overhead']:+9.2%} {r['retire_ms_median']:7.2f}"
        )
        if r["mode"] != "none":
            line += (
                f" {r['host_ms_median']:7.2f} {r['host_ms_p90']:6.2f} {r['host_ms_max']:6.2f} "
                f"{r['copy_out_ms_median']:8.2f} {r['exact']:>3}/{r['steps']}"
            )
        print(line)
    save_figures("cadence", {"repeats": runner.repeats, "runs": results})
    for r in results:
        if r["mode"] != "none":
            assert r["exact"] == r["steps"], r
    assert base >= 30, f"the stand-in forward takes {base:.1f} ms, not >= 30 ms"
    staged = max(r["gpu_ms_per_step"] for r in results if r["mode"] == "staged")
    direct = min(r["gpu_ms_per_step"] for r in results if r["mode"] == "direct")
    assert staged < direct, "the staged copy should leave the compute stream (less GPU time per step)"
