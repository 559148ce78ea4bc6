"""The path users run, end to end: the CLI with no --dtype (bf16 on CPU), FP8 from a bf16 engine, check, resume.

Every other CLI test pins float32 through the environment (helpers.cli.CPU);
here that variable is removed, so the engine's dtype is the CLI's own default,
``auto``, which vLLM's CPU backend resolves to bfloat16, as users get it. So is
TORCHDYNAMO_DISABLE: vLLM's prompt-logprob kernel is compiled, as users get it.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from helpers.cli import CPU, conversations, load_all, write_jsonl
from helpers.reference import hf_layer_outputs
from speculators_v016.checks.fidelity import ROW_BOUNDS
from speculators_v016.run import huge_pages
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import load_sample
from speculators_v016.testing.faults import VARIABLE as FAULT
from speculators_v016.testing.tiny_models import build_tiny_model

#: Row error of a bf16 engine against transformers in fp32 (checks/fidelity.py says why)
MEDIAN_BOUND, ROW_BOUND = ROW_BOUNDS["bfloat16"]
COUNT = 12
DEFAULTS = {
    k: v for k, v in CPU.items() if k not in ("SPECULATORS_DATA_GEN_DTYPE", "TORCHDYNAMO_DISABLE", "GLIBC_TUNABLES")
}


def run(*args, fault: str | None = None):
    """The real command with the CLI's own dtype (no SPECULATORS_DATA_GEN_DTYPE, no --dtype); ``fault``: injected."""
    env = {k: v for k, v in os.environ.items() if k not in ("SPECULATORS_DATA_GEN_DTYPE", "GLIBC_TUNABLES")}
    module = "speculators_v016.testing.faults" if fault else "speculators_v016.run.cli"
    proc = subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          env={**env, **DEFAULTS, **({FAULT: fault} if fault else {})}, timeout=600)  # fmt: skip
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("default-data") / "chats.jsonl", conversations(COUNT, seed=11))


def generate(model, data, out, *extra):
    return run("--target-model-path", model, "--train-data-path", data, "--output-dir", out, "--seq-length", 256,
               "--token-freq-path", "", "--logit-check-samples", 4, *extra)  # fmt: skip


