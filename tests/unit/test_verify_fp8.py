"""`verify` on FP8 folders: codes, scales and shapes are checked, and each broken one is named."""

import hashlib

import torch
from safetensors.torch import load_file

from speculators_v016 import fp8
from speculators_v016.fp8 import Fp8States
from speculators_v016.store import run_config
from speculators_v016.store.atomic_files import write_atomic
from speculators_v016.store.manifest import Entry, Manifest
from speculators_v016.store.sample_format import safetensors_parts
from speculators_v016.store.verify import verify
from speculators_v016.store.writer import SampleWriter

HIDDEN, LAYERS = 32, 2


def fp8_states(length, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        Fp8States(*fp8.quantize(torch.randn(length, HIDDEN, generator=gen).to(torch.bfloat16))) for _ in range(LAYERS)
    ]


def write_folder(folder, samples, storage="fp8_e4m3"):
    """A folder as a run leaves it: the real writer, a manifest and data_config.json."""
    folder.mkdir()
    run_config.save(
        folder,
        {
            "model": {"hidden_size": HIDDEN},
            "speculators_v016": {
                "format": "safetensors",
                "layers": {"layer_ids": [1, 3]},
                "dtype": "bfloat16",
                "hidden_states_dtype": storage,
                "start_idx": 0,
                "dataset_samples": len(samples),
                "shard": {"index": 0, "count": 1, "samples": len(samples)},
                "fingerprint": {},
            },
        },
    )
    writer = SampleWriter(folder, "safetensors", [1, 3], workers=1)
    for index, states in enumerate(samples):
        length = states[0].shape[0]
        writer.put(
            index,
            {
                "input_ids": torch.arange(length),
                "loss_mask": torch.ones(length, dtype=torch.long),
                "hidden_states": states,
            },
        )
    writer.close()
    return folder


def test_fp8_folder_verifies(tmp_path):
    """Intact FP8 samples pass; a zero row (scale 1) is the quantizer's encoding, refused only as a zero row."""
    samples = [fp8_states(9, s) for s in range(3)]
    report = verify(write_folder(tmp_path / "out", samples))
    assert report.ok and report.samples == 3, report.problems
    samples[1][0].codes[4].zero_()
    samples[1][0].scales[4] = 1.0
    assert samples[1][0].problems() == []  # codes and scales as the quantizer makes them
    folder = write_folder(tmp_path / "zero-row", samples)
    assert verify(folder).problems == [  # no real model produces a row of zeros (issue 29)
        f"{folder}/data_1.safetensors: hidden_states[0] (layer 1): rows [4] (1 of 9) are all 0; no model produces "
        "this: the capture was broken"
    ]


def test_broken_codes_and_scales_are_named(tmp_path):
    """A zero, NaN or huge scale, a NaN code and a short scale vector each fail verify with their reason."""
    samples = [fp8_states(9, s) for s in range(5)]
    samples[0][1].scales[2] = 0.0
    samples[1][0].scales[3] = float("inf")
    samples[2][1].codes.view(torch.uint8)[5, 6] = 0x7F  # e4m3fn NaN
    samples[3][0].scales[0] = 3e38  # finite, but code * scale overflows float32
    samples[4][1] = Fp8States(samples[4][1].codes, samples[4][1].scales[:8])
    folder = write_folder(tmp_path / "out", samples)
    problems = verify(folder).problems
    assert problems == [
        f"{folder}/data_0.safetensors: hidden_states[1]: scales <= 0",
        f"{folder}/data_1.safetensors: hidden_states[0]: NaN or Inf scales",
        f"{folder}/data_2.safetensors: hidden_states[1]: NaN codes",
        f"{folder}/data_3.safetensors: hidden_states[0]: not finite once dequantized (a scale too large)",
        f"{folder}/data_4.safetensors: cannot be read safely (ValueError: {folder}/data_4.safetensors: "
        "hidden_states_scale.1 is (8,) torch.float32, expected [9] float32)",
    ]
    assert len(Manifest(folder).entries()) == 5


