"""--regenerate's default samples (--regenerate-samples auto) on CPU vLLM: a conversation's turns in one sample
where the chat template renders each as the next prompt's start, checked turn by turn; states, verify, resume.

Turns of at most 2 tokens (--max-new-tokens 2): a random tiny model's longer turns are rarely ids its text
tokenizes back to, so they would all keep a sample each; at 2 tokens about half fold, and the runs hold
conversations of every shape (one sample, split, one sample per turn).
"""

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
from speculators_v016.run.demo import corpus_lines
from speculators_v016.run.regenerate import FOLDED
from speculators_v016.store.manifest import Manifest
from speculators_v016.testing.faults import VARIABLE as FAULT

SAMPLING = ["--regenerate", "--temperature", "0.7", "--top-p", "0.95", "--max-new-tokens", "2", "--seed", "3"]
FAMILIES = ("llama", "mixtral")
TURNS = 3 * 3 + 4 + 5 + 2 * 2 + 1 + 2  # the exchanges of chats() below: the turns to generate


def chats() -> list[dict]:
    """Ten conversations of 1 to 5 exchanges, two with a system prompt, in both row shapes."""
    rng, lines = random.Random(11), [" ".join(line.split()[:8]) for line in corpus_lines()]  # short: 5 exchanges fit
    rows = []
    for exchanges in (3, 3, 3, 4, 5, 2, 2, 1):
        turns = [("human", rng.choice(lines)), ("gpt", "SOURCE")] * exchanges
        if exchanges == 3 and len(rows) == 1:
            turns = [("system", "answer in two words"), *turns]
        rows.append({"conversations": [{"from": r, "value": t} for r, t in turns]})
    rows.append({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]})
    rows.append({"messages": [{"role": "user", "content": rng.choice(lines)}]})
    return rows


def args(model_dir, data, out, *extra):
    return ["--target-model-path", model_dir, "--train-data-path", data, "--output-dir", out, "--seq-length", 256,
            "--token-freq-path", "", "--max-num-seqs", 3, *SAMPLING, *extra]  # fmt: skip


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("conv-data") / "chats.jsonl", chats())


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory, data_file):
    """One default regenerating run per family (Llama: vLLM's built-in aux outputs; Mixtral: our taps)."""
    out = {}
    for family in FAMILIES:
        model, folder = tiny_model(family), tmp_path_factory.mktemp(f"conv-{family}") / "out"
        result = invoke(*args(model, data_file, folder))
        assert result.exit_code == 0, result.output
        out[family] = {"family": family, "model": model, "out": folder, "output": result.output}
    return out


def journal_of(out) -> dict[int, dict]:
    records = {}
    for raw in (out / "regenerated.journal.jsonl").read_text().splitlines():
        record = json.loads(raw)
        records[record["index"]] = record
    return records


def rebuilt(out, model) -> dict[int, list[int]]:
    """Every turn's prompt rebuilt from regenerated.jsonl's history: it and the turn's sampled ids stand at the start
    of the sample holding the turn, loss_mask 1 on exactly the sampled ids of the turns it holds; each sample ends
    with its own turn. Returns the turns each sample holds."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    samples, journal = load_all(out), journal_of(out)
    held: dict[int, list[int]] = {}
    masks = {i: [0] * len(s["input_ids"]) for i, s in samples.items()}
    for line in (out / "regenerated.jsonl").read_text().splitlines():
        history = []
        for turn in json.loads(line)["turns"]:
            if turn["role"] != "assistant":
                history.append({"role": turn["role"], "content": turn["content"]})
                continue
            own = turn.get("turn_index", turn["sample"])
            record, ids = journal[own], samples[turn["sample"]]["input_ids"].tolist()
            prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True)
            end = len(prompt) + len(record["token_ids"])
            assert ids[:end] == prompt + record["token_ids"], f"turn {own} in sample {turn['sample']}"
            assert "SOURCE" not in turn["content"] and record["text"] == turn["content"]
            masks[turn["sample"]][len(prompt) : end] = [1] * len(record["token_ids"])
            held.setdefault(turn["sample"], []).append(own)
            if own == turn["sample"]:
                assert end == len(ids), f"sample {own} ends with its own turn"
            history.append({"role": "assistant", "content": turn["content"]})
    for i, sample in samples.items():
        assert sample["loss_mask"].tolist() == masks[i], f"sample {i}"
    assert sorted(held) == sorted(samples)
    return held


@pytest.mark.parametrize("family", FAMILIES)
def test_every_turn_stands_where_it_was_sampled(runs, family):
    """Each turn's rebuilt prompt + sampled ids start the sample holding it, masked 1 on exactly the sampled ids;
    some samples hold several turns, every turn is held once, and the run counts its conversations by shape."""
    run = runs[family]
    held = rebuilt(run["out"], run["model"])
    turns = sorted(t for ts in held.values() for t in ts)
    assert turns == list(range(TURNS))
    assert any(len(ts) >= 2 for ts in held.values()) and any(len(ts) == 1 for ts in held.values())
    assert "logit check: ok" in run["output"] and f"verify:     ok ({len(held)} samples" in run["output"]
    assert f"regenerated: {TURNS} turns" in run["output"]
    config = json.loads((run["out"] / "data_config.json").read_text())["speculators_v016"]
    assert config["fingerprint"]["generation"]["regenerate"]["samples"] == FOLDED
    shapes = config["last_run"]["conversations"]
    assert sum(shapes.values()) == len(chats()) and shapes["one turn"] == 3, shapes
    assert f"conversations: {len(chats())} finished" in run["output"]


@pytest.mark.parametrize("family", FAMILIES)
def test_states_of_samples_holding_several_turns_equal_transformers(runs, family):
    """The states of samples holding several turns (their history prefilled by the last turn's pass, its own ids
    decoded) equal transformers' prefill of the whole sequence within 1e-5."""
    run = runs[family]
    held, samples = rebuilt(run["out"], run["model"]), load_all(run["out"])
    picked = [samples[i] for i, turns in sorted(held.items()) if len(turns) >= 2][:3]
    reference = hf_layer_outputs(run["model"], [s["input_ids"].tolist() for s in picked])
    for sample, ref in zip(picked, reference):
        for state, layer in zip(sample["hidden_states"], (2, 4, 5, 7)):
            assert (state - ref[layer]).abs().max().item() < TOLERANCE


