"""A Parquet dataset through the real command (issue 52 item 5): its samples are those of the same rows in JSON Lines,
bit for bit; a per-source cap and a duplicate row are applied and said; data_config.json names what was read."""

import gzip
import json

from transformers import AutoTokenizer

from helpers.cli import conversations, invoke, load_all, write_jsonl
from speculators_v016.run.prepared import prepare_samples
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.outdir import LOCK
from speculators_v016.store.run_config import file_sha256


def test_a_parquet_input_gives_the_samples_of_its_rows(tmp_path, model_dir):
    """Parquet (both row shapes, a duplicate row) plus a capped JSON Lines file: exit 0, the duplicate dropped and
    counted, the cap applied, every sample's ids and mask those its rows give in JSON Lines, sources recorded; a
    truncated .jsonl.gz added then is refused naming it (exit 3), the folder's files as they were."""
    import pyarrow as pa  # noqa: PLC0415 - pyarrow is slow to import; only this test needs it
    import pyarrow.parquet as pq  # noqa: PLC0415 - as above

    rows = conversations(6, seed=11)
    parquet = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_struct_array(pa.array(rows + [rows[2]])), parquet)
    more = write_jsonl(tmp_path / "more.jsonl", conversations(5, seed=12))
    out = tmp_path / "out"
    result = invoke(
        "--target-model-path", model_dir, "--train-data-path", parquet, "--train-data-path", f"{more}#max=2",
        "--output-dir", out, "--seq-length", 256, "--token-freq-path", "",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "skipped:    1 duplicate row" in result.output, result.output
    assert "written:    8 samples" in result.output, result.output
    same = write_jsonl(tmp_path / "same.jsonl", rows + conversations(5, seed=12)[:2])
    want = prepare_samples([str(same)], AutoTokenizer.from_pretrained(model_dir), 256, num_proc=1)
    got = load_all(out)
    assert [got[i]["input_ids"].tolist() for i in range(8)] == want.input_ids
    assert [got[i]["loss_mask"].tolist() for i in range(8)] == want.loss_masks
    sources = json.loads((out / "data_config.json").read_text())["speculators_v016"]["fingerprint"]["dataset"]
    assert sources["sources"] == [
        {"path": str(parquet.resolve()), "sha256": file_sha256(parquet), "duplicate_rows": 1},
        {"path": str(more.resolve()), "sha256": file_sha256(more), "max_rows": 2},
    ]

    # the same folder again with a truncated .jsonl.gz added: refused naming it, before anything is written
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK}  # the lock: the pid
    cut = tmp_path / "cut.jsonl.gz"
    whole = gzip.compress("".join(json.dumps(r) + "\n" for r in conversations(50, seed=13)).encode())
    cut.write_bytes(whole[: len(whole) // 2])
    refused = invoke(
        "--target-model-path", model_dir, "--train-data-path", parquet, "--train-data-path", f"{more}#max=2",
        "--train-data-path", cut, "--output-dir", out, "--seq-length", 256, "--token-freq-path", "",
    )  # fmt: skip
    assert refused.exit_code == 3, refused.output
    assert f"error: {cut}: not a readable gzip archive" in refused.output, refused.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != LOCK} == before
    assert len(Manifest(out).entries()) == 8
