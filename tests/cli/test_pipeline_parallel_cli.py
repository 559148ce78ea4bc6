"""--pipeline-parallel-size through the real command on CPU: PP 2 and TP 2 x PP 2 against PP 1, both families.

Eight layers, every one captured (vLLM aux ids 1..8); 128 tokens a step, so prompts are prefilled in
chunks and requests finish while others are half way. Stage 0 holds layers 0..3, stage 1 layers 4..7
(``VLLM_PP_LAYER_PARTITION=3,5``: 0..2 and 3..7): the boundary id is our layer 3 (vLLM id 4), captured on
stage 1 from what its first layer receives.
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from speculators.train.data import Eagle3SampleFileDataset

from helpers.cli import CPU, conversations, invoke, load_all, write_jsonl
from helpers.reference import TOLERANCE
from speculators_v016 import fp8
from speculators_v016.online import OnlineSampleDataset
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import load_sample
from speculators_v016.testing.faults import VARIABLE as FAULT

COUNT, LAYERS = 10, list(range(8))
BOUNDARY = 3  # our layer 3 = vLLM aux id 4 = the input of layer 4, stage 1's first layer


def bind(workers: int) -> dict:
    """vLLM's CPU workers bound to the cores of one NUMA node (a whole-world auto-binding asserts otherwise)."""
    cores = ["0", "1"] if (os.cpu_count() or 1) >= 2 else ["0", "0"]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(cores[i % 2] for i in range(workers))}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pp-data") / "chats.jsonl", conversations(COUNT, seed=5))


def generate(model, data, out, *extra, env=None):
    return invoke(
        "--target-model-path", model, "--train-data-path", data, "--output-dir", out, "--seq-length", 256,
        "--layer-ids", " ".join(map(str, LAYERS)), "--max-num-batched-tokens", 128, "--max-num-seqs", 4,
        "--logit-check-samples", COUNT, "--token-freq-path", "", *extra, env=env,
    )  # fmt: skip


def parallel(model, data, out, pp, tp=1, env=None, *extra, checked=COUNT, bound=True):
    """A run with ``pp`` stages of ``tp`` workers each; it must pass its own logit check (of ``checked`` samples,
    those it wrote) and verify. ``bound=False``: VLLM_CPU_OMP_THREADS_BIND left unset, as users run it."""
    result = generate(
        model, data, out, "--pipeline-parallel-size", pp, "--tensor-parallel-size", tp, *extra,
        env={**(bind(pp * tp) if bound else {}), **(env or {})},
    )  # fmt: skip
    assert result.exit_code == 0, result.output[-3000:]
    if not bound:  # the run bound its workers to the cores it may use (vLLM's own binding asserts on one node)
        log = Path(re.search(r"log: +(\S+)", result.output).group(1))
        cores = sorted(os.sched_getaffinity(0))
        expected = "|".join(map(str, cores)) if len(cores) == pp * tp else None
        found = re.search(
            r"fewer NUMA nodes than workers .*: VLLM_CPU_OMP_THREADS_BIND=(\S+) from the cores", log.read_text()
        )
        assert found, log.read_text()[-3000:]
        assert expected is None or found.group(1) == expected
    assert (
        f"TP {tp} x PP {pp}, mp executor, async scheduling {'on' if '--pipeline-async-scheduling' in extra else 'OFF'}"
        in result.output
    )
    assert re.search(rf"logit check: ok \({checked} samples", result.output), result.output[-2000:]
    assert f"verify:     ok ({COUNT} samples" in result.output
    return load_all(out)