def test_verify_names_a_folded_turn_whose_ids_moved(runs, tmp_path):
    """verify passes the folder; a folded turn's journal ids edited, or its record no longer folded: named."""
    run = runs["llama"]
    assert invoke("verify", run["out"]).exit_code == 0
    folded = next(r for r in journal_of(run["out"]).values() if r.get("in_later_sample"))
    for edit, message in (
        (lambda r: r["token_ids"].__setitem__(-1, r["token_ids"][-1] ^ 1), "folded into it differ from"),
        (lambda r: r.pop("in_later_sample"), "which has no record of it folded"),
    ):
        where = tmp_path / message.split()[0]
        shutil.copytree(run["out"], where)
        lines = [json.loads(x) for x in (where / "regenerated.journal.jsonl").read_text().splitlines()]
        for record in lines:
            if record["index"] == folded["index"]:
                edit(record)
        (where / "regenerated.journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        result = invoke("verify", where)
        assert result.exit_code == 1 and message in result.output, result.output


def test_a_run_killed_mid_conversation_resumes_to_the_same_samples(runs, tmp_path, data_file):
    """SIGKILL inside the second sample file (folded turns of other conversations journaled, their samples not
    written), then resume: the same samples, ids, masks and regenerated.jsonl as the uninterrupted run."""
    run = runs["llama"]
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "speculators_v016.testing.faults", *map(str, args(run["model"], data_file, out,
                                                                                  "--write-workers", 1))]  # fmt: skip
    env = {**os.environ, **CPU, FAULT: "kill-mid-write:2"}
    killed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert len(Manifest(out).entries()) == 1
    assert any(r.get("in_later_sample") for r in journal_of(out).values())  # a conversation cut mid-way
    result = invoke(*args(run["model"], data_file, out))
    assert result.exit_code == 0, result.output
    resumed, reference = load_all(out), load_all(run["out"])
    assert sorted(resumed) == sorted(reference)
    for i in reference:
        assert torch.equal(resumed[i]["input_ids"], reference[i]["input_ids"]), f"sample {i}"
        assert torch.equal(resumed[i]["loss_mask"], reference[i]["loss_mask"]), f"sample {i}"
    assert (out / "regenerated.jsonl").read_bytes() == (run["out"] / "regenerated.jsonl").read_bytes()
    rebuilt(out, run["model"])


def test_a_folder_of_one_way_is_not_resumed_the_other_way(runs, data_file):
    """--regenerate-samples turn on a folder of the default's samples: refused (exit 4) naming the setting."""
    run = runs["llama"]
    result = invoke(*args(run["model"], data_file, run["out"], "--regenerate-samples", "turn"))
    assert result.exit_code == 4 and "generation.regenerate.samples" in result.output, result.output


def test_the_default_dtype_checks_and_verifies(tmp_path, tiny_model, data_file):
    """The default run in the default dtype (bf16 on CPU): the logit check, handed to the sample holding a folded
    checked turn, passes; verify is ok."""
    model, out = tiny_model("llama"), tmp_path / "out"
    result = invoke(*args(model, data_file, out), env={"SPECULATORS_DATA_GEN_DTYPE": "auto"})
    assert result.exit_code == 0, result.output
    assert "bfloat16" in result.output and "logit check: ok (" in result.output, result.output
    assert f"regenerated: {TURNS} turns" in result.output and "verify:     ok" in result.output
    rebuilt(out, model)


