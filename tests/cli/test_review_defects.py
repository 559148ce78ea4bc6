"""Defects a hostile review found (issue 29), against the real CLI: each case ends with the faults table's exit code."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from helpers import ZERO_TOKEN
from helpers.cli import CPU, conversations, generate, invoke, write_jsonl
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import load_sample
from speculators_v016.testing.faults import VARIABLE as FAULT

COUNT = 12


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("review-data") / "chats.jsonl", conversations(COUNT, seed=29))


def test_a_failing_writer_callback_ends_the_run_with_exit_5(tmp_path, model_dir, data_file):
    """A writer thread's done() raising (memory the pool refuses): exit 5 naming the failure, never a hang."""
    out = tmp_path / "out"
    started = time.monotonic()
    result = generate(model_dir, data_file, out, "--logit-check-samples", 0, env={FAULT: "done-raises:2"}, timeout=240)
    assert result.exit_code == 5, result.output
    assert time.monotonic() - started < 240
    assert (
        "error: WriterThreadError: a sample-writer thread failed (RuntimeError: these tensors were not taken from "
        "this pool, or were given back twice); the run stops" in result.output
    ), result.output
    for entry in Manifest(out).entries().values():  # what is listed is complete
        assert (out / entry.file).stat().st_size == entry.bytes
    resumed = generate(model_dir, data_file, out)
    assert resumed.exit_code == 0, resumed.output
    assert invoke("verify", out).exit_code == 0


def test_half_a_layer_of_zero_rows_stops_the_run_naming_the_rows(tmp_path, model_dir, data_file):
    """Half of a layer's rows zeroed (the logit check cannot see that layer): exit 7 naming sample, layer, rows."""
    out = tmp_path / "out"
    args = ("--layer-ids", "2 4", "--max-samples", 6)
    result = generate(model_dir, data_file, out, *args, env={FAULT: "half-zero-rows:1"})
    assert result.exit_code == 7, result.output
    match = re.search(
        r"error: self-check failed: sample (\d+), layer 2: rows \[(\d+), (\d+), [\d, .]+\] \((\d+) of (\d+)\) are "
        r"all 0\. No model produces this",
        result.output,
    )
    assert match, result.output
    first, second, count, length = (int(match.group(k)) for k in (2, 3, 4, 5))
    assert (first, second, count) == (length // 2, length // 2 + 1, length - length // 2)
    assert Manifest(out).entries() == {} and not list(out.glob("data_*.safetensors"))
    resumed = generate(model_dir, data_file, out, *args)
    assert resumed.exit_code == 0 and "written:    6 samples (0 already done" in resumed.output, resumed.output


def test_a_deeply_nested_row_is_bad_input_naming_file_and_line(tmp_path, model_dir):
    """100,000 nested arrays on line 2: exit 3 naming file:2 (was exit 5, RecursionError); skippable."""
    rows = conversations(3)
    data = tmp_path / "deep.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    data.write_text(json.dumps(rows[0]) + "\n" + deep + "\n" + json.dumps(rows[1]) + "\n" + json.dumps(rows[2]) + "\n")
    result = generate(model_dir, data, tmp_path / "out")
    assert result.exit_code == 3, result.output
    assert f"error: {data}:2: JSON nested too deeply to read" in result.output, result.output
    assert "RecursionError" not in result.output
    skipped = generate(model_dir, data, tmp_path / "out2", "--skip-bad-rows")
    assert skipped.exit_code == 0 and "skipped:    1 bad row" in skipped.output, skipped.output
    assert len(Manifest(tmp_path / "out2").entries()) == 3


def test_a_row_the_chat_template_rejects_is_bad_input_naming_file_and_line(tmp_path, model_dir):
    """A row the target's template rejects (raise_exception), on line 3: exit 3 naming file:3; skippable."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    template = model / "chat_template.jinja"
    template.write_text(
        "{% for message in messages %}{% if message['content'] == 'REJECT ME' %}"
        "{{ raise_exception('this template refuses the row') }}{% endif %}{% endfor %}" + template.read_text()
    )
    rows = conversations(4)
    rows.insert(2, {"messages": [{"role": "user", "content": "REJECT ME"}, {"role": "assistant", "content": "ok"}]})
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    result = generate(model, data, tmp_path / "out")
    assert result.exit_code == 3, result.output
    assert (
        f"error: {data}:3: rejected by the chat template of the target's tokenizer (TemplateError: this template "
        "refuses the row); --skip-bad-rows skips and counts such rows" in result.output
    ), result.output
    assert not (tmp_path / "out" / "manifest.jsonl").exists()
    skipped = generate(model, data, tmp_path / "out2", "--skip-bad-rows")
    assert skipped.exit_code == 0 and "skipped:    1 bad row" in skipped.output, skipped.output
    assert "rejected by the chat template or tokenizer" not in skipped.output
    log = next((tmp_path / "out2" / "logs").glob("run-*.log")).read_text()
    assert f"skipping bad row {data}:3: rejected by the chat template (TemplateError" in log


SHM_RUNS = """mount -t tmpfs tmpfs /dev/shm || exit 99
PY="$1"; shift
run() { "$PY" -m speculators_v016.run.cli --target-model-path "$1" --train-data-path "$2" --output-dir /dev/shm \\
    --seq-length 256 --token-freq-path "" --executor mp --max-samples 4; }
run "$@"; echo "first run: $?"
run "$@"; echo "resume: $?"
"$PY" -m speculators_v016.run.cli verify /dev/shm; echo "verify: $?"
ls -a /dev/shm
"""


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare for a private /dev/shm")
def test_output_dir_dev_shm_with_the_mp_executor(tmp_path, model_dir, data_file):
    """--output-dir /dev/shm (a private one) with --executor mp: the run's post-run check, a resume and verify
    accept the run's own shared-memory records folder (were: exit 1, then exit 4)."""
    script = tmp_path / "runs.sh"
    script.write_text(SHM_RUNS)
    proc = subprocess.run(
        ["unshare", "-rm", "sh", str(script), sys.executable, model_dir, data_file],
        capture_output=True,
        text=True,
        env={**os.environ, **CPU},
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    if "exit 99" in output or proc.returncode == 99:
        pytest.skip("no private mount namespace here")
    assert "first run: 0" in output and "resume: 0" in output and "verify: 0" in output, output
    assert "files this tool did not write" not in output and "not a file of this tool" not in output, output
    assert re.search(r"^speculators-v016-runs-\d+$", output, re.M), output  # the records folder was there


def test_a_row_starting_with_a_zero_embedding_token_runs_and_verifies(tmp_path, zero_embedding_model):
    """A dataset row whose first token's embedding row is zero (exact-zero states at position 0 in every layer, as
    the model computes them): the run completes, logit check and verify ok, and records the token for verify."""
    rows = [{"input_ids": [ZERO_TOKEN, *range(20 + i, 60 + i)], "loss_mask": [0] * 10 + [1] * 31} for i in range(3)]
    data, out = write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "out"
    result = generate(zero_embedding_model, data, out)
    assert result.exit_code == 0, result.output
    assert re.search(r"logit check: ok \(3 samples", result.output) and "verify:     ok" in result.output
    config = json.loads((out / "data_config.json").read_text())
    assert config["speculators_v016"]["zero_embedding_token_ids"] == [ZERO_TOKEN]
    sample = load_sample(out / "data_0.safetensors")
    assert all(bool((h[0] == 0).all()) and bool((h[1:] != 0).any(dim=-1).all()) for h in sample["hidden_states"])
    assert invoke("verify", out).exit_code == 0
