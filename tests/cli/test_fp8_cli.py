"""--hidden-states-dtype fp8_e4m3 end to end on CPU vLLM: files, verify, upstream's trainer, the logit check."""

import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.cli import conversations, invoke, load_all, write_jsonl
from speculators_v016 import fp8
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import load_sample
from speculators_v016.testing.faults import VARIABLE as FAULT
from speculators_v016.testing.tiny_models import build_tiny_model

HIDDEN, LAYER_IDS, COUNT = 256, [2, 4, 6, 7], 12  # 6 and 7: the wrong-layer fault uses the adjacent layer


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A tiny Llama with hidden 256 (the acceptance's width), 8 layers."""
    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("llama-256"), "llama", num_layers=8, hidden_size=HIDDEN, intermediate_size=512
        )
    )


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("fp8-data") / "chats.jsonl", conversations(COUNT, seed=7))


def generate(model, data, out, *extra, env=None):
    return invoke(
        "--target-model-path",
        model,
        "--train-data-path",
        data,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--dtype",
        "bfloat16",
        "--layer-ids",
        " ".join(map(str, LAYER_IDS)),
        "--logit-check-samples",
        COUNT,
        *extra,
        env=env,
    )


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, wide_model, data_file):
    """The engine's dtype (bf16), as the yardstick."""
    out = tmp_path_factory.mktemp("bf16") / "out"
    result = generate(wide_model, data_file, out, "--token-freq-path", "")
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, wide_model, data_file):
    """The same run storing FP8, chosen through the environment, on the multiprocess executor (/dev/shm ring)."""
    out = tmp_path_factory.mktemp("fp8") / "out"
    result = generate(
        wide_model,
        data_file,
        out,
        "--token-freq-path",
        out.parent / "tf.pt",
        "--executor",
        "mp",
        env={"SPECULATORS_DATA_GEN_HIDDEN_STATES_DTYPE": "fp8_e4m3"},
    )
    assert result.exit_code == 0, result.output
    return out, result.output


def test_fp8_run_verifies_and_says_what_it_stored(fp8_run):
    """The run names FP8 storage, its logit check passes on the stored states, verify reads every file."""
    out, output = fp8_run
    assert "bfloat16 (stored as fp8_e4m3), TP 1, mp executor" in output
    assert re.search(r"logit check: ok \(12 samples, \d+ positions: stored FP8 last layer, dequantized", output)
    config = json.loads((out / "data_config.json").read_text())
    ours = config["speculators_v016"]
    assert ours["hidden_states_dtype"] == "fp8_e4m3" and ours["dtype"] == "bfloat16"
    assert ours["hidden_states_scaling"] == fp8.SCALING
    assert ours["fingerprint"]["generation"]["hidden_states_dtype"] == "fp8_e4m3"
    assert config["format"]["schema"]["hidden_states"]["dtype"] == "list[torch.float8_e4m3fn]"
    result = invoke("verify", out)
    assert result.exit_code == 0 and f"ok: {COUNT} samples" in result.output, result.output


def test_fp8_files_load_with_safetensors(fp8_run):
    """safetensors itself reads F8_E4M3 codes [T, hidden] and F32 scales [T] per layer."""
    out, _ = fp8_run
    for entry in Manifest(out).entries().values():
        tensors = load_file(str(out / entry.file))
        assert set(tensors) == {
            "input_ids",
            "loss_mask",
            *(f"hidden_states.{j}" for j in range(4)),
            *(f"hidden_states_scale.{j}" for j in range(4)),
        }
        for j in range(4):
            assert tensors[f"hidden_states.{j}"].dtype == torch.float8_e4m3fn
            assert tensors[f"hidden_states.{j}"].shape == (entry.tokens, HIDDEN)
            assert tensors[f"hidden_states_scale.{j}"].dtype == torch.float32
            assert tensors[f"hidden_states_scale.{j}"].shape == (entry.tokens,)


