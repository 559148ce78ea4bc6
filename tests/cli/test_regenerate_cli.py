"""speculators-data-gen --regenerate on CPU vLLM: on-policy samples, their text, resume after SIGKILL, bad input."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from helpers.cli import CPU, invoke, load_all, write_jsonl
from helpers.reference import TOLERANCE, hf_layer_outputs
from speculators_v016 import fp8
from speculators_v016.run.demo import corpus_lines
from speculators_v016.run.turns import READ_RULES
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import load_sample
from speculators_v016.testing.faults import VARIABLE as FAULT

# one sample per turn, always (the default folds a turn into the next one's sample where the template renders it
# as the next prompt's start: tests/cli/test_regenerate_conversations.py)
SAMPLING = ["--regenerate", "--temperature", "0.7", "--top-p", "0.95", "--max-new-tokens", "20", "--seed", "3",
            "--regenerate-samples", "turn"]  # fmt: skip


def chats(count: int) -> list[dict]:
    """Conversations of one and two exchanges (the second answer must see the first regenerated one)."""
    rng, lines = random.Random(5), corpus_lines()
    rows = []
    for i in range(count):
        turns = [{"from": "human", "value": rng.choice(lines)}, {"from": "gpt", "value": "SOURCE ANSWER " * 3}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": rng.choice(lines)}, {"from": "gpt", "value": "SOURCE AGAIN"}]
        rows.append({"conversations": turns})
    return rows


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "chats.jsonl", chats(12))  # 16 turns to answer


def args(model_dir, data_file, out, *extra):
    return [
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
        "--max-num-seqs",
        3,
        *SAMPLING,
        *extra,
    ]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, model_dir, data_file):
    """One uninterrupted regenerating run."""
    out = tmp_path_factory.mktemp("ref") / "out"
    result = invoke(*args(model_dir, data_file, out))
    assert result.exit_code == 0, result.output
    assert "verify:     ok (16 samples" in result.output, result.output
    return out


def test_samples_are_the_prompts_the_target_saw_and_what_it_sampled(reference_run, model_dir):
    """Each sample is its turn's rendered history + the sampled ids, masked 1 on exactly those ids."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = load_all(reference_run)
    lines = [json.loads(x) for x in (reference_run / "regenerated.jsonl").read_text().splitlines()]
    assert sorted(samples) == list(range(16)) and len(lines) == 12
    journal = {}
    for raw in (reference_run / "regenerated.journal.jsonl").read_text().splitlines():
        record = json.loads(raw)
        journal[record["index"]] = record
    for line in lines:
        history = []
        for turn in line["turns"]:
            if turn["role"] != "assistant":
                history.append({"role": turn["role"], "content": turn["content"]})
                continue
            assert "SOURCE" not in turn["content"]
            sample, record = samples[turn["sample"]], journal[turn["sample"]]
            prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True)
            ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
            assert ids == prompt + record["token_ids"]  # the tokens before every supervised position
            assert mask == [0] * len(prompt) + [1] * len(record["token_ids"])
            assert turn["finish_reason"] in ("stop", "length") and record["text"] == turn["content"]
            history.append({"role": "assistant", "content": turn["content"]})
    config = json.loads((reference_run / "data_config.json").read_text())
    regen = config["speculators_v016"]["regenerate"]
    assert regen["on_policy"] is True and regen["sampling"]["temperature"] == 0.7
    assert "unanswered_user_turns" not in regen  # every user turn answered by the source: folders as before
    assert regen["rows_read"] == READ_RULES  # a folder of rows read otherwise is not resumed
    assert regen["sampling"]["max_new_tokens"] == 20 and regen["stop_token_ids"]
    assert lines[0]["sampling"]["seed"] == 3
    assert torch.load(reference_run.parent / "tf.pt")  # token frequencies of the generated tokens


