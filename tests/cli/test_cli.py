"""speculators-data-gen end to end on CPU vLLM: demo, upstream-style runs, resume, shards, verify."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import blake3
import pytest
import torch

from helpers.cli import CPU, assert_one_voice, conversations, invoke, load_all, write_jsonl
from helpers.direct import writer_goes_direct
from helpers.reference import TOLERANCE, hf_layer_outputs
from speculators_v016.config import ConfigError, RunConfig, launcher_shards
from speculators_v016.exit_codes import ExitCode
from speculators_v016.run import huge_pages
from speculators_v016.run.cli import _join_multi_value
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.verify import verify
from speculators_v016.testing.faults import GPU_POOL
from speculators_v016.testing.faults import VARIABLE as FAULT


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", conversations(40))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, model_dir, data_file):
    """One uninterrupted run, the yardstick for resume and shards."""
    out = tmp_path_factory.mktemp("ref") / "out"
    result = invoke(
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--token-freq-path",
        out.parent / "tf.pt",
    )
    assert result.exit_code == 0, result.output
    return out


def test_demo_runs_and_verifies(tmp_path):
    """`speculators-data-gen demo` builds a model, generates in the CLI's default dtype (bf16), verifies, explains."""
    result = invoke("demo", "--dir", tmp_path)
    assert result.exit_code == 0, result.output
    assert "verify:     ok (20 samples)" in result.output and "logit check: ok" in result.output
    assert "eagle_aux_hidden_state_layer_ids = [3, 5, 6]" in result.output
    assert "torch.bfloat16" in result.output  # what a sample holds: the dtype users run
    assert_one_voice(result.output, [tmp_path / "logs"], dtype="bfloat16")
    host = re.search(r"host path: .* spent ([\d.]+) s in vLLM's steps, .* (\d+) write workers \(SCHED_BATCH\) busy (\d+)% .* buffer pool: "
                     r"(\d+) blocks made, (\d+) reused(?:, (\d+) samples in fresh memory \(CPU engine\))?",
                     result.output)  # fmt: skip
    assert host and float(host[1]) > 0 and int(host[2]) >= 1 and int(host[3]) <= 100, result.output[-3000:]
    made, reused, fresh = int(host[4]), int(host[5]), int(host[6] or 0)
    if huge_pages.heap_kept({**os.environ, **CPU}.get("GLIBC_TUNABLES", "")):  # the heap kept: every sample in a block
        assert fresh == 0 and made >= 1 and made + reused == 20, host.group(0)
    else:  # a CPU engine: every sample (under glibc's mmap ceiling) in fresh memory, none in pooled blocks
        assert (made, reused, fresh) == (0, 0, 20), host.group(0)
    paths = re.search(r"bytes written with O_DIRECT ([\d.]+)% from the samples' memory, ([\d.]+)% through a bounce "
                      r"buffer, ([\d.]+)% through the page cache", result.output)  # fmt: skip
    assert paths and sum(map(float, paths.groups())) == pytest.approx(100, abs=0.2), result.output[-3000:]
    assert "NaN/Inf test: 0 samples proven on the device, 20 tested by the writers" in result.output  # a CPU engine
    if writer_goes_direct(tmp_path):  # the states' memory placed as the files' data is: most bytes go from there
        assert float(paths[3]) == 0 and float(paths[1]) > 50, paths.group(0)


def test_a_run_of_many_steps_says_its_mid_run_rate(model_dir, data_file, tmp_path):
    """A run of many small steps ends its host line with the forward's rate from half to nine tenths of the samples."""
    result = invoke(
        "--target-model-path", model_dir, "--train-data-path", data_file, "--output-dir", tmp_path / "out",
        "--seq-length", 256, "--max-num-batched-tokens", 64, "--max-num-seqs", 4, "--logit-check-samples", 0,
        "--token-freq-path", "",
    )  # fmt: skip
    assert result.exit_code == 0, result.output[-3000:]
    whole = re.search(r"of generation to the last file made durable \(([\d,]+) tokens/s", result.output)
    mid = re.search(r"; from half to nine tenths of the tokens at ([\d,]+) tokens/s\n", result.output)
    assert whole and mid, result.output[-3000:]
    rates = [float(found[1].replace(",", "")) for found in (whole, mid)]
    assert rates[0] / 5 < rates[1] < rates[0] * 5, rates  # the same forward, timed over its middle
    config = json.loads((tmp_path / "out" / "data_config.json").read_text())
    assert config["speculators_v016"]["last_run"]["host"]["mid_run_rate"] == pytest.approx(rates[1], abs=1)


