"""Rows, ids, models and output folders the real command must refuse or survive: each named, nothing lost.

(Split from test_faults.py, which keeps crashes and the self-check, so that the two files run side by side
under tools/test.sh.)"""

import fcntl
import json
import os
import pickle
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from helpers.cli import conversations, generate, invoke, load_all, write_jsonl
from helpers.reference import TOLERANCE, hf_layer_outputs, max_abs_error
from speculators_v016.store import checksum
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.outdir import LOCK
from speculators_v016.testing.tiny_models import train_tokenizer

COUNT = 30


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("fault-data") / "chats.jsonl", conversations(COUNT, seed=5))


def test_unusable_rows_are_skipped_by_reason(tmp_path, model_dir):
    """Empty and no-assistant rows are counted by reason; a row whose role is not read is refused naming it, or
    with --skip-bad-rows counted by reason (never its turn dropped); none at all is an error."""
    good = conversations(3)
    rows = good + [
        {"conversations": []},
        {"conversations": [{"from": "human", "value": "only a question"}]},
        {"conversations": [{"from": "narrator", "value": "nobody speaks"}]},
    ]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    refused = generate(model_dir, data, tmp_path / "refused")
    assert refused.exit_code == 3 and f"{data}:6: turn 0 has role 'narrator', which is not read" in refused.output
    result = generate(model_dir, data, tmp_path / "out", "--skip-bad-rows")
    assert result.exit_code == 0, result.output
    assert "skipped:    1 empty conversation" in result.output
    assert "skipped:    1 no assistant (trainable) tokens" in result.output
    assert "skipped:    1 unknown turn role" in result.output
    assert len(Manifest(tmp_path / "out").entries()) == 3
    nothing = generate(model_dir, write_jsonl(tmp_path / "bad.jsonl", rows[3:]), tmp_path / "none", "--skip-bad-rows")
    assert nothing.exit_code == 3 and "no usable sample" in nothing.output


def test_long_rows_are_truncated_and_counted(tmp_path, model_dir):
    """Rows over --seq-length are cut to it, counted, and their loss masks stay aligned."""
    long = {
        "conversations": [
            {"from": "human", "value": "tell me more"},
            {"from": "gpt", "value": "the quick brown fox " * 40},
        ]
    }
    short = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "the fox"}]}
    out = tmp_path / "out"
    result = invoke(
        "--target-model-path",
        model_dir,
        "--train-data-path",
        write_jsonl(tmp_path / "long.jsonl", [long] + [short, short]),
        "--output-dir",
        out,
        "--seq-length",
        48,
        "--token-freq-path",
        "",
    )
    assert result.exit_code == 0, result.output
    assert "truncated:  1" in result.output, result.output[result.output.find("output:") :]
    lengths = sorted(s["input_ids"].shape[0] for s in load_all(out).values())
    assert lengths[-1] == 48
    assert all(s["loss_mask"].shape == s["input_ids"].shape for s in load_all(out).values())


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "bad.jsonl:2: not valid JSON"),
        ('{"foo": 1}', "bad.jsonl:2: no 'conversations' or 'messages' list"),
        ('{"conversations": [{"from": "human", "value": 5}]}', "bad.jsonl:2: turn 0 needs string"),
    ],
)
def test_malformed_rows_name_file_and_line(line, message, tmp_path, model_dir):
    """A malformed row fails with file and line (exit 3), or is skipped and counted with --skip-bad-rows."""
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(conversations(1)[0]) + "\n" + line + "\n" + json.dumps(conversations(2)[1]) + "\n")
    result = generate(model_dir, data, tmp_path / "out")
    assert result.exit_code == 3 and message in result.output, result.output
    skipped = generate(model_dir, data, tmp_path / "out2", "--skip-bad-rows")
    assert skipped.exit_code == 0 and "skipped:    1 bad row" in skipped.output, skipped.output


def test_out_of_vocabulary_ids_fail_before_the_engine(tmp_path, model_dir):
    """Pre-tokenized ids outside the vocabulary fail (exit 3) before the engine starts or anything is written."""
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [5, 99999], "loss_mask": [0, 1]}]
    out = tmp_path / "out"
    result = generate(model_dir, write_jsonl(tmp_path / "tok.jsonl", rows), out)
    assert result.exit_code == 3 and "outside the vocabulary" in result.output and "99999" in result.output
    assert not (out / "data_config.json").exists() and "engine ready" not in result.output


@pytest.mark.parametrize("ids, message", [("2 99", "out of range"), ("3 3", "more than once")])
def test_bad_layer_ids_fail_before_the_engine(ids, message, tmp_path, model_dir, data_file):
    """Invalid or duplicate layer ids: exit 3 before vLLM starts."""
    result = generate(model_dir, data_file, tmp_path / "out", "--layer-ids", ids)
    assert result.exit_code == 3 and message in result.output and "engine ready" not in result.output


def test_gpt2_runs_once_its_stream_is_proven(tmp_path, data_file):
    """GPT-2 (transformer.h, the stream as one tensor) runs after the start-up stream proof; states match transformers."""
    model = tmp_path / "gpt2"
    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 5)
    GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=len(tokenizer), n_positions=512)
    ).save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "out"
    result = generate(model, data_file, out, "--layer-ids", "0 1", "--max-samples", 4)
    assert result.exit_code == 0, result.output
    samples = load_all(out)
    assert sorted(samples) == [0, 1, 2, 3]
    reference = hf_layer_outputs(str(model), [s["input_ids"].tolist() for s in samples.values()])
    assert max_abs_error(list(samples.values()), reference, [0, 1]) < TOLERANCE


