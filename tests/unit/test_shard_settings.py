"""The shards of one --output-dir share their settings: a shard made with another seed, other layers or another
target is refused at its start and end, and verify names such a folder (hostile review, 2026-12-07)."""

import copy
import json

import pytest

from helpers.folders import make_folder
from speculators_v016.store import run_config
from speculators_v016.store.outdir import shard_siblings
from speculators_v016.store.run_config import ShardMismatchError, check_shards_agree, shared_settings
from speculators_v016.store.sample_format import MODEL_ARGS_KEY
from speculators_v016.store.verify import verify


def fingerprint(index: int, seed: int = 0, model_path: str = "/models/a", layers=(2, 4, 7)) -> dict:
    return {
        "model": {"path": model_path, "config_sha256": "c0ffee", "weight_digests": {"w.safetensors": "d1"}},
        "dataset": {"sources": [{"path": "/data/rows.jsonl", "sha256": "5eed"}], "kind": "conversations"},
        "preprocessing": {"seq_length": 256, "max_samples": None, "seed": seed},
        "generation": {"layer_ids": list(layers), "num_shards": 2, "shard_index": index, "start_idx": 0},
    }


def shard(root, index: int, fp: dict | None, model_args: dict | None = None) -> object:
    folder = root / f"shard-{index:05d}-of-00002"
    folder.mkdir(parents=True)
    if fp is not None:
        ours = {"fingerprint": fp, MODEL_ARGS_KEY: model_args or {}}
        (folder / "data_config.json").write_text(json.dumps({"speculators_v016": ours}))
    return folder


def test_shared_settings_leave_out_the_shard_index_and_the_paths_only():
    """The shard's index and where files were read from are not shared settings; their digests and the rest are."""
    a, b = fingerprint(0), fingerprint(1, model_path="/mnt/other/a")
    b["dataset"]["sources"][0]["path"] = "/elsewhere/rows.jsonl"
    assert shared_settings(a) == shared_settings(b)
    assert "path" not in json.dumps(shared_settings(a)) and "5eed" in json.dumps(shared_settings(a))
    assert a["generation"]["shard_index"] == 0 and a["model"]["path"] == "/models/a"  # the given one untouched


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        (lambda f: f["preprocessing"].update(seed=1), "preprocessing.seed: 0 -> 1"),
        (lambda f: f["generation"].update(layer_ids=[1, 4, 7]), "generation.layer_ids"),
        (lambda f: f["model"]["weight_digests"].update({"w.safetensors": "d2"}), "model.weight_digests.w.safetensors"),
        (lambda f: f["dataset"]["sources"][0].update(sha256="0ther"), "dataset.sources"),
        (lambda f: f["preprocessing"].update(seq_length=512), "preprocessing.seq_length: 256 -> 512"),
    ],
    ids=["seed", "layers", "weights", "dataset", "seq-length"],
)
def test_a_shard_with_other_settings_than_its_sibling_is_refused(tmp_path, changed, named):
    """A sibling shard made with another seed, other layers, other weights, another dataset or sequence length:
    ShardMismatchError naming the difference and both folders."""
    shard(tmp_path, 0, fingerprint(0))
    mine = copy.deepcopy(fingerprint(1))
    changed(mine)
    me = shard(tmp_path, 1, None)
    siblings = shard_siblings(tmp_path, 1, 2)
    assert siblings == [tmp_path / "shard-00000-of-00002"]
    with pytest.raises(ShardMismatchError, match="made with other settings") as err:
        check_shards_agree(me, mine, siblings, {})
    assert named in str(err.value) and "shard-00000-of-00002" in str(err.value)
    assert isinstance(err.value, run_config.ResumeMismatchError)  # the CLI reports it as a refused resume


def test_siblings_of_the_same_run_pass_and_a_starting_one_is_passed_over(tmp_path):
    """The same settings on another host (other paths) pass; a sibling without its config yet is passed over; one
    whose config is not ours is refused."""
    shard(tmp_path, 0, fingerprint(0, model_path="/mnt/x"))
    me = shard(tmp_path, 1, None)
    check_shards_agree(me, fingerprint(1), shard_siblings(tmp_path, 1, 2), {})
    assert shard_siblings(tmp_path, 0, 2) == [me]
    check_shards_agree(tmp_path / "shard-00000-of-00002", fingerprint(0), [me], {})  # me: no data_config.json yet
    (me / "data_config.json").write_text(json.dumps({"model": {}}))
    with pytest.raises(ShardMismatchError, match="not written by speculators-data-gen"):
        check_shards_agree(tmp_path / "shard-00000-of-00002", fingerprint(0), [me], {})


def test_verify_names_a_shard_made_with_other_settings(tmp_path):
    """Two shard folders, valid each, one made with another seed: verify reports that folder and the seed."""
    root = tmp_path / "out"
    folders = [make_folder(root / f"shard-{i:05d}-of-00002", shard=(i, 2)) for i in (0, 1)]
    for i, folder in enumerate(folders):
        config = json.loads((folder / "data_config.json").read_text())
        config["speculators_v016"]["fingerprint"] = fingerprint(i)
        (folder / "data_config.json").write_text(json.dumps(config))
    agreed = verify(root)
    assert not [p for p in agreed.problems if "other settings" in p], agreed.problems
    config = json.loads((folders[1] / "data_config.json").read_text())
    config["speculators_v016"]["fingerprint"] = fingerprint(1, seed=3)
    (folders[1] / "data_config.json").write_text(json.dumps(config))
    mixed = [p for p in verify(root).problems if "other settings" in p]
    assert mixed == [f"{folders[1]}: made with other settings than {folders[0]}, yet in one folder: "
                     "preprocessing.seed: 0 -> 3"]  # fmt: skip


def test_engine_arguments_that_do_not_change_the_model_may_differ_between_shards(tmp_path):
    """A host's gpu_memory_utilization or batching, and the path of a tokenizer with the same contents, may differ
    between shards; a model-changing argument as the run recorded it (hf_overrides) may not."""
    theirs = fingerprint(0)
    theirs["generation"]["engine_args"] = {"gpu_memory_utilization": 0.8, "tokenizer": "/hostA/tok"}
    shard(tmp_path, 0, theirs, {"tokenizer": "/hostA/tok"})
    me = shard(tmp_path, 1, None)
    mine = fingerprint(1)
    mine["generation"]["engine_args"] = {"gpu_memory_utilization": 0.95, "tokenizer": "/hostB/tok"}
    check_shards_agree(me, mine, shard_siblings(tmp_path, 1, 2), {"tokenizer": "/hostB/tok"})
    with pytest.raises(ShardMismatchError, match="model_changing_engine_args.hf_overrides"):
        check_shards_agree(me, mine, shard_siblings(tmp_path, 1, 2), {"hf_overrides": {"rope_theta": 1.0}})


def test_an_odd_sibling_config_is_refused_and_verify_reports_no_traceback(tmp_path):
    """A sibling's data_config.json whose section is null: refused as not ours (no AttributeError); verify of the
    root reports findings, it does not raise."""
    shard(tmp_path, 0, None)
    (tmp_path / "shard-00000-of-00002" / "data_config.json").write_text(json.dumps({"speculators_v016": None}))
    me = shard(tmp_path, 1, fingerprint(1))
    with pytest.raises(ShardMismatchError, match="not written by speculators-data-gen"):
        check_shards_agree(me, fingerprint(1), shard_siblings(tmp_path, 1, 2), {})
    assert not verify(tmp_path).ok