def test_reference_run_is_complete_and_exact(reference_run, model_dir):
    """Every sample is written, verified, and equals transformers within 1e-5."""
    config = json.loads((reference_run / "data_config.json").read_text())
    assert config["hidden_states"]["layer_ids"] == [2, 4, 5, 7]  # upstream's field
    assert config["speculators_v016"]["layers"]["eagle_aux_hidden_state_layer_ids"] == [3, 5, 6]
    samples = load_all(reference_run)
    assert sorted(samples) == list(range(40))
    prompts = [samples[i]["input_ids"].tolist() for i in range(0, 40, 8)]
    reference = hf_layer_outputs(model_dir, prompts)
    for i, ref in zip(range(0, 40, 8), reference):
        for state, layer in zip(samples[i]["hidden_states"], [2, 4, 5, 7]):
            assert (state - ref[layer]).abs().max().item() < TOLERANCE
        mask = samples[i]["loss_mask"]
        assert mask.shape == samples[i]["input_ids"].shape and 0 < int(mask.sum()) < mask.numel()


def test_upstream_invocation_with_pt_format(tmp_path, model_dir, data_file):
    """Upstream's option names (nargs layer ids included) work; --format pt is upstream's layout."""
    out = tmp_path / "out"
    result = invoke(
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--max-samples",
        6,
        "--layer-ids",
        "1 3 7",
        "--batch-size",
        4,
        "--tensor-parallel-size",
        1,
        "--gpu-memory-utilization",
        0.5,
        "--token-freq-path",
        tmp_path / "token_freq.pt",
        "--seed",
        3,
        "--start-idx",
        100,
        "--num-preprocessing-workers",
        1,
        "--format",
        "pt",
    )
    assert result.exit_code == 0, result.output
    files = sorted(out.glob("data_*.pt"))
    assert [f.name for f in files] == [f"data_{i}.pt" for i in (100, 101, 102, 103, 104, 105)]
    sample = torch.load(files[0], weights_only=True)
    assert set(sample) == {"input_ids", "hidden_states", "loss_mask"}
    assert len(sample["hidden_states"]) == 3 and sample["hidden_states"][0].shape == (len(sample["input_ids"]), 128)
    assert (tmp_path / "token_freq.pt").exists()


def test_layer_ids_nargs_from_the_command_line():
    """The real entry point turns upstream's `--layer-ids 2 16 29` into one value."""
    assert _join_multi_value(["--layer-ids", "2", "16", "29", "--seed", "1"], "--layer-ids") == [
        "--layer-ids",
        "2 16 29",
        "--seed",
        "1",
    ]


def test_environment_variables_set_options(tmp_path, model_dir, data_file):
    """Options come from SPECULATORS_DATA_GEN_* variables too."""
    out = tmp_path / "env-out"
    result = invoke(
        "--train-data-path",
        data_file,
        "--max-samples",
        2,
        "--seq-length",
        128,
        "--token-freq-path",
        "",
        env={"SPECULATORS_DATA_GEN_TARGET_MODEL_PATH": str(model_dir), "SPECULATORS_DATA_GEN_OUTPUT_DIR": str(out)},
    )
    assert result.exit_code == 0, result.output
    assert len(Manifest(out).entries()) == 2


def test_two_shards_verify_as_one(tmp_path, model_dir, data_file, reference_run):
    """Shards 0 and 1 of 2, written separately, verify as one dataset equal to the unsharded one."""
    out = tmp_path / "sharded"
    for index in (0, 1):
        result = invoke(
            "--target-model-path",
            model_dir,
            "--train-data-path",
            data_file,
            "--output-dir",
            out,
            "--seq-length",
            256,
            "--token-freq-path",
            "",
            "--num-shards",
            2,
            "--shard-index",
            index,
        )
        assert result.exit_code == 0, result.output
    result = invoke("verify", out)
    assert result.exit_code == 0, result.output
    assert "ok: 40 samples" in result.output and "in 2 folder(s)" in result.output
    reference = load_all(reference_run)
    for shard in (0, 1):
        for i, sample in load_all(out / f"shard-{shard:05d}-of-00002").items():
            assert i % 2 == shard
            assert torch.equal(sample["input_ids"], reference[i]["input_ids"])


