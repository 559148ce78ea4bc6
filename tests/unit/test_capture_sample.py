"""Capture and sampling in one RPC: the worker's order and reply, and which executors use it (fakes, CPU)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from test_ring_registration import Runner, Worker

from helpers.capture import worker_setup
from speculators_v016.engine.executor import capture_executor
from speculators_v016.protocol import CaptureConfig
from speculators_v016.shared.slot_ring import SlotRing

vllm_outputs = pytest.importorskip("vllm.v1.outputs")


class AsyncOut(vllm_outputs.AsyncModelRunnerOutput):
    """vLLM's async output as the runner returns it with async scheduling (counts its get_output calls)."""

    def __init__(self, value):
        self.value, self.calls = value, 0

    def get_output(self):
        self.calls += 1
        return self.value


class SamplingWorker(Worker):
    """The fake worker, with vLLM's ``sample_tokens``: it records what the ring's slot 0 held when it ran."""

    def __init__(self, runner, ring, outputs):
        super().__init__(runner)
        self.ring, self.outputs, self.seen = ring, list(outputs), []

    def sample_tokens(self, grammar_output):
        self.seen.append((grammar_output, self.ring.slot(0)[:, :6].clone()))
        return self.outputs.pop(0)


@pytest.fixture
def ring():
    ring = SlotRing.create(slots=3, num_ids=2, max_rows=8, hidden=4, dtype=torch.float32, shared=False)
    yield ring
    ring.close()


def test_capture_runs_before_sampling_and_the_reply_pairs_output_with_the_previous_capture(ring):
    """The step is in its slot before sample_tokens runs; the reply is vLLM's async output (model output, previous capture)."""
    runner = Runner("cpu")
    first, second = AsyncOut("out-1"), "out-2"  # async scheduling's output, then a plain one (sync)
    worker = SamplingWorker(runner, ring, [first, second])
    worker.speculators_capture_attach(worker_setup(2, ring.spec))
    aux = runner.step(6, seed=1)
    reply = worker.speculators_capture_sample(1, 0, "grammar-1")
    assert isinstance(reply, vllm_outputs.AsyncModelRunnerOutput)  # vLLM's executors call get_output
    assert worker.seen[0][0] == "grammar-1"
    assert torch.equal(worker.seen[0][1], torch.stack([a[:6] for a in aux]))  # captured, then sampled
    assert first.calls == 0  # nothing waited for in the RPC itself
    assert reply.get_output() == ("out-1", None) and first.calls == 1
    runner.step(8, seed=2)
    output, capture = worker.speculators_capture_sample(2, 1, None).get_output()
    assert output == "out-2"
    assert (capture.step, capture.slot, capture.counts) == (1, 0, [3, 3])
    assert worker.speculators_capture_flush().step == 2


def test_a_closed_capture_refuses_before_sampling(ring):
    """After close, capture-and-sample raises naming the step, and vLLM's sample_tokens is not reached."""
    worker = SamplingWorker(Runner("cpu"), ring, ["never"])
    worker.speculators_capture_attach(worker_setup(2, ring.spec))
    worker.speculators_capture_close()
    with pytest.raises(RuntimeError, match="step 4: the capture was closed"):
        worker.speculators_capture_sample(4, 0, None)
    assert worker.seen == []


def test_a_slot_still_held_is_refused_before_sampling(ring):
    """Reusing the slot of the pending step is an error naming both steps; nothing is sampled."""
    runner = Runner("cpu")
    worker = SamplingWorker(runner, ring, ["out-1", "never"])
    worker.speculators_capture_attach(worker_setup(2, ring.spec))
    runner.step(4, seed=1)
    worker.speculators_capture_sample(1, 0, None)
    with pytest.raises(RuntimeError, match="step 2: slot 0 still holds step 1"):
        worker.speculators_capture_sample(2, 0, None)
    assert len(worker.seen) == 1


def done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def fake_executor(name: str, aggregator=None):
    """A stand-in for one of vLLM's executor classes (the kind is read from its class name): records its RPCs."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, **options):
        self.calls.append((method, args, options))
        reply = (
            (f"sampled {args[2]}", f"capture before {args[0]}")
            if method == "speculators_capture_sample"
            else f"capture before {args[0]}"
        )
        return done([reply] if "unique_reply_rank" not in options else reply)

    def sample_tokens(self, grammar_output, non_block=False):
        self.calls.append(("sample_tokens", (grammar_output,), {}))
        return done(f"sampled {grammar_output}")

    base = type(name, (), {"collective_rpc": collective_rpc, "sample_tokens": sample_tokens})
    executor = capture_executor(base, CaptureConfig((0,)), None)()
    executor.calls, executor.kv_output_aggregator = [], aggregator
    if name == "MultiprocExecutor":
        executor.output_rank = 0
    return executor


@pytest.mark.parametrize("name", ["UniProcExecutor", "MultiprocExecutor"])
def test_uni_and_mp_executors_capture_and_sample_in_one_rpc(name):
    """With vLLM's uniprocess and multiprocess executors a step's capture and sampling are one RPC (mp: one rank replies)."""
    executor = fake_executor(name)
    future = executor.capture_and_sample(5, 1, "g")
    assert future.result() == ("sampled g", "capture before 5")
    assert [(m, a) for m, a, _ in executor.calls] == [("speculators_capture_sample", (5, 1, "g"))]
    assert ("unique_reply_rank" in executor.calls[0][2]) == (name == "MultiprocExecutor")


@pytest.mark.parametrize("name, aggregator", [("RayDistributedExecutor", None), ("MultiprocExecutor", object())])
def test_other_executors_capture_then_sample_in_two_rpcs(name, aggregator):
    """Ray (and mp with a KV connector's aggregator) get the capture RPC first, then vLLM's own sample_tokens."""
    executor = fake_executor(name, aggregator)
    future = executor.capture_and_sample(5, 1, "g")
    assert future.done() and future.result() == ("sampled g", "capture before 5")
    assert [m for m, _, _ in executor.calls] == ["speculators_capture_step", "sample_tokens"]