def test_captured_states_equal_transformers_on_the_final_sequences(reference_run, model_dir):
    """Decode-time states of every sample equal transformers' prefill of the same sequence within 1e-5."""
    samples = load_all(reference_run)
    picked = [samples[i] for i in (0, 1, 7)]
    reference = hf_layer_outputs(model_dir, [s["input_ids"].tolist() for s in picked])
    for sample, ref in zip(picked, reference):
        for state, layer in zip(sample["hidden_states"], (2, 4, 5, 7)):
            assert (state - ref[layer]).abs().max().item() < TOLERANCE


def test_a_killed_regenerating_run_resumes_to_the_same_tokens_and_text(tmp_path, reference_run, model_dir, data_file):
    """SIGKILL mid-run at temperature 0.7, then resume: the same ids, masks and regenerated.jsonl, byte for byte."""
    out = tmp_path / "killed"
    killed = run_with_fault(args(model_dir, data_file, out, "--write-workers", 1), "kill-mid-write:5")
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    partial = len(Manifest(out).entries())
    assert partial == 4  # the fault waits for the 4 files before its own (a kill from outside raced the run)
    result = invoke(*args(model_dir, data_file, out))
    assert result.exit_code == 0, result.output
    assert f"({partial} already done before this run)" in result.output
    resumed, reference = load_all(out), load_all(reference_run)
    assert sorted(resumed) == sorted(reference)
    for i in reference:
        assert torch.equal(resumed[i]["input_ids"], reference[i]["input_ids"]), f"sample {i}"
        assert torch.equal(resumed[i]["loss_mask"], reference[i]["loss_mask"])
        for a, b in zip(resumed[i]["hidden_states"], reference[i]["hidden_states"]):
            assert (a - b).abs().max().item() < TOLERANCE
    assert (out / "regenerated.jsonl").read_bytes() == (reference_run / "regenerated.jsonl").read_bytes()


def run_with_fault(arguments, fault: str) -> subprocess.CompletedProcess:
    """The real command with ``fault`` armed (speculators_v016.testing.faults)."""
    cmd = [sys.executable, "-m", "speculators_v016.testing.faults", *map(str, arguments)]
    env = {**os.environ, **CPU, FAULT: fault}
    return subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)


def test_regeneration_options_need_regenerate(tmp_path, model_dir, data_file):
    """--temperature without --regenerate is a usage error naming both."""
    result = invoke(
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--output-dir",
        tmp_path / "o",
        "--temperature",
        "0.5",
    )
    assert result.exit_code == 2 and "--temperature" in result.output and "--regenerate" in result.output


def test_bad_regeneration_inputs_are_named(tmp_path, model_dir):
    """Pre-tokenized rows, a model without generation_config.json, a row without a user turn: exit 3, named."""
    tokens = write_jsonl(tmp_path / "tok.jsonl", [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}])
    result = invoke(*args(model_dir, tokens, tmp_path / "a"))
    assert result.exit_code == 3 and "pre-tokenized rows" in result.output, result.output
    bare = tmp_path / "bare-model"
    shutil.copytree(model_dir, bare)
    (bare / "generation_config.json").unlink()
    chats_file = write_jsonl(tmp_path / "c.jsonl", chats(2))
    plain = [a for a in args(bare, chats_file, tmp_path / "b") if a not in ("--temperature", "0.7")]
    result = invoke(*plain)
    assert result.exit_code == 3 and "no generation_config.json" in result.output, result.output
    lonely = write_jsonl(tmp_path / "l.jsonl", [{"conversations": [{"from": "gpt", "value": "hi"}]}])
    result = invoke(*args(model_dir, lonely, tmp_path / "c"))
    assert result.exit_code == 3 and f"{lonely}:1: no user turn" in result.output, result.output


