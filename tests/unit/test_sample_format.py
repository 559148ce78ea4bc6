"""Sample files: streamed safetensors written from the tensors' memory, read back exactly."""

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from speculators_v016.store.atomic_files import write_atomic
from speculators_v016.store.sample_format import FORMAT_TAG, encode_parts, load_sample


def sample(dtype, length=7, hidden=5, layers=3):
    gen = torch.Generator().manual_seed(3)
    return {"input_ids": torch.arange(length), "loss_mask": torch.tensor([0, 1] * (length // 2) + [1]),
            "hidden_states": [torch.randn(length, hidden, generator=gen).to(dtype) for _ in range(layers)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streamed_safetensors_reads_back_exactly(tmp_path, dtype):
    """A file written part by part loads with safetensors itself, bit for bit, with our metadata."""
    data = sample(dtype)
    size, sha = write_atomic(tmp_path, "data_0.safetensors", encode_parts(data, "safetensors", [2, 4, 7]))
    raw = (tmp_path / "data_0.safetensors").read_bytes()
    assert size == len(raw) and sha == hashlib.sha256(raw).hexdigest()
    loaded = load_file(str(tmp_path / "data_0.safetensors"))
    assert torch.equal(loaded["input_ids"], data["input_ids"])
    for j, h in enumerate(data["hidden_states"]):
        assert loaded[f"hidden_states.{j}"].dtype == dtype and torch.equal(loaded[f"hidden_states.{j}"], h)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "data_0.safetensors"), "pt") as fh:
        assert fh.metadata() == {"format": FORMAT_TAG, "layer_ids": "2,4,7"}
    assert torch.equal(load_sample(tmp_path / "data_0.safetensors")["loss_mask"], data["loss_mask"])


def test_safetensors_parts_are_the_tensors_own_memory():
    """No serialization copy: the buffers handed to the writer alias the hidden-state tensors."""
    data = sample(torch.float32)
    parts = encode_parts(data, "safetensors", [0, 1, 2])
    data["hidden_states"][1][0, 0] = 123.0
    assert torch.frombuffer(parts[4], dtype=torch.float32)[0].item() == 123.0


def test_pt_format_is_upstreams_layout(tmp_path):
    """--format pt stays upstream's torch.save dict, read back with weights_only."""
    data = sample(torch.bfloat16)
    write_atomic(tmp_path, "data_1.pt", encode_parts(data, "pt", [0, 1, 2]))
    loaded = torch.load(tmp_path / "data_1.pt", weights_only=True)
    assert set(loaded) == {"input_ids", "hidden_states", "loss_mask"}
    assert all(torch.equal(a, b) for a, b in zip(loaded["hidden_states"], data["hidden_states"]))