def test_resume_with_other_settings_is_refused(tmp_path, model_dir, data_file):
    """Resuming with another seq length, layers or dataset is refused (exit 4), naming what differs."""
    out = tmp_path / "out"
    assert generate(model_dir, data_file, out, "--max-samples", 4).exit_code == 0
    other_len = generate(model_dir, data_file, out, "--max-samples", 4, "--seq-length", 128)
    assert other_len.exit_code == 4 and "preprocessing.seq_length: 256 -> 128" in other_len.output
    other_layers = generate(model_dir, data_file, out, "--max-samples", 4, "--layer-ids", "1 2")
    assert other_layers.exit_code == 4 and "generation.layer_ids: [2, 4, 5, 7] -> [1, 2]" in other_layers.output
    other_data = write_jsonl(tmp_path / "other.jsonl", conversations(5, seed=99))
    assert "dataset.sources" in generate(model_dir, other_data, out, "--max-samples", 4).output


def test_foreign_files_and_a_second_writer_are_refused(tmp_path, model_dir, data_file):
    """A folder with unrelated files, or one another run holds, is refused (exit 4)."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    result = generate(model_dir, data_file, foreign)
    assert result.exit_code == 4 and "holds files this tool did not write (notes.txt)" in result.output
    assert sorted(os.listdir(foreign)) == ["notes.txt"]  # refused and left as it was: no log put inside
    locked = tmp_path / "locked"
    locked.mkdir()
    with open(locked / LOCK, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write("4242")
        fh.flush()
        result = generate(model_dir, data_file, locked)
    assert result.exit_code == 4 and "another speculators-data-gen run (pid 4242)" in result.output


def test_path_like_fields_never_name_files(tmp_path, model_dir):
    """Ids and fields that look like paths do not reach file names."""
    rows = [
        {
            "id": "../../escaped",
            "conversations": [{"from": "human", "value": "../../etc/passwd"}, {"from": "gpt", "value": "/etc/shadow"}],
        },
        {"id": "/tmp/absolute", **conversations(1)[0]},
    ]
    work = tmp_path / "deep" / "er"
    work.mkdir(parents=True)
    out = work / "out"
    data = write_jsonl(work / "rows.jsonl", rows)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    result = generate(model_dir, data, out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["data_0.safetensors", "data_1.safetensors", "manifest.jsonl", "data_config.json", LOCK, "logs"]
    )
    [log] = [p.name for p in (out / "logs").iterdir()]
    assert re.fullmatch(r"run-\d{8}-\d{6}\.log", log)  # named from the clock alone
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        before + [p.name for p in out.iterdir()] + ["out", log]
    )
    assert not Path("/tmp/absolute").exists()


class _Payload:
    """Unpickling this creates a marker file: proof that code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_hostile_pt_is_never_unpickled(tmp_path, model_dir, data_file):
    """verify reads .pt samples with weights_only: a hostile pickle is flagged and never runs."""
    out = tmp_path / "out"
    assert generate(model_dir, data_file, out, "--max-samples", 3, "--format", "pt").exit_code == 0
    marker = tmp_path / "pwned"
    hostile = pickle.dumps({"input_ids": _Payload(marker)})
    (out / "data_1.pt").write_bytes(hostile)
    manifest = Manifest(out)
    entries = manifest.entries()  # make the manifest agree, so verify gets as far as loading it

    digest = checksum.of_bytes(hostile, entries[1].algorithm)
    entries[1] = replace(entries[1], bytes=len(hostile), digest=digest)
    manifest.compact(entries)
    (out / "evil.pt").write_bytes(hostile)
    result = invoke("verify", out)
    assert result.exit_code == 1
    assert "data_1.pt: cannot be read safely" in result.output
    assert "evil.pt: not a file of this tool (not opened)" in result.output
    assert not marker.exists()


def test_remote_code_is_refused_unless_asked(tmp_path, model_dir, data_file):
    """A model folder that needs its own code is refused without --trust-remote-code; nothing runs."""
    model = tmp_path / "custom"
    shutil.copytree(model_dir, model)
    marker = tmp_path / "code-ran"
    (model / "custom_config.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "from transformers import LlamaConfig\nclass CustomConfig(LlamaConfig):\n    model_type = 'custom_llama'\n"
    )
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom_config.CustomConfig"}
    config["model_type"] = "custom_llama"  # unknown to transformers: only the folder's code can load it
    (model / "config.json").write_text(json.dumps(config))
    result = generate(model, data_file, tmp_path / "out")
    assert result.exit_code == 3 and "--trust-remote-code" in result.output, result.output
    assert not marker.exists()
    allowed = generate(model, data_file, tmp_path / "out2", "--trust-remote-code", "--layer-ids", "99")
    assert marker.exists()  # with the flag, the folder's code is used (then the bad layer id stops the run)
    assert allowed.exit_code == 3 and "out of range" in allowed.output
