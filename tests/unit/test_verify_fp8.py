"""`verify` on FP8 folders: codes, scales and shapes are checked, and each broken one is named."""

import torch

from speculators_v016 import fp8
from speculators_v016.fp8 import Fp8States
from speculators_v016.store import run_config
from speculators_v016.store.manifest import Manifest
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
    """Intact FP8 samples pass, including a zero row (scale 1)."""
    samples = [fp8_states(9, s) for s in range(3)]
    samples[1][0].codes[4].zero_()
    samples[1][0].scales[4] = 1.0
    report = verify(write_folder(tmp_path / "out", samples))
    assert report.ok and report.samples == 3, report.problems


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
