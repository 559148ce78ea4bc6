"""Inputs' sha256 remembered by their stat (issue 52 item 1): an unchanged input is not read again to be named; a
changed one is, even with its size and modification time put back; a file changed too recently is not kept."""

import json
import os
import time

import pytest

from speculators_v016.run.row_index import build_index
from speculators_v016.store import digest_memo
from speculators_v016.store.digest_memo import DigestMemo
from speculators_v016.store.run_config import file_sha256


@pytest.fixture()
def hashed(monkeypatch) -> list:
    """The files read through sha256 by the memo."""
    calls = []
    monkeypatch.setattr(digest_memo, "file_sha256", lambda path: calls.append(path) or file_sha256(path))
    return calls


def rows(n: int, word: str = "hello") -> str:
    return "".join(
        json.dumps({"conversations": [{"from": "human", "value": f"{word} {i}"}, {"from": "gpt", "value": "x"}]}) + "\n"
        for i in range(n)
    )


def test_an_unchanged_input_is_not_hashed_again(tmp_path, hashed, monkeypatch):
    """A second index of the same file, with the cache: its sha256 and its rows come from the cache, the file read
    for neither; the sources' descriptions (the fingerprint) are the same."""
    monkeypatch.setattr(digest_memo, "SETTLE_NS", 0)
    data = tmp_path / "d.jsonl"
    data.write_text(rows(20))
    first = build_index([str(data)], False, None, cache=tmp_path / "cache")
    first.close()
    assert len(hashed) == 1
    again = build_index([str(data)], False, None, cache=tmp_path / "cache")
    again.close()
    assert len(hashed) == 1 and again.descriptions == first.descriptions
    assert again.descriptions[0]["sha256"] == file_sha256(data)


def test_a_change_with_size_and_mtime_put_back_is_hashed_again(tmp_path, hashed, monkeypatch):
    """Bytes changed, the same size, the modification time set back to what it was (ctime cannot be): the file is
    hashed again, its new sha256 named, and its rows indexed again (the new text)."""
    monkeypatch.setattr(digest_memo, "SETTLE_NS", 0)
    data = tmp_path / "d.jsonl"
    data.write_text(rows(5))
    cache = tmp_path / "cache"
    build_index([str(data)], False, None, cache=cache).close()
    before = os.stat(data)
    time.sleep(0.05)  # past the file system's clock tick
    data.write_text(rows(5, word="jelly"))
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(data).st_size == before.st_size and os.stat(data).st_mtime_ns == before.st_mtime_ns
    index = build_index([str(data)], False, None, cache=cache)
    try:
        assert len(hashed) == 2 and index.descriptions[0]["sha256"] == file_sha256(data)
        assert index.row(0)[1].turns[0]["value"] == "jelly 0"
    finally:
        index.close()


def test_a_file_changed_just_now_is_not_kept(tmp_path, hashed):
    """A file whose last change is within SETTLE_NS of its hashing (a write in the same clock tick would not move
    its ctime) is hashed every time until it settles."""
    data = tmp_path / "d.jsonl"
    data.write_text(rows(3))
    memo = DigestMemo(tmp_path / "cache")
    assert memo.sha256(data) == file_sha256(data)
    assert DigestMemo(tmp_path / "cache").sha256(data) == file_sha256(data)
    assert len(hashed) == 2 and not list((tmp_path / "cache").glob("*.prep"))


def test_an_input_changed_while_it_is_indexed_leaves_no_cached_index(tmp_path, monkeypatch):
    """A file replaced while its rows were read (and its sha256 taken beside): the build is refused naming it, and no
    index is kept under either content's key, so a later run reads the file again (hostile review, 2026-12-07)."""
    from speculators_v016.run import row_index  # noqa: PLC0415 - its reader wrapped for this test

    monkeypatch.setattr(digest_memo, "SETTLE_NS", 0)
    data, cache = tmp_path / "d.jsonl", tmp_path / "cache"
    data.write_text(rows(5))
    real_read = row_index._read

    def read_then_change(*args, **kwargs):
        index = real_read(*args, **kwargs)
        time.sleep(0.05)
        data.write_text(rows(7, word="other"))
        return index

    monkeypatch.setattr(row_index, "_read", read_then_change)
    with pytest.raises(Exception, match=f"{data}: changed since the run read it"):
        build_index([str(data)], False, None, cache=cache)
    monkeypatch.setattr(row_index, "_read", real_read)
    index = build_index([str(data)], False, None, cache=cache)
    try:
        assert len(index) == 7 and index.descriptions[0]["sha256"] == file_sha256(data)
    finally:
        index.close()


def test_an_index_cached_by_other_reading_rules_is_not_reused(tmp_path, monkeypatch):
    """The cache key holds how rows are read (turns.READ_RULES): an index an earlier release cached, whose rules
    kept other rows, is not taken for this one's (second review, 2026-12-07)."""
    from speculators_v016.run import row_index  # noqa: PLC0415 - its rules changed for this test

    monkeypatch.setattr(digest_memo, "SETTLE_NS", 0)
    data, cache = tmp_path / "d.jsonl", tmp_path / "cache"
    data.write_text(rows(5))
    first = build_index([str(data)], False, None, cache=cache)
    first.close()
    assert json.loads(first.key)["rows_read"] == row_index.READ_RULES
    monkeypatch.setattr(row_index, "READ_RULES", "an earlier release's rules")
    reads = []
    real_read = row_index._read
    monkeypatch.setattr(row_index, "_read", lambda *a, **k: reads.append(1) or real_read(*a, **k))
    again = build_index([str(data)], False, None, cache=cache)
    again.close()
    assert reads == [1] and json.loads(again.key)["rows_read"] == "an earlier release's rules"