def test_a_shard_with_another_seed_than_its_sibling_is_refused(tmp_path, model_dir, data_file):
    """Shard 1 of 2 with --seed 1 beside shard 0 made with the default seed: refused before its engine starts,
    naming the seed and shard 0's folder; shard 0's samples are kept and shard 1 writes none."""
    out = tmp_path / "sharded"
    common = ("--target-model-path", model_dir, "--train-data-path", data_file, "--output-dir", out,
              "--seq-length", 256, "--token-freq-path", "", "--num-shards", 2)  # fmt: skip
    assert invoke(*common, "--shard-index", 0).exit_code == 0
    first = out / "shard-00000-of-00002"
    kept = sorted(p.name for p in first.iterdir())
    result = invoke(*common, "--shard-index", 1, "--seed", 1)
    assert result.exit_code == ExitCode.OUTPUT_REFUSED, result.output
    assert "made with other settings" in result.output and "preprocessing.seed: 0 -> 1" in result.output
    assert str(first) in result.output
    assert sorted(p.name for p in first.iterdir()) == kept
    assert not [p for p in (out / "shard-00001-of-00002").iterdir() if p.name.endswith(".safetensors")]


def test_one_shard_alone_does_not_verify_as_complete(tmp_path, model_dir, data_file):
    """A missing shard is reported by verify."""
    out = tmp_path / "half"
    result = invoke(
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--token-freq-path",
        "",
        "--num-shards",
        2,
        "--shard-index",
        1,
        "--max-samples",
        8,
    )
    assert result.exit_code == 0, result.output
    result = invoke("verify", out)
    assert result.exit_code == 1 and "shards [0] of 2 are missing" in result.output


