"""What crosses to the workers is one WorkerSetup, sent once; the worker keeps one capture object (CPU, fakes)."""

from __future__ import annotations

import gc
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_ring_registration import Runner, Worker, cudart  # noqa: F401 - cudart is a fixture

from helpers.capture import worker_setup
from speculators_v016.engine.executor import capture_executor
from speculators_v016.protocol import CaptureConfig, WorkerSetup
from speculators_v016.shared import exit_gc
from speculators_v016.shared.slot_ring import SlotRing
from speculators_v016.worker.capture import (
    DirectCopy,
    DirectQuantize,
    HostCopy,
    HostQuantize,
    Reference,
    freeze_at_exit_if_apart,
)


@pytest.fixture
def ring():
    ring = SlotRing.create(slots=3, num_ids=2, max_rows=8, hidden=4, dtype=torch.float32, shared=False)
    yield ring
    ring.close()


def setup_executor(name: str, ring, capture: CaptureConfig, world_size: int = 2):
    """A stand-in for one of vLLM's executor classes, set up as vLLM's engine core does: records its RPCs."""

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, **options):
        self.calls.append((method, args, kwargs))
        return [{"num_layers": 2}] * world_size  # each rank's set-up info

    def init(self):
        self.vllm_config = SimpleNamespace(
            parallel_config=SimpleNamespace(
                world_size=world_size, tensor_parallel_size=world_size, pipeline_parallel_size=1
            ),
            additional_config={},  # what vLLM hashes; the set-up does not read it
        )

    base = type(name, (), {"collective_rpc": collective_rpc, "_init_executor": init})
    executor = capture_executor(base, capture, ring)()
    executor.calls = []
    executor._init_executor()
    return executor


def test_the_setup_rpc_sends_one_worker_setup_with_the_capture_the_rank_and_the_ring(ring):
    """One RPC, one argument: the engine's CaptureConfig, the output rank and the ring's spec, as one object."""
    capture = CaptureConfig((3, 9), "taps", "auto")
    executor = setup_executor("UniProcExecutor", ring, capture)
    setup = WorkerSetup(capture, 0, ring.spec, driver_pid=os.getpid())
    assert executor.calls == [("speculators_capture_setup", (setup,), None)]
    assert executor.capture_info == [{"num_layers": 2}] * 2


def test_the_capture_config_is_vllms_additional_config_entry_as_before():
    """The compile-cache hash sees the same JSON as before the set-up object (the same keys and values)."""
    capture = CaptureConfig((3, 9), "auto", "fp8_e4m3")
    assert capture.as_dict() == {"capture_ids": [3, 9], "capture_mode": "auto", "hidden_states_dtype": "fp8_e4m3"}


@pytest.mark.parametrize(
    "dtype, rank, device, expected",
    [
        ("auto", 0, "cpu", HostCopy),
        ("fp8_e4m3", 0, "cpu", HostQuantize),
        ("auto", 1, "cpu", type(None)),
        ("auto", 0, "cuda", DirectCopy),
        ("fp8_e4m3", 0, "cuda", DirectQuantize),  # without the ring: its device buffer is grown on first use
    ],
)
def test_the_worker_holds_one_capture_whose_copy_path_is_chosen_at_setup(cudart, dtype, rank, device, expected):  # noqa: F811
    """One `_speculators_*` attribute on vLLM's worker; its copy path an object of the device and storage."""
    ring = SlotRing.create(
        slots=3, num_ids=2, max_rows=8, hidden=4, dtype=torch.float32, shared=False, hidden_states_dtype=dtype
    )
    try:
        worker = Worker(Runner(device))
        worker.rank = rank
        spec = None if (device, dtype) == ("cuda", "fp8_e4m3") else ring.spec  # no device memory to allocate here
        capture = worker.speculators_capture_attach(worker_setup(2, spec, staging="off", hidden_states_dtype=dtype))
        assert [k for k in vars(worker) if k.startswith("_speculators")] == ["_speculators_capture"]
        assert worker._speculators_capture is capture and type(capture.copier) is expected
        assert capture.is_output == (rank == 0) and capture.fp8 == (dtype == "fp8_e4m3")
        worker.speculators_capture_close()
    finally:
        ring.close()


def test_an_in_process_cpu_worker_hands_its_states_over_by_reference():
    """By reference (no ring): the copy path says so, and a step's states are the model's own tensors' rows."""
    runner = Runner("cpu")
    worker = Worker(runner)
    capture = worker.speculators_capture_attach(replace(worker_setup(2, None), by_reference=True))
    assert type(capture.copier) is Reference and capture.copy_info == {"copy_path": "reference"}
    aux = runner.step(6, seed=3)
    assert capture.advance(runner, 1, None) is None
    states = capture.flush().states
    assert [t.data_ptr() for t in states] == [a.data_ptr() for a in aux] and [len(t) for t in states] == [6, 6]


@pytest.mark.parametrize(
    "device, dtype, ring, refused",
    [
        ("cuda", "auto", False, "device cuda"),
        ("cpu", "fp8_e4m3", False, "'fp8_e4m3'"),
        ("cpu", "auto", True, "ring True"),
    ],
)
def test_states_by_reference_are_refused_off_an_in_process_cpu_engine(cudart, device, dtype, ring, refused):  # noqa: F811
    """By reference only on CPU, in the engine's dtype, without a ring: otherwise refused, naming what stands in the way."""
    made = SlotRing.create(slots=3, num_ids=2, max_rows=8, hidden=4, dtype=torch.float32, shared=False,
                           hidden_states_dtype=dtype)  # fmt: skip
    try:
        setup = worker_setup(2, made.spec if ring else None, staging="off", hidden_states_dtype=dtype)
        with pytest.raises(ValueError, match=rf"handed over by reference only by an in-process CPU engine.*{refused}"):
            Worker(Runner(device)).speculators_capture_attach(replace(setup, by_reference=True))
    finally:
        made.close()


def test_a_worker_apart_from_the_driving_process_freezes_its_objects_at_exit(monkeypatch):
    """A worker in another process than the engine's driver registers gc.freeze at exit; in the driver's, or
    where the driver is not said, nothing is registered (a library user's process keeps Python's own exit)."""
    calls = []
    monkeypatch.setattr(exit_gc.atexit, "register", calls.append)
    capture = CaptureConfig((3, 9), "taps", "auto")
    assert not freeze_at_exit_if_apart(WorkerSetup(capture, 0))
    assert not freeze_at_exit_if_apart(WorkerSetup(capture, 0, driver_pid=os.getpid()))
    assert calls == []
    assert freeze_at_exit_if_apart(WorkerSetup(capture, 0, driver_pid=os.getpid() + 1))
    assert calls == [gc.freeze]