def assert_close_to_transformers(model, out):
    """Every stored layer of a few samples within the bf16 bounds of transformers in fp32."""
    config = json.loads((out / "data_config.json").read_text())
    layers = config["hidden_states"]["layer_ids"]
    samples = load_all(out)
    picked = [samples[i] for i in sorted(samples)[:: max(1, len(samples) // 4)]]
    reference = hf_layer_outputs(model, [s["input_ids"].tolist() for s in picked])
    for sample, ref in zip(picked, reference):
        for state, layer in zip(sample["hidden_states"], layers):
            assert state.dtype == torch.bfloat16
            rows = (state.float() - ref[layer]).norm(dim=-1) / ref[layer].norm(dim=-1)
            assert rows.median() <= MEDIAN_BOUND and rows.max() <= ROW_BOUND, (layer, rows.median(), rows.max())


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny Qwen2 saved in bf16 (config and weights), as released checkpoints are."""
    return str(build_tiny_model(tmp_path_factory.mktemp("qwen2-bf16"), "qwen2", dtype="bfloat16"))


@pytest.mark.parametrize("arch", ["qwen2 (bf16 checkpoint)", "llama"])
def test_a_default_run_is_bf16_checked_and_verified(arch, tiny_model, bf16_checkpoint, data_file, tmp_path):
    """No --dtype: the engine runs bf16, the logit check passes, verify ok, states within bf16 of transformers."""
    model = bf16_checkpoint if arch.startswith("qwen2") else tiny_model(arch)
    code, output = generate(model, data_file, tmp_path / "out")
    assert code == 0, output[-3000:]
    assert ", bfloat16, TP 1," in output  # the start line names the engine's dtype
    assert "logit check: ok (4 samples" in output and f"verify:     ok ({COUNT} samples" in output
    # started without GLIBC_TUNABLES, the command started itself again with huge pages and a kept heap where this host
    # takes them; with the heap kept, every sample lies in a reused block of the pool, none in fresh memory
    users_env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    tunables = huge_pages.wanted(users_env) or ""
    assert huge_pages.describe(tunables) in output, output[-3000:]
    assert ("samples in fresh memory" in output) is not huge_pages.heap_kept(tunables), output[-3000:]
    assert_close_to_transformers(model, tmp_path / "out")
    code, output = run("verify", tmp_path / "out")
    assert code == 0, output


def test_a_default_run_killed_then_resumed(tiny_model, tmp_path):
    """A default run SIGKILLed mid-way (inside its 7th file): the 6 files before it are kept byte for byte, the
    resume writes the rest."""
    model, out = tiny_model("qwen2"), tmp_path / "out"
    data = write_jsonl(tmp_path / "chats.jsonl", conversations(40, seed=12))
    args = ["--target-model-path", model, "--train-data-path", data, "--output-dir", out, "--seq-length", 256,
            "--token-freq-path", "", "--max-num-seqs", 2, "--write-workers", 1]  # fmt: skip
    # The kill comes from inside (the fault waits until the manifest lists the 6 files before it): a kill from
    # outside raced a tiny model that writes all 40 samples within one group commit on a fast machine.
    code, _ = run(*args, fault="kill-mid-write:7")
    assert code == -signal.SIGKILL
    kept = {e.file: (out / e.file).read_bytes() for e in Manifest(out).entries().values()}
    assert len(kept) == 6
    code, output = run(*args)
    assert code == 0, output[-3000:]
    assert "(6 already done before this run)" in output and "verify:     ok (40 samples" in output
    assert all((out / name).read_bytes() == data for name, data in kept.items())
    assert_close_to_transformers(model, out)


def test_fp8_from_the_default_bf16_engine(tiny_model, data_file, tmp_path):
    """FP8 storage from a default (bf16) engine: the logit check on the stored states passes, verify ok."""
    model, out = tiny_model("qwen2"), tmp_path / "out"
    code, output = generate(model, data_file, out, "--hidden-states-dtype", "fp8_e4m3")
    assert code == 0, output[-3000:]
    assert "logit check: ok (4 samples" in output and f"verify:     ok ({COUNT} samples" in output
    sample = load_sample(next(out.glob("data_*.safetensors")), dequantize_to=None)
    assert sample["hidden_states"][0].codes.dtype == torch.float8_e4m3fn


def test_check_with_the_default_dtype(tiny_model, data_file):
    """`check` with no --dtype: bf16 engine, transformers comparison and layer replay pass with bf16 tolerances."""
    code, output = run("check", "--target-model-path", tiny_model("llama"), "--train-data-path", data_file,
                       "--samples", 3, "--enforce-eager", "--seq-length", 256)  # fmt: skip
    assert code == 0, output[-3000:]
    assert "engine dtype bfloat16" in output and "logit check: ok (3 samples" in output
    rows = [line.split() for line in output.splitlines() if line.strip().endswith(("pass", "FAIL"))]
    assert rows and all(r[-1] == "pass" for r in rows), output[-3000:]
    assert [int(r[1]) for r in rows if r[0] == "replay"] == [2, 4, 5, 7]
    assert "stream proof:" in output  # the margin each consumer showed


def test_check_in_bf16_finds_a_wrong_intermediate_layer(tiny_model, data_file):
    """Injected in bf16: layer 4 holds layer 3's states; the row-judged replay fails on 4 and 5, far past its bound."""
    code, output = run("check", "--target-model-path", tiny_model("llama"), "--train-data-path", data_file,
                       "--samples", 2, "--enforce-eager", "--seq-length", 256, "--no-transformers",
                       fault="wrong-layer:1")  # fmt: skip
    assert code == 1, output[-3000:]
    replayed = {int(r[1]): (float(r[5]), r[-1]) for r in (line.split() for line in output.splitlines())
                if r and r[0] == "replay"}  # fmt: skip
    assert {k: v[1] for k, v in replayed.items()} == {2: "pass", 4: "FAIL", 5: "FAIL", 7: "pass"}, output[-3000:]
    assert min(replayed[4][0], replayed[5][0]) > 8 * MEDIAN_BOUND  # median rows at the stream's scale