def _write_helpers_alive() -> list[int]:
    """Pids of write helper processes (speculators_v016.store.write_helper) alive on this machine."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"speculators_v016.store.write_helper" in (entry / "cmdline").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_write_helpers_write_a_gpu_pools_samples_as_the_threads_do(tmp_path, model_dir, data_file, reference_run):
    """A GPU engine's pool (every sample in shared blocks): helpers write all 40 files, the reference run's bytes."""
    out = tmp_path / "helped"
    args = [sys.executable, "-m", "speculators_v016.testing.faults", "--target-model-path", model_dir,
            "--train-data-path", data_file, "--output-dir", out, "--seq-length", 256, "--token-freq-path", "",
            "--write-helpers", "on"]  # fmt: skip
    env = {**os.environ, **CPU, GPU_POOL: "1"}
    proc = subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "(40 files written by their helper processes)" in output, output[-3000:]
    assert "this process and its write helpers used" in output
    assert re.search(r"buffer pool: \d+ blocks made, \d+ reused;", output), output[-3000:]  # none fresh
    helped, reference = Manifest(out).entries(), Manifest(reference_run).entries()
    assert sorted(helped) == sorted(reference) == list(range(40))
    assert {i: e.digest for i, e in helped.items()} == {i: e.digest for i, e in reference.items()}
    assert invoke("verify", out).exit_code == 0
    assert not _write_helpers_alive()


@pytest.mark.parametrize("helpers", [False, True], ids=["threads", "write-helpers"])
def test_sigkill_then_resume_equals_uninterrupted(tmp_path, model_dir, data_file, reference_run, helpers):
    """A run killed with SIGKILL mid-way resumes to exactly the uninterrupted run's samples (its files written by
    the writer threads, or by their helper processes from a GPU engine's pool: they end with it)."""
    out = tmp_path / "killed"
    args = [
        sys.executable,
        "-m",
        "speculators_v016.testing.faults",  # the real command, its engine paced: the kill lands mid-run
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--token-freq-path",
        "",
        "--max-num-seqs",
        2,
        "--write-workers",
        1,
        "--row-copies",
        "thread",  # killed while a step's rows are on the copy thread (the GPU default); resumed inline
    ]
    env = {**os.environ, **CPU, "SPECULATORS_V016_FAULT": "pace:100"}  # a sample a 0.1 s at most
    env.update({GPU_POOL: "1", "SPECULATORS_DATA_GEN_WRITE_HELPERS": "on"} if helpers else {})
    proc = subprocess.Popen([str(a) for a in args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if len(Manifest(out).entries()) >= 5:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    if helpers:
        assert _write_helpers_alive(), "no write helper was running"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while _write_helpers_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _write_helpers_alive(), "a write helper outlived its run"
    partial = len(Manifest(out).entries())
    assert 5 <= partial < 40
    result = invoke("verify", out, "--partial")
    assert result.exit_code == 0, result.output  # what was written before the kill is intact
    result = invoke(
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--token-freq-path",
        "",
    )
    assert result.exit_code == 0, result.output
    assert f"({partial} already done before this run)" in result.output or partial >= 40
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    resumed, reference = load_all(out), load_all(reference_run)
    assert sorted(resumed) == sorted(reference) == list(range(40))
    for i in reference:
        assert torch.equal(resumed[i]["input_ids"], reference[i]["input_ids"])
        assert torch.equal(resumed[i]["loss_mask"], reference[i]["loss_mask"])
        for a, b in zip(resumed[i]["hidden_states"], reference[i]["hidden_states"]):
            assert (a - b).abs().max().item() < TOLERANCE


def test_a_default_run_lists_standard_blake3_digests(reference_run):
    """Every manifest line of a default run holds the BLAKE3 of its file's bytes, and data_config.json says so."""
    config = json.loads((reference_run / "data_config.json").read_text())
    assert config["speculators_v016"]["checksum"] == "blake3"
    lines = [json.loads(line) for line in (reference_run / "manifest.jsonl").read_text().splitlines()]
    assert len(lines) == 40
    for line in lines:
        assert "sha256" not in line
        assert line["blake3"] == blake3.blake3((reference_run / line["file"]).read_bytes()).hexdigest()


def test_an_earlier_releases_sha256_folder_resumes_as_sha256(tmp_path, model_dir, data_file, reference_run):
    """A sha256 folder as earlier releases left it resumes with sha256; asking for blake3 on it is refused."""
    out = tmp_path / "old"
    args = ("--target-model-path", model_dir, "--train-data-path", data_file, "--output-dir", out)
    args += ("--seq-length", 256, "--token-freq-path", "")
    result = invoke(*args, env={"SPECULATORS_DATA_GEN_CHECKSUM": "sha256"})
    assert result.exit_code == 0, result.output
    # what an earlier release leaves after an interrupted run: no checksum field, sha256 lines, samples to redo
    config = json.loads((out / "data_config.json").read_text())
    assert config["speculators_v016"].pop("checksum") == "sha256"
    (out / "data_config.json").write_text(json.dumps(config, indent=2))
    manifest = Manifest(out)
    kept = {i: e for i, e in manifest.entries().items() if i < 10}
    for i in range(10, 40):
        (out / f"data_{i}.safetensors").unlink()
    manifest.compact(kept)
    old = (out / "manifest.jsonl").read_bytes()
    assert old.count(b'"sha256": "') == 10 and b"blake3" not in old

    refused = invoke(*args, "--checksum", "blake3")
    assert refused.exit_code == 4, refused.output
    assert "holds 10 samples listed with sha256 digests; this run asks for --checksum blake3" in refused.output
    assert (out / "manifest.jsonl").read_bytes() == old

    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "(10 already done before this run)" in result.output
    assert "resuming a folder of sha256 digests: its new samples are listed with sha256 too" in result.output
    assert (out / "manifest.jsonl").read_bytes().startswith(old)  # the old lines stay as they were
    entries = Manifest(out).entries()
    assert sorted(entries) == list(range(40)) and {e.algorithm for e in entries.values()} == {"sha256"}
    assert json.loads((out / "data_config.json").read_text())["speculators_v016"]["checksum"] == "sha256"
    verified = invoke("verify", out)
    assert verified.exit_code == 0, verified.output
    target = out / "data_20.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))
    corrupted = invoke("verify", out)
    assert corrupted.exit_code == 1 and f"{target}: size or sha256 differs from the manifest" in corrupted.output


def test_trainer_dataset_reads_both_formats(reference_run, tmp_path, model_dir, data_file):
    """upstream's Eagle3SampleFileDataset loads our safetensors and pt folders."""
    from speculators.train.data import (  # noqa: PLC0415 - upstream: slow to import, this test only
        Eagle3SampleFileDataset,
    )

    pt_out = tmp_path / "pt"
    result = invoke(
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--output-dir",
        pt_out,
        "--seq-length",
        256,
        "--token-freq-path",
        "",
        "--format",
        "pt",
        "--max-samples",
        4,
    )
    assert result.exit_code == 0, result.output
    for folder, count in ((reference_run, 40), (pt_out, 4)):
        dataset = Eagle3SampleFileDataset(max_len=256, datapath=str(folder))
        assert len(dataset) == count
        item = dataset[0]
        assert item["hidden_states"].shape[-1] == 3 * 128  # three input layers concatenated
        assert item["verifier_last_hidden_states"].shape[-1] == 128


def test_eagle3_trainer_runs_on_generated_data(reference_run, model_dir, tmp_path):
    """A few steps of upstream's EAGLE-3 Trainer run on CPU on our safetensors output."""
    script = Path(__file__).parents[1] / "helpers" / "eagle3_train_steps.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            model_dir,
            str(reference_run),
            str(reference_run.parent / "tf.pt"),
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {k: result[k] for k in ("steps", "changed", "finite")} == {"steps": 4, "changed": True, "finite": True}
    assert len(result["losses"]) == 4 and all(math.isfinite(x) for x in result["losses"])


def test_check_compares_with_transformers(model_dir, data_file):
    """`check` prints per-layer errors against transformers and a replay of each layer; passes for fp32."""
    result = invoke(
        "check",
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--samples",
        3,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--seq-length",
        256,
    )
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines() if line.strip().endswith(("pass", "FAIL"))]
    layers = [r for r in rows if r[0].isdigit()]
    assert [int(r[0]) for r in layers] == [2, 4, 5, 7]
    assert all(r[-1] == "pass" and float(r[1]) < TOLERANCE for r in layers)
    replayed = [r for r in rows if r[0] == "replay"]  # layer L from our captured L-1 (captured for the check)
    assert [(int(r[1]), int(r[2])) for r in replayed] == [(2, 1), (4, 3), (5, 4), (7, 6)]
    assert all(r[-1] == "pass" and float(r[3]) < TOLERANCE for r in replayed)
    assert "logit check: ok (3 samples" in result.output


def test_check_without_transformers_uses_only_the_final_head(model_dir, data_file):
    """`check --no-transformers` (targets too big to load) runs the logit check and the one-layer replay only."""
    result = invoke(
        "check",
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--samples",
        2,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--seq-length",
        256,
        "--no-transformers",
    )
    assert result.exit_code == 0, result.output
    assert "logit check: ok (2 samples" in result.output and "max abs err" not in result.output
    assert sum(line.startswith("replay") and line.endswith("pass") for line in result.output.splitlines()) == 4


def test_check_replay_finds_a_wrong_intermediate_layer(model_dir, data_file):
    """Injected: layer 4 holds layer 3's states. The logit check passes; the layer replay fails on 4 and 5."""
    result = invoke(
        "check",
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--samples",
        2,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--seq-length",
        256,
        "--no-transformers",
        env={FAULT: "wrong-layer:1"},
    )
    assert result.exit_code == 1, result.output
    assert "logit check: ok (2 samples" in result.output
    replayed = {
        int(r[1]): (float(r[4]), r[-1])
        for r in (line.split() for line in result.output.splitlines())
        if r and r[0] == "replay"
    }
    assert {k: v[1] for k, v in replayed.items()} == {2: "pass", 4: "FAIL", 5: "FAIL", 7: "pass"}
    assert replayed[4][0] > 0.1 and replayed[5][0] > 0.1  # at the scale of the stream, not of rounding


def test_shards_default_from_the_launcher(monkeypatch):
    """--num-shards/--shard-index default to torchrun's WORLD_SIZE/RANK, else SLURM's, else 1/0."""
    for name in ("WORLD_SIZE", "RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert launcher_shards(None, None) == (1, 0)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert launcher_shards(None, None) == (4, 2)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    assert launcher_shards(None, None) == (8, 5)
    assert launcher_shards(2, 1) == (2, 1)
    engine = {"model": "m", "tensor_parallel_size": 1}
    launched = RunConfig.build(engine, train_data_path=("d",), output_dir=Path("o"))  # the run's config asks too
    assert (launched.num_shards, launched.shard_index) == (8, 5)
    with pytest.raises(ConfigError, match="shard index 3 is not in") as refused:
        RunConfig.build(engine, train_data_path=("d",), output_dir=Path("o"), num_shards=2, shard_index=3)
    assert refused.value.option == "--shard-index"


def test_quick_verify_after_a_run_skips_reading_files(reference_run, tmp_path):
    """The post-run check compares sizes with the manifest; `verify` reads contents and finds a flipped byte."""
    copy = tmp_path / "copy"
    shutil.copytree(reference_run, copy)
    target = copy / "data_3.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    target.write_bytes(bytes(data))
    assert verify(copy, deep=False).ok
    deep = verify(copy)
    assert not deep.ok and deep.problems == [f"{target}: size or blake3 differs from the manifest"]
