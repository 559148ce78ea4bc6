"""Engine start on a node shared with other runs: vLLM's rendezvous port taken under it."""

import socket
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from speculators_v016.engine.core import port_taken


@pytest.fixture
def held_port():
    """A port some other process listens on."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_port_taken_reads_torch_s_own_error(held_port):
    """torch's store failing on a port in use is recognised; other start errors are not."""
    with pytest.raises(Exception) as caught:
        TCPStore("127.0.0.1", held_port, is_master=True, timeout=timedelta(seconds=5))
    assert port_taken(caught.value)
    wrapped = RuntimeError("worker failed")
    wrapped.__cause__ = caught.value
    assert port_taken(wrapped)
    assert not port_taken(ValueError("The model's max seq len (4096) is larger than the KV cache"))


def test_a_taken_rendezvous_port_starts_again(model_dir, held_port, monkeypatch):
    """The port vLLM chose is taken before it binds it: the engine starts again on another and runs."""
    import vllm.v1.executor.uniproc_executor as uniproc  # noqa: PLC0415 - vLLM: slow to import, this test only
    from speculators.data_generation import (  # noqa: PLC0415 - upstream: slow to import, this test only
        VllmHiddenStatesGenerator,
    )

    real, calls = uniproc.get_open_port, []

    def first_one_taken():
        calls.append(1)
        return held_port if len(calls) == 1 else real()

    monkeypatch.setattr(uniproc, "get_open_port", first_one_taken)
    gen = VllmHiddenStatesGenerator(model_dir, layer_ids=[7], max_model_len=64, dtype="float32", enforce_eager=True)
    try:
        assert len(calls) == 2
        (result,) = gen.generate([[5, 6, 7, 8, 9]])
        assert result["hidden_states"][0].shape[0] == 5
    finally:
        gen.shutdown()