def test_verify_checks_the_text_against_the_samples(tmp_path, reference_run):
    """verify passes the run, and names an edited turn text and a journal whose ids differ from a sample's."""
    assert invoke("verify", reference_run).exit_code == 0
    edited = tmp_path / "edited"
    shutil.copytree(reference_run, edited)
    lines = (edited / "regenerated.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["turns"][1]["content"] += " (edited)"
    (edited / "regenerated.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    result = invoke("verify", edited)
    assert result.exit_code == 1 and "text differs from regenerated.journal.jsonl" in result.output, result.output
    shutil.copy(reference_run / "regenerated.jsonl", edited / "regenerated.jsonl")
    journal = [json.loads(x) for x in (edited / "regenerated.journal.jsonl").read_text().splitlines()]
    journal[0]["token_ids"][-1] ^= 1
    (edited / "regenerated.journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in journal))
    result = invoke("verify", edited)
    assert result.exit_code == 1 and "generated ids differ" in result.output, result.output


def test_a_regenerating_run_in_the_default_dtype_checks_and_verifies(tmp_path, model_dir):
    """--regenerate with --dtype auto (bf16 on CPU): the logit check on generated positions passes, verify too;
    with FP8 storage the same tokens are sampled and the codes are exactly quantize(the bf16 run's rows)."""
    chats_file = write_jsonl(tmp_path / "c.jsonl", chats(4))
    default = {"SPECULATORS_DATA_GEN_DTYPE": "auto"}
    for out, extra in ((tmp_path / "out", ()), (tmp_path / "fp8", ("--hidden-states-dtype", "fp8_e4m3"))):
        result = invoke(*args(model_dir, chats_file, out, *extra), env=default)
        assert result.exit_code == 0, result.output
        assert "bfloat16" in result.output and "logit check: ok" in result.output, result.output
        assert "verify:     ok (6 samples" in result.output and "regenerated: 6 turns" in result.output  # 2 of 4: two
        assert invoke("verify", out).exit_code == 0
    bf16 = load_all(tmp_path / "out")
    stored = {
        i: load_sample(tmp_path / "fp8" / e.file, dequantize_to=None)
        for i, e in Manifest(tmp_path / "fp8").entries().items()
    }
    assert sorted(stored) == sorted(bf16)
    for i, sample in bf16.items():
        assert torch.equal(stored[i]["input_ids"], sample["input_ids"]) and torch.equal(
            stored[i]["loss_mask"], sample["loss_mask"]
        )
        for layer, rows in zip(stored[i]["hidden_states"], sample["hidden_states"]):
            codes, scales = fp8.quantize(rows)
            assert torch.equal(layer.codes.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(
                layer.scales, scales
            )


@pytest.mark.parametrize(
    "layout, named",
    [
        (("--tensor-parallel-size", 2, "--executor", "mp"), "TP 2, mp executor"),
        (("--pipeline-parallel-size", 2), "TP 1 x PP 2, mp executor"),
    ],
    ids=["tp2", "pp2"],
)
def test_a_regenerating_run_under_tensor_or_pipeline_parallel_2_checks_and_verifies(tmp_path, model_dir, layout, named):
    """--regenerate with --tensor-parallel-size 2 or --pipeline-parallel-size 2 (mp executor): the logit check on
    generated positions passes, verify too, and the regenerated text names every turn."""
    chats_file = write_jsonl(tmp_path / "c.jsonl", chats(4))
    binding = {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if (os.cpu_count() or 1) >= 2 else "0|0"}  # one NUMA node
    result = invoke(*args(model_dir, chats_file, tmp_path / "out", *layout), env=binding)
    assert result.exit_code == 0, result.output
    assert named in result.output and "logit check: ok" in result.output, result.output
    assert "verify:     ok (6 samples" in result.output and "regenerated: 6 turns" in result.output
    rows = [json.loads(line) for line in (tmp_path / "out" / "regenerated.jsonl").read_text().splitlines()]
    assert sum(len([t for t in r["turns"] if t.get("finish_reason")]) for r in rows) == 6


def test_a_finished_run_with_turns_cut_runs_again_as_a_no_op(tmp_path, model_dir):
    """A finished --regenerate run whose turns without room were cut, run again: exit 0 without starting the engine,
    the cut turns still counted in data_config.json, and the folder verifies (before: the engine ran, exit 1, and
    last_run.skipped was reset, after which verify failed for good)."""
    long_text = " ".join(corpus_lines() * 20)[:4000]  # a first prompt longer than --seq-length: both turns cut
    rows = [
        *chats(3),
        {"conversations": [{"from": "human", "value": long_text}, {"from": "gpt", "value": "x"}] * 2},
    ]
    chats_file, out = write_jsonl(tmp_path / "c.jsonl", rows), tmp_path / "out"
    first = invoke(*args(model_dir, chats_file, out))
    assert first.exit_code == 0, first.output
    assert "skipped:    2 turn not generated" in first.output and "verify:     ok (4 samples" in first.output
    config = (out / "data_config.json").read_text()
    again = invoke(*args(model_dir, chats_file, out))
    assert again.exit_code == 0, again.output
    assert "nothing to generate: the 2 turns not written have no room under --seq-length 256" in again.output
    assert "samples to write" not in again.output, again.output  # the engine never started
    assert "skipped:    2 turn not generated" in again.output and "verify:     ok (4 samples" in again.output
    assert (
        json.loads((out / "data_config.json").read_text())["speculators_v016"]["last_run"]["skipped"]
        == (json.loads(config)["speculators_v016"]["last_run"]["skipped"])
    )
    assert invoke("verify", out).exit_code == 0


def test_prompt_only_rows_get_every_user_turn_answered(tmp_path, model_dir):
    """Rows of user turns only (ShareGPT and messages shapes) and a trailing unanswered user turn: the target
    answers each user turn in order, one sample per answer, each the history so far + what it sampled."""
    rng, lines = random.Random(7), corpus_lines()
    rows = [
        {
            "conversations": [
                {"from": "human", "value": rng.choice(lines)},
                {"from": "human", "value": rng.choice(lines)},
            ]
        },
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": rng.choice(lines)}]},
        {
            "messages": [
                {"role": "user", "content": rng.choice(lines)},
                {"role": "assistant", "content": "SOURCE ANSWER"},
                {"role": "user", "content": rng.choice(lines)},
            ]
        },
    ]
    data, out = write_jsonl(tmp_path / "prompts.jsonl", rows), tmp_path / "out"
    sampling = ["--regenerate", "--temperature", "0", "--max-new-tokens", "8", "--regenerate-samples", "turn"]
    result = invoke(*args(model_dir, data, out)[: -len(SAMPLING)], *sampling)  # greedy, short turns
    assert result.exit_code == 0, result.output
    assert "verify:     ok (5 samples" in result.output, result.output
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = load_all(out)
    journal = {}
    for raw in (out / "regenerated.journal.jsonl").read_text().splitlines():
        record = json.loads(raw)
        journal[record["index"]] = record
    regenerated_lines = [json.loads(x) for x in (out / "regenerated.jsonl").read_text().splitlines()]
    assert sorted(samples) == list(range(5)) and len(regenerated_lines) == 3
    answered = []
    for line in regenerated_lines:
        history, users = [], 0
        for turn in line["turns"]:
            if turn["role"] != "assistant":
                users += turn["role"] == "user"
                history.append({"role": turn["role"], "content": turn["content"]})
                continue
            assert "SOURCE" not in turn["content"] and turn["finish_reason"] in ("stop", "length")
            sample, record = samples[turn["sample"]], journal[turn["sample"]]
            prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True)
            ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
            assert ids == prompt + record["token_ids"] and record["token_ids"]
            assert mask == [0] * len(prompt) + [1] * len(record["token_ids"])
            assert record["text"] == turn["content"]
            history.append({"role": "assistant", "content": turn["content"]})
            answered.append(turn["sample"])
        assert [t["role"] for t in line["turns"]][-1] == "assistant" and users >= 1
    assert sorted(answered) == list(range(5))
    roles = {line["source"].rsplit(":", 1)[1]: [t["role"] for t in line["turns"]] for line in regenerated_lines}
    assert roles == {
        "1": ["user", "assistant"] * 2,
        "2": ["system", "user", "assistant"],
        "3": ["user", "assistant"] * 2,
    }
    # earlier releases planned no sample for those turns: their folders of this dataset must not resume into it
    regen = json.loads((out / "data_config.json").read_text())["speculators_v016"]["fingerprint"]["generation"]
    assert regen["regenerate"]["unanswered_user_turns"] == "answered, in order (one sample each)"


def edited_copy(reference_run, where, edit_journal=None, edit_conversations=None):
    """A copy of the reference folder with its journal lines (a list of raw lines) and conversations edited."""
    shutil.copytree(reference_run, where)
    if edit_journal:
        lines = (where / "regenerated.journal.jsonl").read_text().splitlines()
        (where / "regenerated.journal.jsonl").write_text("".join(x + "\n" for x in edit_journal(lines)))
    if edit_conversations:
        lines = (where / "regenerated.jsonl").read_text().splitlines()
        (where / "regenerated.jsonl").write_text("".join(x + "\n" for x in edit_conversations(lines)))
    return where


def test_verify_checks_the_journal_text_against_the_sampled_ids(tmp_path, reference_run):
    """A turn's text edited the same way in the journal and regenerated.jsonl: verify decodes the sampled ids with
    the target's tokenizer and names the sample; without the target here it says the text is not checked."""

    def edit(lines):
        records = [json.loads(x) for x in lines]
        for record in records:
            if record.get("index") == 0:
                record["text"] += " (edited)"
            if "turns" in record:
                for turn in record["turns"]:
                    if turn.get("sample") == 0:
                        turn["content"] += " (edited)"
        return [json.dumps(r, ensure_ascii=False) for r in records]

    edited = edited_copy(reference_run, tmp_path / "edited", edit, edit)
    result = invoke("verify", edited)
    assert result.exit_code == 1, result.output
    assert (
        f"FAIL {edited}/data_0.safetensors: its text in regenerated.journal.jsonl is not what its sampled ids decode to"
        in result.output
    ), result.output
    config = json.loads((edited / "data_config.json").read_text())
    config["speculators_v016"]["fingerprint"]["model"]["path"] = str(tmp_path / "gone")
    (edited / "data_config.json").write_text(json.dumps(config))
    result = invoke("verify", edited)
    assert result.exit_code == 0, result.output
    assert f"regenerated text not checked against the sampled ids: the target {tmp_path / 'gone'} is not here" in (
        result.output
    )


@pytest.mark.parametrize(
    ("edit", "finding", "rerun"),
    [
        (
            lambda lines: [
                lines[0],
                json.dumps({k: v for k, v in json.loads(lines[1]).items() if k != "index"}),
                *lines[2:],
            ],  # fmt: skip
            "regenerated.journal.jsonl:2: not a record this tool writes (index is None, not a sample index)",
            "regenerated.journal.jsonl:2: not a record this tool writes",
        ),
        (
            lambda lines: [lines[0], "[1, 2]", *lines[1:]],
            "regenerated.journal.jsonl:2: not a record this tool writes (a JSON list, not an object)",
            "regenerated.journal.jsonl:2: not a record this tool writes",
        ),
        (
            lambda lines: lines[:-1],
            "listed, but regenerated.journal.jsonl has no record of it",
            "are listed in manifest.jsonl but regenerated.journal.jsonl has no record of them",
        ),
    ],
    ids=["no-index", "a-list", "last-line-removed"],
)
def test_a_damaged_journal_is_a_finding_and_refuses_a_rerun(tmp_path, reference_run, model_dir, data_file, edit,
                                                            finding, rerun):  # fmt: skip
    """A journal line without an index, a JSON list, or the last line removed: verify names it (exit 1, never
    "cannot be verified"); running the command again refuses the folder as damaged (exit 4), naming it."""
    out = edited_copy(reference_run, tmp_path / "out", edit)
    result = invoke("verify", out)
    assert result.exit_code == 1 and finding in result.output, result.output
    assert "cannot be verified" not in result.output
    again = invoke(*args(model_dir, data_file, out))
    assert again.exit_code == 4, again.output
    assert rerun in again.output and "Traceback" not in again.output, again.output
