"""The ring's pinned registration is undone on close, on re-attach and when a mapping is dropped (CPU, fake CUDA).

A fake of the CUDA runtime's ``cudaHostRegister``/``cudaHostUnregister``
keeps the registered ranges and, like the driver, refuses to register a range
twice (error 712, ``cudaErrorHostMemoryAlreadyRegistered``). The GPU tier
(tests/gpu/test_capture_cuda.py) runs the same paths against the real runtime.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.capture import worker_setup
from speculators_v016.shared.slot_ring import SlotRing
from speculators_v016.worker.capture import CaptureWorkerExtension

ALREADY_REGISTERED, NOT_REGISTERED = 712, 713


class FakeCudart:
    def __init__(self):
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.fail_unregister = False

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr))
        if ptr in self.registered:
            return ALREADY_REGISTERED
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        if self.fail_unregister or ptr not in self.registered:
            return NOT_REGISTERED
        del self.registered[ptr]
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@pytest.fixture
def ring():
    ring = SlotRing.create(slots=3, num_ids=2, max_rows=8, hidden=4, dtype=torch.float32, shared=False)
    yield ring
    ring.close()


class Runner:
    """What the capture reads of vLLM's model runner: a 2-request batch of ``rows`` tokens, aux on CPU."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.model_memory_usage = 1000
        self.execute_model_state = self.input_batch = self.query_start_loc = None

    def step(self, rows: int, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        aux = [torch.randn(8, 4, generator=gen) for _ in range(2)]
        self.execute_model_state = SimpleNamespace(aux_hidden_states=aux)
        self.input_batch = SimpleNamespace(
            num_reqs=2, req_ids=["a", "b"], num_computed_tokens_cpu=np.zeros(2, dtype=np.int64), generators={}
        )
        self.discard_request_mask = SimpleNamespace(np=np.zeros(2, dtype=bool))  # no partial prefill
        self.query_start_loc = SimpleNamespace(np=np.array([0, rows // 2, rows], dtype=np.int32))
        return aux


class Worker(CaptureWorkerExtension):
    def __init__(self, runner):
        self.model_runner, self.rank = runner, 0


def test_close_unregisters_and_a_second_mapping_can_register_again(cudart, ring):
    """Two mappings of one ring: the second registers only after the first closed (the driver's rule)."""
    first = SlotRing.attach(ring.spec)
    first.pin()
    first.pin()  # once
    assert first.pinned and list(cudart.registered) == [ring.buffer.data_ptr()]
    second = SlotRing.attach(ring.spec)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of the capture ring \(3 slots .*\) failed: 712"):
        second.pin()  # the fault a re-attach without unregistering ran into
    first.close()
    assert not first.pinned and cudart.registered == {}
    second.pin()
    second.close()
    assert cudart.registered == {}
    assert cudart.calls.count(("unregister", ring.buffer.data_ptr())) == 2


def test_a_dropped_mapping_unregisters_before_its_memory_can_go(cudart, ring):
    """A pinned mapping dropped without close is unregistered by its finalizer (also run at exit)."""
    mapping = SlotRing.attach(ring.spec)
    mapping.pin()
    del mapping
    gc.collect()
    assert cudart.registered == {}


def test_close_reports_a_failed_unregister(cudart, ring):
    """An unregister the runtime refuses is an error naming the ring, not silence."""
    mapping = SlotRing.attach(ring.spec)
    mapping.pin()
    cudart.fail_unregister = True
    with pytest.raises(RuntimeError, match=r"cudaHostUnregister of the capture ring \(3 slots .*\) failed: 713"):
        mapping.close()
    assert not mapping.pinned  # not tried twice (the finalizer is spent)


def test_worker_reattach_and_close_release_the_registration(cudart, ring):
    """On a (fake) GPU worker: re-attach unregisters before registering again; close leaves nothing registered."""
    worker = Worker(Runner("cuda"))
    worker.speculators_capture_attach(worker_setup(2, ring.spec, staging="off"))
    assert worker._speculators_capture.copy_info["copy_path"] == "direct"
    assert worker._speculators_capture.copy_info["staging"]["reason"] == "staging turned off: direct copies"
    assert worker.model_runner.model_memory_usage == 1000  # nothing staged, nothing accounted
    worker.speculators_capture_attach(worker_setup(2, ring.spec, staging="off"))  # no 712
    assert [c for c, _ in cudart.calls] == ["register", "unregister", "register"]
    worker.speculators_capture_close()
    worker.speculators_capture_close()  # idempotent
    assert cudart.registered == {} and worker._speculators_capture.ring is None
    with pytest.raises(RuntimeError, match="step 1: the capture was closed"):
        worker.speculators_capture_step(1, 0)


def test_cpu_worker_captures_then_closes_then_attaches_again(ring):
    """A CPU worker's capture is unchanged (host copy, exact rows); after close it refuses steps until re-attached."""
    runner = Runner("cpu")
    worker = Worker(runner)
    worker.speculators_capture_attach(worker_setup(2, ring.spec))
    assert worker._speculators_capture.copy_info == {"copy_path": "host"}
    aux = runner.step(6, seed=1)
    assert worker.speculators_capture_step(1, 0) is None
    runner.step(8, seed=2)
    capture = worker.speculators_capture_step(2, 1)
    assert (capture.step, capture.slot, capture.counts) == (1, 0, [3, 3])
    assert torch.equal(ring.slot(0)[:, :6], torch.stack([a[:6] for a in aux]))
    worker.speculators_capture_close()
    with pytest.raises(RuntimeError, match="step 3: the capture was closed"):
        worker.speculators_capture_step(3, 2)
    worker.speculators_capture_attach(worker_setup(2, ring.spec))
    aux = runner.step(4, seed=3)
    worker.speculators_capture_step(3, 2)
    assert worker.speculators_capture_flush().step == 3
    assert torch.equal(ring.slot(2)[:, :4], torch.stack([a[:4] for a in aux]))
