"""Faults against the real CLI and engine (SIGKILL, disk full, a dead worker, the self-check): nothing is lost."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from helpers.cli import CPU, conversations, generate, invoke, load_all, write_jsonl
from helpers.reference import TOLERANCE
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import load_sample
from speculators_v016.testing.faults import PLANTED_FAILURE
from speculators_v016.testing.faults import VARIABLE as FAULT

COUNT = 30


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("fault-data") / "chats.jsonl", conversations(COUNT, seed=5))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir, data_file):
    out = tmp_path_factory.mktemp("fault-ref") / "out"
    result = generate(model_dir, data_file, out)
    assert result.exit_code == 0, result.output
    return load_all(out)


def assert_resumes_to_reference(model_dir, data_file, out, reference):
    """Finish the run and compare it with the uninterrupted one; verify the folder."""
    result = generate(model_dir, data_file, out)
    assert result.exit_code == 0, result.output
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]
    assert len(Manifest(out).path.read_text().splitlines()) == COUNT  # no duplicate lines
    resumed = load_all(out)
    assert sorted(resumed) == sorted(reference) == list(range(COUNT))
    for i, sample in reference.items():
        assert torch.equal(resumed[i]["input_ids"], sample["input_ids"])
        assert torch.equal(resumed[i]["loss_mask"], sample["loss_mask"])
        for a, b in zip(resumed[i]["hidden_states"], sample["hidden_states"]):
            assert (a - b).abs().max().item() < TOLERANCE
    assert invoke("verify", out).exit_code == 0


@pytest.mark.parametrize("point", ["kill-mid-write:4", "kill-before-manifest:4"])
def test_sigkill_during_a_write_or_before_its_manifest_line(point, tmp_path, model_dir, data_file, reference):
    """SIGKILL mid-write or between rename and manifest: no partial final file; resume completes exactly."""
    out = tmp_path / "out"
    result = generate(model_dir, data_file, out, "--write-workers", 1, env={FAULT: point})
    assert result.exit_code == -signal.SIGKILL
    entries = Manifest(out).entries()
    assert len(entries) == 3
    for name in (p.name for p in out.glob("data_*.safetensors")):  # every final file is complete
        assert (out / name).stat().st_size > 0
    partial = invoke("verify", out, "--partial")
    assert partial.exit_code == 0, partial.output
    if point.startswith("kill-mid-write"):
        assert "temporary file left by an interrupted write" in partial.output
    else:
        assert "sample file not in the manifest" in partial.output
    assert_resumes_to_reference(model_dir, data_file, out, reference)


@pytest.mark.parametrize("point", ["kill-after-rename:5", "kill-mid-commit:2", "kill-after-commit:2"])
def test_sigkill_around_a_group_commit(point, tmp_path, model_dir, data_file, reference):
    """SIGKILL between rename and commit, mid-commit or after one: every final file complete; resume adds only the rest."""
    out = tmp_path / "out"
    result = generate(model_dir, data_file, out, "--write-workers", 2, env={FAULT: point})
    assert result.exit_code == -signal.SIGKILL
    manifest = Manifest(out)
    listed = manifest.entries()
    if point.startswith("kill-mid-commit"):
        assert not manifest.path.read_text().endswith("\n")  # a torn last line, which is ignored
    final = sorted(out.glob("data_*.safetensors"))
    assert len(final) >= len(listed) and all((out / e.file).is_file() for e in listed.values())
    if point.startswith("kill-after-rename"):
        assert len(final) > len(listed)  # in place, not yet committed
    for path in final:  # complete under its final name, listed or not
        index = int(path.stem.removeprefix("data_"))
        sample = load_sample(path)
        assert torch.equal(sample["input_ids"], reference[index]["input_ids"])
        for a, b in zip(sample["hidden_states"], reference[index]["hidden_states"]):
            assert (a - b).abs().max().item() < TOLERANCE
    partial = invoke("verify", out, "--partial")
    assert partial.exit_code == 0, partial.output
    kept = {e.file: ((out / e.file).stat().st_ino, (out / e.file).stat().st_mtime_ns) for e in listed.values()}
    assert_resumes_to_reference(model_dir, data_file, out, reference)
    assert {f: ((out / f).stat().st_ino, (out / f).stat().st_mtime_ns) for f in kept} == kept  # not rewritten


def test_disk_full_aborts_naming_the_path_and_resumes(tmp_path, model_dir, data_file, reference):
    """A write failing with ENOSPC stops the run (exit 6) naming the file; a rerun completes."""
    out = tmp_path / "out"
    result = generate(model_dir, data_file, out, env={FAULT: "enospc-write:5"})
    assert result.exit_code == 6, result.output
    assert re.search(r"cannot write .*/out/data_\d+\.safetensors: No space left on device", result.output)
    assert len(Manifest(out).entries()) < COUNT
    assert invoke("verify", out, "--partial").exit_code == 0
    assert_resumes_to_reference(model_dir, data_file, out, reference)


def test_worker_death_aborts_promptly_and_resumes(tmp_path, model_dir, reference):
    """Killing vLLM's worker process ends the run with an error (no hang); a rerun completes."""
    rows = conversations(400, seed=9)
    distinct = len({json.dumps(r, sort_keys=True) for r in rows})  # exact duplicates are dropped (and counted)
    data = write_jsonl(tmp_path / "many.jsonl", rows)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "speculators_v016.run.cli",
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--token-freq-path",
        "",
        "--executor",
        "mp",
        "--max-num-seqs",
        2,
    ]
    proc = subprocess.Popen(
        [str(c) for c in cmd], env={**os.environ, **CPU}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 300
    while len(Manifest(out).entries()) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    workers = [
        c
        for c in psutil.Process(proc.pid).children(recursive=True)
        if "python" in c.name().lower() or "vllm" in " ".join(c.cmdline()).lower()
    ]
    assert proc.poll() is None and workers, "run ended before a worker could be killed"
    killed_at = time.monotonic()
    for worker in workers:
        worker.kill()
    output, _ = proc.communicate(timeout=120)
    assert time.monotonic() - killed_at < 120
    assert proc.returncode == 5, output[-2000:]
    assert re.search(r"error: .*(died|dead|Worker|worker)", output), output[-2000:]
    log = re.search(r"last lines of the log \((\S+\.log)\):", output)  # the cause, then where to read more
    assert log and Path(log.group(1)).is_file() and Path(log.group(1)).parent == out / "logs", output[-2000:]
    assert "Initializing a V1 LLM engine" in Path(log.group(1)).read_text(errors="replace")
    assert invoke("verify", out, "--partial").exit_code == 0
    result = generate(model_dir, data, out, "--max-num-seqs", 8)
    assert result.exit_code == 0, result.output
    assert len(Manifest(out).entries()) == distinct
    assert distinct == 400 or f"skipped:    {400 - distinct} duplicate row" in result.output, result.output[-2000:]


def test_a_failed_execute_model_is_the_first_error_named(tmp_path, model_dir, data_file, reference):
    """vLLM's execute_model failing mid-run: exit 5, the first error line names its failure, not the capture's."""
    out = tmp_path / "out"
    result = generate(model_dir, data_file, out, env={FAULT: "execute-model-fails:2"})
    assert result.exit_code == 5, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors, result.output
    assert re.fullmatch(
        rf"error: ExecuteModelError: vLLM's execute_model failed at step \d+: RuntimeError: {PLANTED_FAILURE}",
        errors[0],
    ), result.output
    assert "holds no aux hidden states" not in errors[0]
    assert_resumes_to_reference(model_dir, data_file, out, reference)


def test_nan_states_are_not_written_and_reported(tmp_path, model_dir, data_file):
    """A sample with NaN states is skipped and named with its layer; the limit aborts a run."""
    out = tmp_path / "out"
    result = generate(model_dir, data_file, out, env={FAULT: "nan-sample:3"})
    assert result.exit_code == 0, result.output
    match = re.search(r"sample (\d+): NaN/Inf hidden states in layers \[7\]: not written", result.output)
    assert match, result.output
    assert int(match.group(1)) not in Manifest(out).entries() and len(Manifest(out).entries()) == COUNT - 1
    assert "skipped:    1 NaN/Inf hidden states" in result.output
    strict = generate(model_dir, data_file, tmp_path / "strict", "--max-bad-samples", 0, env={FAULT: "nan-sample:2"})
    assert strict.exit_code == 5 and "limit --max-bad-samples 0" in strict.output


def test_a_nan_made_in_the_forward_is_refused_through_the_capture_path(tmp_path, model_dir, data_file):
    """A NaN planted in a step's aux states in the worker, before the copy, keeps its one sample out of the folder."""
    out = tmp_path / "out"
    result = generate(model_dir, data_file, out, "--logit-check-samples", 0, env={FAULT: "nan-step:1"})
    assert result.exit_code == 0, result.output
    match = re.search(r"sample (\d+): NaN/Inf hidden states in layers \[[\d, ]+\]: not written", result.output)
    assert match, result.output
    assert int(match.group(1)) not in Manifest(out).entries() and len(Manifest(out).entries()) == COUNT - 1
    assert "skipped:    1 NaN/Inf hidden states" in result.output


def test_logit_check_failure_stops_the_run_before_writing(tmp_path, model_dir, data_file, reference):
    """States shifted by one position fail the logit check: exit 7, nothing written, a resume redoes them all."""
    out = tmp_path / "out"
    result = generate(model_dir, data_file, out, env={FAULT: "shift-check:2"})
    assert result.exit_code == 7, result.output
    assert re.search(
        r"error: self-check failed: sample \d+: the captured last layer, normed and projected, does not "
        r"reproduce vLLM's own prompt logprobs \(logit check: max \|delta\| [\d.e+-]+, tolerance 1e-04\)",
        result.output,
    ), result.output
    assert "the run stops before writing any sample" in result.output
    assert Manifest(out).entries() == {} and not list(out.glob("data_*.safetensors"))
    assert_resumes_to_reference(model_dir, data_file, out, reference)


def test_all_zero_states_stop_the_run_without_the_logit_check(tmp_path, model_dir, data_file):
    """All states 0 (a ring replaced by an empty file) with layers the logit check cannot judge: exit 7, named."""
    out = tmp_path / "out"
    args = ("--layer-ids", "2 4", "--max-samples", 8)
    result = generate(model_dir, data_file, out, *args, env={FAULT: "zero-states:1"})
    assert result.exit_code == 7, result.output
    assert re.search(
        r"error: self-check failed: sample \d+, layer 2: every value is 0. No model produces this", result.output
    ), result.output
    assert Manifest(out).entries() == {} and not list(out.glob("data_*.safetensors"))
    resumed = generate(model_dir, data_file, out, *args)
    assert resumed.exit_code == 0 and "written:    8 samples (0 already done" in resumed.output, resumed.output
    assert invoke("verify", out).exit_code == 0


def test_zero_states_mid_run_stop_it_keeping_what_passed(tmp_path, model_dir, data_file, reference):
    """States going to 0 mid-run (no logit check holding samples back): exit 7 naming the sample; samples written
    before stay valid; resume completes."""
    out = tmp_path / "out"
    result = generate(
        model_dir, data_file, out, "--write-workers", 1, "--logit-check-samples", 0, env={FAULT: "zero-states:6"}
    )
    assert result.exit_code == 7, result.output
    match = re.search(r"self-check failed: sample (\d+), layer 2: every value is 0", result.output)
    assert match, result.output
    assert "every sample written passed this check and is kept" in result.output
    entries = Manifest(out).entries()
    assert int(match.group(1)) not in entries and 0 < len(entries) < COUNT
    partial = invoke("verify", out, "--partial")  # reads every file: states, NaN, degenerate layers
    assert partial.exit_code == 0, partial.output
    assert_resumes_to_reference(model_dir, data_file, out, reference)


def test_a_torn_first_manifest_line_is_cut_off_on_resume(tmp_path, model_dir, data_file):
    """The first manifest line torn (disk full, power loss): the resume rewrites it, the folder verifies."""
    out = tmp_path / "out"
    assert generate(model_dir, data_file, out, "--max-samples", 4).exit_code == 0
    manifest = out / "manifest.jsonl"
    manifest.write_bytes(manifest.read_bytes()[:25])
    result = generate(model_dir, data_file, out, "--max-samples", 4)
    assert result.exit_code == 0, result.output
    assert "written:    4 samples (0 already done before this run)" in result.output
    assert sorted(Manifest(out).entries()) == [0, 1, 2, 3]
    verified = invoke("verify", out)
    assert verified.exit_code == 0, verified.output