def test_storage_must_match_data_config(tmp_path):
    """FP8 files in a folder whose data_config.json says engine dtype (and the reverse) are refused."""
    folder = write_folder(tmp_path / "fp8-as-auto", [fp8_states(5, 0)], storage="auto")
    assert verify(folder).problems == [
        f"{folder}/data_0.safetensors: hidden_states[{j}] is FP8 codes and scales, data_config.json says "
        "hidden_states_dtype auto"
        for j in range(LAYERS)
    ]
    plain = [[torch.zeros(5, HIDDEN, dtype=torch.bfloat16)] * LAYERS]
    folder = write_folder(tmp_path / "auto-as-fp8", plain)
    assert verify(folder).problems == [
        f"{folder}/data_0.safetensors: hidden_states[{j}] is torch.bfloat16, data_config.json says "
        "hidden_states_dtype fp8_e4m3"
        for j in range(LAYERS)
    ]


def test_codes_and_scales_the_quantizer_never_makes_are_named(tmp_path):
    """A scale below 2^-126, zero codes under a scale not 1, a nonzero row whose largest |code| is not 448,
    half a layer's codes zeroed: each fails verify, naming sample, layer and rows."""
    samples = [fp8_states(9, s) for s in range(4)]
    samples[0][0].scales[2] = 2.0**-127
    samples[1][1].codes[3] = 0  # its scale stays amax/448
    samples[2][0].codes[5] = (samples[2][0].codes[5].float() / 2).to(fp8.CODE_DTYPE)
    samples[3][1].codes[4:] = 0
    folder = write_folder(tmp_path / "out", samples)
    assert verify(folder).problems == [
        f"{folder}/data_0.safetensors: hidden_states[0]: scales below 2^-126 in rows [2] (1)",
        f"{folder}/data_1.safetensors: hidden_states[1]: rows [3] (1) of zero codes under a scale other than 1",
        f"{folder}/data_2.safetensors: hidden_states[0]: rows [5] (1) whose largest |code| is not 448 (the "
        "quantizer's scale = amax/448)",
        f"{folder}/data_3.safetensors: hidden_states[1]: rows [4, 5, 6, 7, 8] (5) of zero codes under a scale "
        "other than 1",
    ]


def test_the_quantizers_own_edge_rows_pass_the_invariants():
    """Tiny rows (scale floored at 2^-126, codes below 448), zero rows (scale 1) and 448-peaked rows all pass."""
    rows = torch.randn(6, HIDDEN)
    rows[1] *= 1e-38  # amax/448 below 2^-126: the floor
    rows[2] = 0
    rows[3] = torch.full((HIDDEN,), -3.0)
    codes, scales = fp8.quantize(rows)
    assert scales[1] == fp8.MIN_SCALE and scales[2] == 1.0
    assert Fp8States(codes, scales).problems() == []


def test_a_multiplied_scale_alone_is_not_visible_from_content():
    """Scale x 2 on one row (codes kept): every invariant still holds, so content cannot show it (documented)."""
    state = fp8_states(9, 0)[0]
    state.scales[3] *= 2
    assert state.problems() == []


def test_replaced_header_metadata_is_named(tmp_path):
    """A sample whose header metadata was replaced (manifest updated to match) fails verify, naming the fields."""
    folder = write_folder(tmp_path / "out", [fp8_states(9, 0), fp8_states(7, 1)])
    tensors = load_file(str(folder / "data_1.safetensors"))
    metadata = {"format": "speculators-v016/sample-v1", "layer_ids": "1,3", "hidden_states_dtype": "bfloat16"}
    size, sha = write_atomic(folder, "data_1.safetensors", safetensors_parts(tensors, metadata), algorithm="sha256")
    entries = Manifest(folder).entries()
    entries[1] = Entry(1, "data_1.safetensors", size, sha, 7, "sha256")
    Manifest(folder).compact(entries)
    assert hashlib.sha256((folder / "data_1.safetensors").read_bytes()).hexdigest() == sha
    assert verify(folder).problems == [
        f"{folder}/data_1.safetensors: header metadata differs from what this tool writes for data_config.json's "
        "settings (fields hidden_states_dtype, hidden_states_scaling)"
    ]
