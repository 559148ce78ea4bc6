"""The real command on vLLM 0.16's own GPU engine, as users run it (bf16 from the checkpoint, compiled with
CUDA graphs, default options, the GPU build's ``--engine-args``): the run, the multiprocess executor,
another attention backend chosen, SIGKILL then resume, FP8 storage,
``check``, ``--regenerate``, and ``serve`` against the offline files. Skipped where vLLM's CUDA platform
does not load.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from speculators.train.data import Eagle3SampleFileDataset

from helpers.cli import conversations, load_all, write_jsonl
from helpers.families import MEDIAN_BOUND
from helpers.gpu import command_env, engine_args, invoke_gpu, requires_vllm_gpu, save_figures
from helpers.layer_rows import fp8_worst_error
from speculators_v016.checks.fidelity import row_errors
from speculators_v016.online import OnlineSampleDataset, ProducerClient

pytestmark = requires_vllm_gpu

COUNT = 8


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("gpu-cli") / "chats.jsonl", conversations(COUNT, seed=11))


def run(model_dir, data, out, *extra, **options):
    return invoke_gpu(
        "--target-model-path", model_dir, "--train-data-path", data, "--output-dir", out, "--seq-length", 512,
        "--token-freq-path", Path(out).parent / "tf.pt", *extra, **options,
    )  # fmt: skip


def assert_ok(result, executor: str = "uni") -> None:
    assert result.exit_code == 0, result.output[-6000:]
    started = rf"bfloat16( \(stored as fp8_e4m3\))?, TP 1, {executor} executor, async scheduling on, compiled"
    assert re.search(started, result.output), result.output
    assert re.search(r"logit check: ok \(\d+ samples", result.output), result.output
    assert f"verify:     ok ({COUNT} samples" in result.output, result.output


def log_text(out: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((Path(out) / "logs").glob("*.log")))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, model_dir, data_file):
    """Every option at its default (bf16, compiled, CUDA graphs, async scheduling, uniprocess)."""
    out = tmp_path_factory.mktemp("gpu-default") / "out"
    result = run(model_dir, data_file, out)
    assert_ok(result)
    # the staged copy's NaN/Inf proof held for every sample: the writers read none of their bytes for the test
    assert f"NaN/Inf test: {COUNT} samples proven on the device, 0 tested by the writers" in result.output, (
        result.output
    )
    save_figures("cli-default", {"summary": [line for line in result.output.splitlines() if ":" in line][-10:]})
    return out


def test_the_default_run_passes_its_checks(default_run):
    """The default run: the logit check and verify pass, and the log names vLLM's Triton attention."""
    assert "TRITON_ATTN" in log_text(default_run)
    assert len(load_all(default_run)) == COUNT


def same_within_noise(ours: dict, reference: dict, name: str) -> None:
    """Another process's states of the same samples: the ids alike, every row within MEDIAN_BOUND of the other's
    (compiled engines pick kernels per process, inductor benchmarks its fused kernels: bits may differ; a wrong
    row or layer sits 10x further), the figures kept."""
    medians, worst = [], 0.0
    for i in reference:
        assert torch.equal(ours[i]["input_ids"], reference[i]["input_ids"]), f"sample {i}"
        for a, b in zip(ours[i]["hidden_states"], reference[i]["hidden_states"]):
            rows = row_errors(a, b)
            medians.append(rows.median().item())
            worst = max(worst, rows.max().item())
    save_figures(name, {"median_row": max(medians), "worst_row": worst})
    assert worst <= MEDIAN_BOUND[torch.bfloat16], f"{name}: worst row {worst:.2e}"


def test_the_multiprocess_executor_runs_and_equals_the_default_run(tmp_path, model_dir, data_file, default_run):
    """--executor mp (every TP run's executor) on the GPU: its worker spawned, checks pass, the same states."""
    out = tmp_path / "out"
    result = run(model_dir, data_file, out, "--executor", "mp")
    assert_ok(result, "mp")
    same_within_noise(load_all(out), load_all(default_run), "cli-mp-vs-uni")


def test_engine_args_choose_another_attention_backend(tmp_path, model_dir, data_file):
    """--engine-args on the command line picks vLLM's FlexAttention backend: it runs it, and the checks pass (its
    KV-cache write, the compiled ``reshape_and_cache_flash``, stood in for by ``testing/cache_ops.py``: the kit
    has no compiled cache ops)."""
    chosen = engine_args(attention_config={"backend": "FLEX_ATTENTION"})
    out = tmp_path / "out"
    result = run(model_dir, data_file, out, "--engine-args", json.dumps(chosen), stand_ins=True)
    assert_ok(result)
    text = log_text(out)
    assert "Using AttentionBackendEnum.FLEX_ATTENTION backend" in text, text[-3000:]
    config = json.loads((out / "data_config.json").read_text())
    assert config["speculators_v016"]["fingerprint"]["generation"]["engine_args"] == chosen


def test_a_nan_made_in_the_forward_fails_the_devices_proof_and_is_refused(tmp_path, model_dir, data_file):
    """A NaN planted in a step's aux states on the GPU, before the staged copy: that step is not proven, the writers
    test its samples' bytes and refuse the one holding it; the others are written."""
    out = tmp_path / "out"
    result = run(model_dir, data_file, out, "--logit-check-samples", 0, fault="nan-step:1")
    assert result.exit_code == 0, result.output[-6000:]
    refused = re.search(r"sample (\d+): NaN/Inf hidden states in layers \[[\d, ]+\]: not written", result.output)
    assert refused and "skipped:    1 NaN/Inf hidden states" in result.output, result.output[-6000:]
    assert len(load_all(out)) == COUNT - 1 and int(refused[1]) not in load_all(out)
    test = re.search(r"NaN/Inf test: (\d+) samples proven on the device, (\d+) tested by the writers", result.output)
    assert test and int(test[2]) >= 1 and int(test[1]) + int(test[2]) == COUNT, result.output[-6000:]