def test_fp8_states_match_the_engine_dtype_run(fp8_run, bf16_run):
    """Dequantized FP8 is within 2**-4 of each row's amax of the bf16 run; the codes are quantize(bf16 rows) exactly."""
    fp8_samples = {
        i: load_sample(Path(fp8_run[0]) / e.file, dequantize_to=None) for i, e in Manifest(fp8_run[0]).entries().items()
    }
    reference = load_all(bf16_run)
    assert sorted(fp8_samples) == sorted(reference) == list(range(COUNT))
    worst = 0.0
    for i, sample in reference.items():
        assert torch.equal(fp8_samples[i]["input_ids"], sample["input_ids"])
        for stored, rows in zip(fp8_samples[i]["hidden_states"], sample["hidden_states"]):
            amax = rows.float().abs().amax(-1, keepdim=True)
            error = (stored.dequantize() - rows.float()).abs()
            assert (error <= fp8.MAX_RELATIVE_ERROR * amax).all()
            worst = max(worst, (error / amax.clamp_min(1e-30)).max().item())
            codes, scales = fp8.quantize(rows)
            assert torch.equal(stored.codes.view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(stored.scales, scales)
    assert worst > 2**-6  # the comparison sees the rounding (not two copies of the same bf16 data)


def test_fp8_halves_the_bytes_per_token(fp8_run, bf16_run):
    """Hidden-state bytes per token are <= 0.51x of bf16 at hidden 256 (files less their headers, which both pad to
    4 KiB: input_ids and mask added)."""

    def per_token(folder, prefix):
        states = total = tokens = 0
        for entry in Manifest(folder).entries().values():
            for name, tensor in load_file(str(folder / entry.file)).items():
                states += tensor.nbytes if name.startswith(prefix) else 0
            with open(folder / entry.file, "rb") as fh:
                header = 8 + struct.unpack("<Q", fh.read(8))[0]
            assert header % 4096 == 0 and header <= 8192  # padded so the data starts on a block, no more
            total += entry.bytes - header
            tokens += entry.tokens
        return states / tokens, total / tokens

    fp8_states, fp8_file = per_token(fp8_run[0], "hidden_states")
    bf16_states, bf16_file = per_token(bf16_run, "hidden_states")
    assert fp8_states == 4 * (HIDDEN + 4) and bf16_states == 4 * 2 * HIDDEN
    assert fp8_states / bf16_states <= 0.51
    assert fp8_file / bf16_file <= 0.515  # + 16 bytes of input_ids and loss_mask per token in both


def test_upstream_dataset_reads_fp8_in_its_dtype(fp8_run):
    """Eagle3SampleFileDataset dequantizes FP8 folders to its hidden_states_dtype (float32 by default)."""
    from speculators.train.data import (  # noqa: PLC0415 - upstream: slow to import, this test only
        Eagle3SampleFileDataset,
    )

    out, _ = fp8_run
    for dtype in (torch.float32, torch.bfloat16):
        dataset = Eagle3SampleFileDataset(max_len=256, datapath=str(out), hidden_states_dtype=dtype)
        assert len(dataset) == COUNT
        item = dataset[0]
        assert item["hidden_states"].dtype == dtype and item["hidden_states"].shape[-1] == 3 * HIDDEN
        stored = load_sample(dataset.data[0], dequantize_to=None)["hidden_states"]
        assert torch.equal(item["verifier_last_hidden_states"], stored[-1].dequantize(dtype)[1:])


def test_eagle3_trainer_runs_on_fp8_data(fp8_run, wide_model, tmp_path):
    """A few steps of upstream's EAGLE-3 Trainer run on CPU on an FP8 folder."""
    out, _ = fp8_run
    script = Path(__file__).parents[1] / "helpers" / "eagle3_train_steps.py"
    proc = subprocess.run(
        [sys.executable, str(script), wide_model, str(out), str(out.parent / "tf.pt"), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k: result[k] for k in ("steps", "changed", "finite")} == {"steps": 4, "changed": True, "finite": True}
    assert len(result["losses"]) == 4 and all(math.isfinite(x) for x in result["losses"])


def test_fp8_as_pt_is_refused(tmp_path, wide_model, data_file):
    """--format pt with FP8 is a usage error naming why, before anything is written."""
    result = generate(wide_model, data_file, tmp_path / "out", "--format", "pt", "--hidden-states-dtype", "fp8_e4m3")
    assert result.exit_code == 2
    assert "fp8_e4m3 is stored as safetensors only: upstream's .pt readers would take the FP8 codes" in result.output
    assert not (tmp_path / "out").exists()


def test_resume_with_another_storage_is_refused(fp8_run, wide_model, data_file, tmp_path):
    """An FP8 folder is not resumed storing the engine's dtype: refused, naming hidden_states_dtype."""
    out = tmp_path / "copy"
    shutil.copytree(fp8_run[0], out)
    (out / sorted(p.name for p in out.glob("data_*.safetensors"))[0]).unlink()
    result = generate(wide_model, data_file, out, "--token-freq-path", "")
    assert result.exit_code == 4, result.output
    assert "generation.hidden_states_dtype: 'fp8_e4m3' -> 'auto'" in result.output  # the option's value


@pytest.mark.parametrize("fault", ["shift-check", "wrong-layer-check"])
def test_logit_check_on_fp8_catches_misplaced_rows(fault, tmp_path, wide_model, data_file):
    """On FP8 states, rows one position off or the adjacent layer (n-2) fail the logit check: exit 7, nothing written."""
    out = tmp_path / "out"
    result = generate(
        wide_model,
        data_file,
        out,
        "--token-freq-path",
        "",
        "--hidden-states-dtype",
        "fp8_e4m3",
        env={FAULT: f"{fault}:2"},
    )
    assert result.exit_code == 7, result.output
    assert re.search(
        r"error: self-check failed: sample \d+: the captured last layer, normed and projected, does not "
        r"reproduce vLLM's own prompt logprobs \(logit check: max \|delta\| [\d.e+-]+, tolerance 8 "
        r"sigma of the e4m3 rounding \+ 5e-02 \+ 3 ulps of the logits\)",
        result.output,
    ), result.output
    assert Manifest(out).entries() == {} and not list(out.glob("data_*.safetensors"))


def test_fp8_nan_sample_is_skipped(tmp_path, wide_model, data_file):
    """A NaN row shows in its FP8 scale: the sample is not written and is named with its layer."""
    out = tmp_path / "out"
    result = generate(
        wide_model,
        data_file,
        out,
        "--token-freq-path",
        "",
        "--hidden-states-dtype",
        "fp8_e4m3",
        "--logit-check-samples",
        0,
        env={FAULT: "nan-sample:3"},
    )
    assert result.exit_code == 0, result.output
    match = re.search(r"sample (\d+): NaN/Inf hidden states in layers \[7\]: not written", result.output)
    assert match and int(match.group(1)) not in Manifest(out).entries()
    assert len(Manifest(out).entries()) == COUNT - 1