def differences(a: dict, b: dict) -> list[float]:
    """Largest |difference| per layer over all samples; the ids and loss masks must be equal."""
    assert a.keys() == b.keys()
    worst = [0.0] * len(LAYERS)
    for i in a:
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and torch.equal(a[i]["loss_mask"], b[i]["loss_mask"])
        for j, (x, y) in enumerate(zip(a[i]["hidden_states"], b[i]["hidden_states"], strict=True)):
            worst[j] = max(worst[j], (x - y).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def llama_pp1_dir(tmp_path_factory, model_dir, data_file):
    out = tmp_path_factory.mktemp("llama-pp1") / "out"
    result = generate(model_dir, data_file, out)
    assert result.exit_code == 0, result.output[-3000:]
    return out


@pytest.fixture(scope="module")
def llama_pp1(llama_pp1_dir):
    return load_all(llama_pp1_dir)


@pytest.fixture(scope="module")
def deepseek_pp1(tmp_path_factory, tiny_model, data_file):
    out = tmp_path_factory.mktemp("deepseek-pp1") / "out"
    result = generate(tiny_model("deepseek_v3"), data_file, out)
    assert result.exit_code == 0, result.output[-3000:]
    return load_all(out)


def test_pp2_files_equal_pp1_bit_for_bit(llama_pp1, model_dir, data_file, tmp_path):
    """Llama, PP 2 (stages 0..3 and 4..7), VLLM_CPU_OMP_THREADS_BIND unset (the run binds its two workers): logit
    check and verify pass, every layer equals PP 1 bit for bit."""
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    pp2 = parallel(model_dir, data_file, tmp_path / "out", 2, bound=False)
    assert differences(llama_pp1, pp2) == [0.0] * len(LAYERS)


@pytest.mark.parametrize(
    "variables, needle",
    [
        (
            {"VLLM_PP_LAYER_PARTITION": "3,4"},
            "environment variable VLLM_PP_LAYER_PARTITION='3,4': the entries sum to 7, the target has 8 layers",
        ),
        (
            {"VLLM_PP_LAYER_PARTITION": "4,x"},
            "environment variable VLLM_PP_LAYER_PARTITION='4,x': 'x' not a whole number >= 1",
        ),
        (
            {"VLLM_CPU_OMP_THREADS_BIND": "0"},
            "environment variable VLLM_CPU_OMP_THREADS_BIND='0' names the cores of 1 workers",
        ),
    ],
    ids=["partition-sum", "partition-entry", "binding-too-short"],
)
def test_variables_the_workers_would_fail_on_are_a_usage_error(model_dir, data_file, tmp_path, variables, needle):
    """A malformed VLLM_PP_LAYER_PARTITION, a binding naming too few workers: exit 2 naming the variable, before the
    dataset is read and any worker starts (vLLM's own failure: exit 5 after the workers started)."""
    out = tmp_path / "out"
    result = generate(model_dir, data_file, out, "--pipeline-parallel-size", 2, env=variables)
    assert result.exit_code == 2, result.output[-3000:]
    assert f"error: {needle}" in result.output, result.output[-3000:]
    assert "Initializing a V1 LLM engine" not in result.output and "Traceback" not in result.output
    assert not (out / "manifest.jsonl").exists() and not (out / "data_config.json").exists()


def test_an_uneven_split_with_async_scheduling_equals_pp1(llama_pp1, model_dir, data_file, tmp_path):
    """VLLM_PP_LAYER_PARTITION=3,5 with --pipeline-async-scheduling: each stage's first and last layer, the boundary
    at 3, equal PP 1 bit for bit (vLLM 0.16's lost prompt rows worked around)."""
    pp2 = parallel(
        model_dir, data_file, tmp_path / "out", 2, 1, {"VLLM_PP_LAYER_PARTITION": "3,5"}, "--pipeline-async-scheduling"
    )
    assert differences(llama_pp1, pp2) == [0.0] * len(LAYERS)


def test_tp2_pp2_files_equal_pp1(llama_pp1, model_dir, data_file, tmp_path, record_architecture):
    """Llama, TP 2 x PP 2 (four workers): within fp32's reduction-order bound of PP 1, every layer."""
    worst = max(differences(llama_pp1, parallel(model_dir, data_file, tmp_path / "out", 2, 2)))
    record_architecture("llama", "LlamaForCausalLM", "taps (built-in at PP 1)", "TP 2 x PP 2 (CLI)", worst,
                        TOLERANCE, "four workers; logit check and verify ok", device="cpu-pp-tp2pp2")  # fmt: skip
    assert worst < TOLERANCE


def test_deepseek_v3_pp2_and_tp2_pp2_equal_pp1(deepseek_pp1, tiny_model, data_file, tmp_path, record_architecture):
    """DeepSeek-V3 (taps, MoE): PP 2 bit for bit where PP 1 is (in other batches), else within the bound past the
    dense layer 0; TP 2 x PP 2 within the bound; logit check and verify pass."""
    model = tiny_model("deepseek_v3")
    pp2 = differences(deepseek_pp1, parallel(model, data_file, tmp_path / "pp2", 2))
    # PP 2 batches requests as PP 1 cannot (two batches in flight), and vLLM's CPU MoE kernel gives a row bits that
    # depend on its batch on some builds (the AVX2 build's: ulps from layer 1, the first MoE layer, at PP 1 with
    # --max-num-seqs 3 against 4). Where PP 1 itself keeps every bit across batches, PP 2 must too.
    rebatched = generate(model, data_file, tmp_path / "pp1-rebatched", "--max-num-seqs", 3)
    assert rebatched.exit_code == 0, rebatched.output[-3000:]
    if differences(deepseek_pp1, load_all(tmp_path / "pp1-rebatched")) == [0.0] * len(LAYERS):
        assert pp2 == [0.0] * len(LAYERS)
    else:
        assert pp2[0] == 0.0 and max(pp2) < TOLERANCE, pp2
    worst = max(differences(deepseek_pp1, parallel(model, data_file, tmp_path / "tp2pp2", 2, 2)))
    record_architecture("deepseek_v3", "DeepseekV3ForCausalLM", "taps", "TP 2 x PP 2 (CLI)", worst, TOLERANCE,
                        "four workers; logit check and verify ok", device="cpu-pp-tp2pp2")  # fmt: skip
    assert worst < TOLERANCE


def test_a_planted_stage_boundary_off_by_one_is_found(llama_pp1, model_dir, data_file, tmp_path):
    """Planted: stage 1 stores its first layer one layer late. The run's own checks pass; only the boundary layer
    differs from PP 1, and `check`'s layer replay across the stages fails there (it passes without the fault)."""
    planted = parallel(model_dir, data_file, tmp_path / "out", 2, env={FAULT: "stage-boundary-late"})
    worst = differences(llama_pp1, planted)
    assert worst[BOUNDARY] > 0.1 and [w for j, w in enumerate(worst) if j != BOUNDARY] == [0.0] * (len(LAYERS) - 1)
    replayed = {}
    for fault in (None, "stage-boundary-late"):
        result = invoke(
            "check", "--target-model-path", model_dir, "--train-data-path", data_file, "--samples", 2,
            "--dtype", "float32", "--enforce-eager", "--seq-length", 256, "--no-transformers",
            "--pipeline-parallel-size", 2, "--layer-ids", "2 3 4 7",
            env={**bind(2), **({FAULT: fault} if fault else {})},
        )  # fmt: skip
        assert result.exit_code == (1 if fault else 0), result.output[-3000:]
        replayed[fault] = {
            int(r[1]): r[-1] for r in map(str.split, result.output.splitlines()) if r and r[0] == "replay"
        }
    assert replayed[None] == {2: "pass", 3: "pass", 4: "pass", 7: "pass"}
    assert replayed["stage-boundary-late"] == {2: "pass", 3: "FAIL", 4: "FAIL", 7: "pass"}


def test_vllm_loses_prompt_rows_without_the_workaround(llama_pp1, model_dir, data_file, tmp_path):
    """vLLM 0.16's own PP + async + chunked prefill (our workaround left out): prompts' later chunks go wrong."""
    result = generate(
        model_dir, data_file, tmp_path / "out", "--pipeline-parallel-size", 2, "--pipeline-async-scheduling",
        "--logit-check-samples", 0, env={**bind(2), FAULT: "vllm-prompt-rows"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output[-3000:]
    assert min(differences(llama_pp1, load_all(tmp_path / "out"))) > 0.1  # every layer, not rounding


def test_fp8_storage_and_resume_after_sigkill_under_pp2(llama_pp1, model_dir, data_file, tmp_path):
    """PP 2 storing FP8, killed mid-write, run again: it resumes, verifies, and stores PP 1's states quantized."""
    out, extra = tmp_path / "out", ("--hidden-states-dtype", "fp8_e4m3", "--write-workers", 1)
    killed = generate(model_dir, data_file, out, "--pipeline-parallel-size", 2, *extra,
                      env={**bind(2), FAULT: "kill-mid-write:5"})  # fmt: skip
    assert killed.exit_code == -9, killed.output[-2000:]
    done = len(Manifest(out).entries())
    assert 0 < done < COUNT
    parallel(model_dir, data_file, out, 2, 1, None, *extra, checked=COUNT - done)
    for i, entry in Manifest(out).entries().items():
        sample = load_sample(out / entry.file, dequantize_to=None)
        for j, stored in enumerate(sample["hidden_states"]):
            codes, scales = fp8.quantize(llama_pp1[i]["hidden_states"][j])
            assert torch.equal(stored.codes.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(
                stored.scales, scales
            )


def test_serve_under_pp2_gives_pp1s_states(llama_pp1_dir, model_dir, data_file, tmp_path):
    """`serve --pipeline-parallel-size 2`: every served item equals upstream's item of PP 1's offline file (ids and
    masks exactly, states within fp32's batch-composition bound: a service batches requests as they come)."""
    cmd = [sys.executable, "-m", "speculators_v016.run.cli", "serve", "--target-model-path", model_dir,
           "--serve-dir", tmp_path / "states", "--port", 0, "--seq-length", 256, "--enforce-eager",
           "--dtype", "float32", "--layer-ids", " ".join(map(str, LAYERS)), "--max-num-batched-tokens", 128,
           "--max-num-seqs", 4, "--pipeline-parallel-size", 2, "--train-data-path", data_file]  # fmt: skip
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **CPU, **bind(2)})  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("serving "):
                break
        url = re.search(r" at (http://[\d.]+:\d+): ", lines[-1])
        assert url, "".join(lines)
        online = OnlineSampleDataset(url.group(1), max_len=256, hidden_states_dtype=torch.float32,
                                     folder=tmp_path / "states")  # fmt: skip
        files = [str(llama_pp1_dir / e.file) for _, e in sorted(Manifest(llama_pp1_dir).entries().items())]
        offline = Eagle3SampleFileDataset(max_len=256, file_list=files, hidden_states_dtype=torch.float32)
        for i in range(COUNT):
            a, b = online[i], offline[i]
            assert sorted(a) == sorted(b)
            for key in a:
                if a[key].is_floating_point():
                    assert (a[key] - b[key]).abs().max().item() < TOLERANCE, f"sample {i}: {key}"
                else:
                    assert torch.equal(a[key], b[key]), f"sample {i}: {key}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