def test_a_killed_run_resumes_within_the_bounds(tmp_path, model_dir, data_file, default_run):
    """SIGKILL mid-write of the third sample, then the same command: every sample, verified, the same states."""
    out = tmp_path / "out"
    killed = run(model_dir, data_file, out, "--write-workers", 1, fault="kill-mid-write:3")
    assert killed.exit_code == -signal.SIGKILL, killed.output[-3000:]
    resumed = run(model_dir, data_file, out)
    assert_ok(resumed)
    assert "(2 already done before this run)" in resumed.output, resumed.output
    same_within_noise(load_all(out), load_all(default_run), "cli-resume-vs-default")


def test_write_helpers_on_the_gpu_write_what_the_threads_wrote(tmp_path, model_dir, data_file, default_run):
    """--write-helpers on: each file written by a helper process from the pool's shared memory, which the GPU's
    copies fill; checks pass, the summary counts them, the same states as the threads' default run."""
    out = tmp_path / "out"
    result = run(model_dir, data_file, out, "--write-helpers", "on")
    assert_ok(result)
    assert f"({COUNT} files written by their helper processes)" in result.output, result.output[-3000:]
    same_within_noise(load_all(out), load_all(default_run), "cli-write-helpers-vs-threads")


def test_fp8_storage_is_within_its_bound_of_the_bf16_run(tmp_path, model_dir, data_file, default_run):
    """--hidden-states-dtype fp8_e4m3 on the GPU (Triton quantizer): checks pass, every sample proven finite on the
    device, each row within 2**-4 of its
    largest |value| of the bf16 run's (e4m3's 3 bits; the two runs' own bf16 noise is 16x smaller)."""
    out = tmp_path / "out"
    result = run(model_dir, data_file, out, "--hidden-states-dtype", "fp8_e4m3")
    assert_ok(result)
    assert f"NaN/Inf test: {COUNT} samples proven on the device, 0 tested by the writers" in result.output, (
        result.output  # the staged FP8 step's scales summed on the device
    )
    worst = fp8_worst_error(out, default_run)
    save_figures("cli-fp8-vs-bf16", {"worst_error_over_row_amax": worst})
    assert worst <= 2**-4


def test_check_passes(model_dir, data_file):
    """`check` on the GPU engine: logits, layer replay and the whole model in transformers agree."""
    result = invoke_gpu("check", "--target-model-path", model_dir, "--train-data-path", data_file)
    assert result.exit_code == 0, result.output[-6000:]
    save_figures("cli-check", {"lines": result.output.strip().splitlines()[-12:]})


def test_regenerate_runs_its_checks(tmp_path, model_dir, data_file):
    """--regenerate, greedy, on the GPU: decode steps captured, the logit check on generated positions, verify."""
    out = tmp_path / "out"
    result = run(model_dir, data_file, out, "--regenerate", "--temperature", 0, "--max-new-tokens", 24)
    assert result.exit_code == 0, result.output[-6000:]
    assert re.search(r"logit check: ok", result.output) and "verify:     ok" in result.output, result.output


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory, model_dir, data_file):
    """An offline run with one sample per step (as the service below runs)."""
    out = tmp_path_factory.mktemp("gpu-offline-1") / "out"
    result = run(model_dir, data_file, out, "--max-num-seqs", 1)
    assert result.exit_code == 0, result.output[-6000:]
    return out


def test_serve_items_equal_the_offline_files(tmp_path, model_dir, data_file, one_at_a_time):
    """`serve` on the GPU: every online item is upstream's dataset item of the offline file (ids and masks exactly,
    states within another process's noise: see same_within_noise; bit for bit on CPU, tests/cli/test_serve.py)."""
    cmd = [sys.executable, "-m", "speculators_v016.run.cli", "serve", "--target-model-path", model_dir,
           "--serve-dir", tmp_path / "states", "--port", 0, "--seq-length", 512, "--max-num-seqs", 1,
           "--train-data-path", data_file]  # fmt: skip
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=command_env())  # fmt: skip
    try:
        url, lines = None, []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving "):
                url = re.search(r" at (http://[\d.]+:\d+): ", line).group(1)
                break
        assert url, "".join(lines)
        online = OnlineSampleDataset(url, max_len=512, folder=tmp_path / "states")
        files = [str(one_at_a_time / f"data_{i}.safetensors") for i in range(COUNT)]
        reference = Eagle3SampleFileDataset(max_len=512, file_list=files)
        worst = 0.0
        for i in range(COUNT):
            a, b = online[i], reference[i]
            assert sorted(a) == sorted(b)
            for key in a:
                assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, f"sample {i}: {key}"
                if a[key].is_floating_point():
                    worst = max(worst, row_errors(a[key].reshape(-1, a[key].shape[-1]),
                                                  b[key].reshape(-1, b[key].shape[-1])).max().item())  # fmt: skip
                else:
                    assert torch.equal(a[key], b[key]), f"sample {i}: {key}"
        save_figures("serve-vs-offline", {"worst_row": worst, "bit_for_bit": worst == 0.0})
        assert worst <= MEDIAN_BOUND[torch.bfloat16]
        info = ProducerClient(url).info()  # the staged steps' proof: the publishers tested no sample's bytes
        assert (info["finite_proven"], info["finite_tested"]) == (COUNT, 0), info
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, rest[-3000:]
    assert not [n for n in os.listdir(tmp_path / "states") if n.startswith("online_")]  # each taken once read
