"""The worker's capture on a GPU: CUDA-graph outputs copied straight into pinned ring slots.

vLLM cannot run where the GPUs are lent, so a small stand-in for vLLM's model
runner drives :class:`~speculators_v016.worker.capture.CaptureWorkerExtension`: a
CUDA graph whose aux outputs are overwritten at every replay, as vLLM's graphs
reuse their buffers. Every captured step must equal an eager recompute bit for
bit (no row of the next step, no torn copy). The test prints host time per
capture call and the copy's GiB/s for 448 MiB steps (8192 tokens x 4 layers x
hidden 7168, bf16), against the path without a ring (a fresh pinned tensor per
step). Skips without CUDA.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speculators_v016.worker.capture import CaptureWorkerExtension
from speculators_v016.engine.slot_ring import RingSpaceError, SlotRing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, LAYERS, HIDDEN, DTYPE = 8192, 4, 7168, torch.bfloat16
STEP_ROWS = [8192, 5000, 8192, 37, 8192, 6144, 8192, 8192, 1, 8192, 8192, 8192]


class StandInRunner:
    """What the capture reads of vLLM's GPU model runner, fed by a CUDA graph."""

    def __init__(self):
        self.device = torch.device("cuda")
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.weights = [torch.randn(HIDDEN, HIDDEN, device="cuda", generator=gen).to(DTYPE) / HIDDEN**0.5
                        for _ in range(LAYERS)]
        self.static_input = torch.zeros(TOKENS, HIDDEN, device="cuda", dtype=DTYPE)
        for _ in range(2):  # warm up kernels on a side stream before capture, as CUDA graphs need
            self.forward(self.static_input)
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
            hidden = torch.tanh(hidden @ weight) + hidden
            aux.append(hidden)
        return aux

    def step(self, inputs: torch.Tensor, rows: int) -> None:
        """Replay the graph on ``inputs``; expose its outputs and a 3-request batch of ``rows`` tokens."""
        self.static_input.copy_(inputs)
        self.graph.replay()
        self.execute_model_state = SimpleNamespace(aux_hidden_states=self.static_aux)
        cut = sorted({0, rows // 3, (2 * rows) // 3, rows})
        self.input_batch = SimpleNamespace(num_reqs=len(cut) - 1, req_ids=[f"r{i}" for i in range(len(cut) - 1)],
                                           num_computed_tokens_cpu=np.zeros(len(cut) - 1, dtype=np.int64))
        self.query_start_loc = SimpleNamespace(np=np.array(cut, dtype=np.int32))


class StandInWorker(CaptureWorkerExtension):
    def __init__(self, runner):
        self.model_runner, self.rank = runner, 0


def make_ring(shared: bool) -> SlotRing:
    return SlotRing.create(slots=3, num_ids=LAYERS, max_rows=TOKENS, hidden=HIDDEN, dtype=DTYPE, shared=shared)


def run_steps(runner, worker, ring):
    """Drive the steps as the engine does; return per-step captured rows, host times, copy seconds."""
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

    for step, rows in enumerate(STEP_ROWS, 1):
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
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / 1000)
        consume(previous)
    consume(worker.speculators_capture_flush())
    return inputs, captured, host, gpu


def check_and_report(label, runner, inputs, captured, host, gpu):
    assert sorted(captured) == list(range(1, len(STEP_ROWS) + 1))
    for step, (x, rows) in enumerate(zip(inputs, STEP_ROWS), 1):
        expected = runner.forward(x)
        for layer in range(LAYERS):
            assert torch.equal(captured[step][layer].cuda(), expected[layer][:rows]), (label, step, layer)
    full = [i for i, rows in enumerate(STEP_ROWS) if rows == TOKENS][1:]  # 448 MiB steps, after the first
    nbytes = TOKENS * LAYERS * HIDDEN * 2
    host_ms = statistics.median(host[i] for i in full) * 1000
    rate = nbytes / statistics.median(gpu[i] for i in full) / 2**30
    print(f"\n{label}: {nbytes / 2**20:.0f} MiB steps: host time per capture call {host_ms:.2f} ms "
          f"(max {max(host[i] for i in full) * 1000:.2f}), copy {rate:.1f} GiB/s")
    return host_ms, rate


@pytest.fixture(scope="module")
def runner():
    return StandInRunner()


@pytest.mark.parametrize("shared", [False, True], ids=["local-ring", "shm-ring"])
def test_ring_capture_is_exact_and_fast(runner, shared):
    """Every step equals an eager recompute bit for bit; 448 MiB steps copy at >= 30 GiB/s, < 15 ms host."""
    try:
        ring = make_ring(shared)
    except RingSpaceError as exc:
        pytest.skip(f"/dev/shm too small here for the shared ring: {exc}")
    worker = StandInWorker(runner)
    worker.speculators_capture_attach(LAYERS, True, ring.spec)
    assert worker._speculators_ring._pinned
    try:
        host_ms, rate = check_and_report(f"ring ({'shm' if shared else 'local'})", runner,
                                         *run_steps(runner, worker, ring))
    finally:
        worker._speculators_ring.close()
        ring.close()
    assert rate >= 30 and host_ms < 15


def test_without_ring_reference(runner):
    """The path without a ring (fresh pinned tensor per step) is exact too; its figures are printed."""
    worker = StandInWorker(runner)
    worker.speculators_capture_attach(LAYERS, True, None)
    check_and_report("no ring (fresh pinned tensors)", runner, *run_steps(runner, worker, None))
