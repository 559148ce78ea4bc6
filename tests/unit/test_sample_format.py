"""Sample files: streamed safetensors written from the tensors' memory, read back exactly."""

import json
import struct

import blake3
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from speculators_v016 import fp8
from speculators_v016.fp8 import Fp8States
from speculators_v016.store.atomic_files import write_atomic
from speculators_v016.store.sample_format import DATA_ALIGN, FORMAT_TAG, encode_parts, load_sample, safetensors_parts


def sample(dtype, length=7, hidden=5, layers=3):
    gen = torch.Generator().manual_seed(3)
    return {
        "input_ids": torch.arange(length),
        "loss_mask": torch.tensor([0, 1] * (length // 2) + [1]),
        "hidden_states": [torch.randn(length, hidden, generator=gen).to(dtype) for _ in range(layers)],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_streamed_safetensors_reads_back_exactly(tmp_path, dtype):
    """A file written part by part loads with safetensors itself, bit for bit, with our metadata."""
    data = sample(dtype)
    size, digest = write_atomic(tmp_path, "data_0.safetensors", encode_parts(data, "safetensors", [2, 4, 7]))
    raw = (tmp_path / "data_0.safetensors").read_bytes()
    assert size == len(raw) and digest == blake3.blake3(raw).hexdigest()
    loaded = load_file(str(tmp_path / "data_0.safetensors"))
    assert torch.equal(loaded["input_ids"], data["input_ids"])
    for j, h in enumerate(data["hidden_states"]):
        assert loaded[f"hidden_states.{j}"].dtype == dtype and torch.equal(loaded[f"hidden_states.{j}"], h)

    with safe_open(str(tmp_path / "data_0.safetensors"), "pt") as fh:
        assert fh.metadata() == {"format": FORMAT_TAG, "layer_ids": "2,4,7"}
    assert torch.equal(load_sample(tmp_path / "data_0.safetensors")["loss_mask"], data["loss_mask"])


def test_safetensors_parts_are_the_tensors_own_memory():
    """No serialization copy: the buffers handed to the writer alias the hidden-state tensors."""
    data = sample(torch.float32)
    parts = encode_parts(data, "safetensors", [0, 1, 2])
    data["hidden_states"][1][0, 0] = 123.0
    assert torch.frombuffer(parts[2], dtype=torch.float32)[0].item() == 123.0  # the states first, in order


def test_safetensors_data_starts_on_a_block_states_first(tmp_path):
    """The header is padded (with spaces) so the data starts at a multiple of DATA_ALIGN; the states lead it."""
    data = sample(torch.bfloat16)
    parts = encode_parts(data, "safetensors", [0, 1, 2])
    assert len(parts[0]) % DATA_ALIGN == 0 and parts[0].rstrip(b" ").endswith(b"}")
    header = json.loads(parts[0][8:])
    starts = {name: v["data_offsets"][0] for name, v in header.items() if name != "__metadata__"}
    assert sorted(starts, key=starts.get) == ["hidden_states.0", "hidden_states.1", "hidden_states.2", "input_ids",
                                              "loss_mask"]  # fmt: skip
    write_atomic(tmp_path, "data_0.safetensors", parts)
    back = load_sample(tmp_path / "data_0.safetensors")  # safetensors' own reader takes the padding
    assert all(torch.equal(a, b) for a, b in zip(back["hidden_states"], data["hidden_states"]))


def test_pt_format_is_upstreams_layout(tmp_path):
    """--format pt stays upstream's torch.save dict, read back with weights_only."""
    data = sample(torch.bfloat16)
    write_atomic(tmp_path, "data_1.pt", encode_parts(data, "pt", [0, 1, 2]))
    loaded = torch.load(tmp_path / "data_1.pt", weights_only=True)
    assert set(loaded) == {"input_ids", "hidden_states", "loss_mask"}
    assert all(torch.equal(a, b) for a, b in zip(loaded["hidden_states"], data["hidden_states"]))


def fp8_sample(length=7, hidden=16, layers=3):
    data = sample(torch.bfloat16, length, hidden, layers)
    data["hidden_states"] = [fp8.Fp8States(*fp8.quantize(h)) for h in data["hidden_states"]]
    return data


def test_fp8_safetensors_holds_codes_scales_and_says_so(tmp_path):
    """FP8 files hold F8_E4M3 codes and F32 scales per layer; the metadata names them; load_sample dequantizes."""
    data = fp8_sample()
    write_atomic(tmp_path, "data_0.safetensors", encode_parts(data, "safetensors", [2, 4, 7]))
    raw = (tmp_path / "data_0.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["hidden_states.1"]["dtype"] == "F8_E4M3" and header["hidden_states.1"]["shape"] == [7, 16]
    assert header["hidden_states_scale.1"]["dtype"] == "F32" and header["hidden_states_scale.1"]["shape"] == [7]
    with safe_open(str(tmp_path / "data_0.safetensors"), "pt") as fh:
        meta = fh.metadata()
    assert meta["hidden_states_dtype"] == "fp8_e4m3" and "amax/448" in meta["hidden_states_scaling"]
    loaded = load_file(str(tmp_path / "data_0.safetensors"))  # safetensors itself reads it
    assert loaded["hidden_states.0"].dtype == torch.float8_e4m3fn
    plain = load_sample(tmp_path / "data_0.safetensors")
    half = load_sample(tmp_path / "data_0.safetensors", dequantize_to=torch.bfloat16)
    kept = load_sample(tmp_path / "data_0.safetensors", dequantize_to=None)
    for j, h in enumerate(data["hidden_states"]):
        assert plain["hidden_states"][j].dtype == torch.float32 and torch.equal(
            plain["hidden_states"][j], h.dequantize()
        )
        assert half["hidden_states"][j].dtype == torch.bfloat16
        assert isinstance(kept["hidden_states"][j], Fp8States)
        assert torch.equal(kept["hidden_states"][j].codes.view(torch.uint8), h.codes.view(torch.uint8))


def test_fp8_is_refused_as_pt_and_mixed(tmp_path):
    """FP8 states cannot be written as .pt (stock readers would misread codes), nor mixed with plain layers."""
    data = fp8_sample()
    with pytest.raises(ValueError, match="FP8 hidden states cannot be stored as .pt"):
        encode_parts(data, "pt", [0, 1, 2])
    data["hidden_states"][1] = torch.zeros(7, 16)
    with pytest.raises(ValueError, match="mixes FP8 and unquantized layers"):
        encode_parts(data, "safetensors", [0, 1, 2])


def test_fp8_file_without_its_scales_is_refused(tmp_path):
    """Codes without scales, or scales of the wrong length, are an error naming the file, never raw codes."""
    data = fp8_sample(layers=2)
    codes = {f"hidden_states.{j}": h.codes for j, h in enumerate(data["hidden_states"])}
    base = {"input_ids": data["input_ids"], "loss_mask": data["loss_mask"]}
    write_atomic(tmp_path, "data_1.safetensors", safetensors_parts({**base, **codes}, {}))
    with pytest.raises(
        ValueError,
        match=r"data_1.safetensors: FP8 file with 2 hidden_states .* and 0 "
        r"hidden_states_scale",
    ):
        load_sample(tmp_path / "data_1.safetensors")
    short = {"hidden_states_scale.0": torch.ones(6), "hidden_states_scale.1": torch.ones(7)}
    write_atomic(tmp_path, "data_2.safetensors", safetensors_parts({**base, **codes, **short}, {}))
    with pytest.raises(
        ValueError,
        match=r"data_2.safetensors: hidden_states_scale.0 is \(6,\) torch.float32, "
        r"expected \[7\] float32",
    ):
        load_sample(tmp_path / "data_2.safetensors")