def cut_after_a_folded_turn(run_out, where):
    """A copy of the run as a run killed mid-conversation leaves it: a conversation whose listed sample S holds a
    folded turn F, its turns after S not written (files, manifest lines and journal lines gone). Returns (F, S,
    the turns removed)."""
    shutil.copytree(run_out, where)
    journal = journal_of(where)
    for holder in sorted(journal.values(), key=lambda r: r["index"]):
        later = [r["index"] for r in journal.values()
                 if r["conversation"] == holder["conversation"] and r["turn"] > holder["turn"]]  # fmt: skip
        if holder.get("earlier_turns") and later:
            break
    else:
        raise AssertionError("no conversation with a folded turn held by a sample before its last turn")
    manifest = Manifest(where)
    kept = {i: e for i, e in manifest.entries().items() if i not in later}
    for index in set(manifest.entries()) - set(kept):
        (where / manifest.entries()[index].file).unlink()
    manifest.compact(kept)
    lines = [line for line in (where / "regenerated.journal.jsonl").read_text().splitlines()
             if json.loads(line)["index"] not in later]  # fmt: skip
    (where / "regenerated.journal.jsonl").write_text("".join(line + "\n" for line in lines))
    return holder["earlier_turns"][0], holder["index"], later


def edit_journal(out, index, edit):
    lines = [json.loads(x) for x in (out / "regenerated.journal.jsonl").read_text().splitlines()]
    for record in lines:
        if record["index"] == index:
            edit(record)
    (out / "regenerated.journal.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


@pytest.mark.parametrize(
    "edit, message",
    [
        (None, None),
        (lambda r: r.update(text=r["text"] + " INJECTED"), "its text is not what its sampled ids decode to"),
        (lambda r: r.update(prompt_sha256="0" * 32), "no longer matches its digest"),
    ],
)
def test_a_resume_refuses_an_edited_record_of_a_finished_folded_turn(runs, tmp_path, data_file, edit, message):
    """A conversation cut after the listed sample holding folded turn F: untouched, the resume writes its later turns
    as the uninterrupted run did; with F's record edited (its text, its prompt_sha256), the resume is refused (exit
    4) naming F's record, never prompting the next turn with it; the samples written stay as they were."""
    run = runs["llama"]
    out = tmp_path / "out"
    folded, holder, later = cut_after_a_folded_turn(run["out"], out)
    if edit is not None:
        edit_journal(out, folded, edit)
    before = {p.name: p.read_bytes() for p in out.glob("data_*.safetensors")}
    result = invoke(*args(run["model"], data_file, out))
    if edit is None:
        assert result.exit_code == 0, result.output
        reference, resumed = load_all(run["out"]), load_all(out)
        assert sorted(resumed) == sorted(reference)
        for i in reference:
            assert torch.equal(resumed[i]["input_ids"], reference[i]["input_ids"]), f"sample {i}"
        return
    assert result.exit_code == 4, result.output
    assert f"the regenerated.journal.jsonl record of sample {folded}" in result.output and message in result.output
    assert {p.name: p.read_bytes() for p in out.glob("data_*.safetensors")} == before
    assert not any((out / f"data_{i}.safetensors").exists() for i in later)


def test_verify_names_an_edited_prompt_digest_and_prompts_that_are_not_the_history(runs, tmp_path):
    """A folded turn's prompt_sha256 edited: verify names the sample holding it. A user turn edited in
    regenerated.jsonl: verify names the samples whose prompts hold the original (not the history it lists)."""
    run = runs["llama"]
    journal = journal_of(run["out"])
    folded = next(r for r in journal.values() if r.get("in_later_sample"))
    digest = tmp_path / "digest"
    shutil.copytree(run["out"], digest)
    edit_journal(digest, folded["index"], lambda r: r.update(prompt_sha256="0" * 32))
    result = invoke("verify", digest)
    finding = f"turn {folded['index']} folded into it: its regenerated.journal.jsonl record's prompt_sha256 is not"
    assert result.exit_code == 1 and finding in result.output, result.output
    history = tmp_path / "history"
    shutil.copytree(run["out"], history)
    lines = [json.loads(x) for x in (history / "regenerated.jsonl").read_text().splitlines()]
    user = next(t for t in lines[0]["turns"] if t["role"] == "user")
    user["content"] += " EDITED"
    (history / "regenerated.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = invoke("verify", history)
    assert result.exit_code == 1 and "is not its conversation's history as the target wrote it" in result.output, (
        result.output
    )
