"""Datasets at a draft's scale through the real command (issue 52): sample names are positions in the run's order
(a gap where a row is dropped after tokenizing), a rerun, shards and verify over them, the prepared-rows cache in
the summary, and a folder of an earlier release refused where its names could differ."""

import json
import os
import shutil

from helpers.cli import conversations, generate, invoke, load_all, write_jsonl
from speculators_v016.run.dataset import run_order
from speculators_v016.store import digest_memo, prepared_cache
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.outdir import shard_dir


def unanswered(i: int) -> dict:
    """A row without an answer (distinct: not a duplicate row, dropped as read)."""
    return {"conversations": [{"from": "human", "value": f"question {i}, which nobody answers"}]}


def dataset(tmp_path):
    """12 answered conversations and 3 unanswered ones (dropped after tokenizing); the names the kept rows get."""
    rows = conversations(12, seed=3)
    for at in (2, 7, 11):
        rows.insert(at, unanswered(at))
    order = run_order(len(rows), 0, None).tolist()
    kept = [p for p, row in enumerate(order) if "which nobody answers" not in json.dumps(rows[row])]
    return write_jsonl(tmp_path / "chats.jsonl", rows), rows, kept


def test_names_are_positions_with_gaps_and_a_rerun_and_verify_accept_them(tmp_path, model_dir):
    """Rows dropped after tokenizing leave gaps; the summary says them and the cache; verify and a rerun accept."""
    data, rows, kept = dataset(tmp_path)
    out, cache = tmp_path / "out", tmp_path / "cache"
    result = generate(model_dir, data, out, "--prepared-cache", cache)
    assert result.exit_code == 0, result.output
    assert sorted(Manifest(out).entries()) == kept and len(kept) == 12
    assert "skipped:    3 no assistant (trainable) tokens" in result.output
    assert "gaps:       3 sample names of this shard have no file" in result.output
    memo = (cache / prepared_cache.entry_name(digest_memo.VERSION, os.path.realpath(data))).exists()
    assert f"prepared:   {cache} ({2 + memo} entries" in result.output  # the index, a chunk (the input's sha256)
    config = json.loads((out / "data_config.json").read_text())["speculators_v016"]
    assert config["numbering"] == "run-order-position-1" and config["dataset_samples"] == len(rows)
    assert invoke("verify", out).exit_code == 0
    again = generate(model_dir, data, out, "--prepared-cache", cache)
    assert again.exit_code == 0, again.output
    assert "written:    0 samples (12 already done before this run)" in again.output
    assert invoke("verify", out).exit_code == 0


def test_shards_split_the_run_order_by_position(tmp_path, model_dir):
    """Shard i writes the positions i, i + n, ...; the shards' union is the unsharded run's names, verified."""
    data, _, kept = dataset(tmp_path)
    out = tmp_path / "out"
    for index in range(2):
        result = generate(model_dir, data, out, "--num-shards", 2, "--shard-index", index, "--no-prepared-cache")
        assert result.exit_code == 0, result.output
        assert "prepared:   off (--no-prepared-cache)" in result.output
        assert sorted(Manifest(shard_dir(out, index, 2)).entries()) == [p for p in kept if p % 2 == index]
    assert invoke("verify", out).exit_code == 0


def test_an_earlier_releases_folder_is_refused_where_its_names_could_differ(tmp_path, model_dir):
    """A folder without the numbering record whose samples are not every row of the run's order is refused (exit 4,
    the folder named, what to do); one whose samples are every row resumes."""
    data, _, _ = dataset(tmp_path)
    out = tmp_path / "out"
    assert generate(model_dir, data, out).exit_code == 0
    before = load_all(out)
    old = tmp_path / "old"
    shutil.copytree(out, old)
    config_path = old / "data_config.json"
    config = json.loads(config_path.read_text())
    del config["speculators_v016"]["numbering"]
    config["speculators_v016"]["dataset_samples"] = 12  # an earlier release counted the samples it kept
    config_path.write_text(json.dumps(config))
    refused = generate(model_dir, data, old)
    assert refused.exit_code == 4, refused.output
    assert f"{old}/data_config.json was written by an earlier release" in refused.output
    assert "Finish the folder with the release that started it, or use another --output-dir" in refused.output
    assert sorted(Manifest(old).entries()) == sorted(before)  # nothing written, nothing lost

    plain = write_jsonl(tmp_path / "plain.jsonl", conversations(6, seed=4))
    whole = tmp_path / "whole"
    assert generate(model_dir, plain, whole).exit_code == 0
    config_path = whole / "data_config.json"
    config = json.loads(config_path.read_text())
    del config["speculators_v016"]["numbering"]  # every row became a sample: the same names, provably
    config_path.write_text(json.dumps(config))
    resumed = generate(model_dir, plain, whole)
    assert resumed.exit_code == 0, resumed.output
    assert "written:    0 samples (6 already done before this run)" in resumed.output
