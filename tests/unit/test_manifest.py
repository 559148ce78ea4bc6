"""The manifest after a crash or a foreign edit: torn lines cut off, anything else named by path and line."""

import json
import re

import pytest

from speculators_v016.store.manifest import NAME, Entry, Manifest, ManifestError


def entry(i: int, algorithm: str = "blake3") -> Entry:
    return Entry(i, f"data_{i}.safetensors", 10, "ab" * 32, 5, algorithm)


def line(i: int) -> bytes:
    record = {"index": i, "file": f"data_{i}.safetensors", "bytes": 10, "blake3": "ab" * 32, "tokens": 5}
    return (json.dumps(record, sort_keys=True) + "\n").encode()


def test_a_torn_first_line_is_cut_off_so_the_next_append_is_readable(tmp_path):
    """A torn only line (disk full at the first append) is compacted away; the resume's appends read back."""
    (tmp_path / NAME).write_bytes(line(0)[:17])  # the first append, cut
    manifest = Manifest(tmp_path)
    assert manifest.reconcile() == {}
    assert (tmp_path / NAME).read_bytes() == b""
    (tmp_path / "data_1.safetensors").write_bytes(b"x" * 10)
    manifest.append(entry(1))
    assert manifest.entries() == {1: entry(1)}
    assert manifest.reconcile() == {1: entry(1)}


def test_a_torn_last_line_is_ignored_and_cut_off(tmp_path):
    """A torn last line after complete ones is ignored by entries() and removed by reconcile()."""
    for i in (0, 1):
        (tmp_path / f"data_{i}.safetensors").write_bytes(b"x" * 10)
    (tmp_path / NAME).write_bytes(line(0) + line(1) + line(2)[:30])
    manifest = Manifest(tmp_path)
    assert sorted(manifest.entries()) == [0, 1]
    assert sorted(manifest.reconcile()) == [0, 1]
    assert (tmp_path / NAME).read_bytes() == line(0) + line(1)


@pytest.mark.parametrize(
    "bad, message",
    [
        (b"garbage\n", ":2: not a manifest entry"),
        (b"\xff\xfe{}\n", ":2: not a manifest entry of this tool (UnicodeDecodeError"),
        (b'{"index": -1, "file": "x", "bytes": 1, "sha256": "s", "tokens": 1}\n', ":2: not a manifest entry"),
        (b'{"index": 1}\n', ":2: not a manifest entry"),
    ],
)
def test_a_bad_line_that_is_not_the_last_is_named(tmp_path, bad, message):
    """Garbage, non-UTF-8 bytes or a wrong entry before the last line: ManifestError naming path and line."""
    (tmp_path / NAME).write_bytes(line(0) + bad + line(3))
    with pytest.raises(ManifestError, match=re.escape(f"{tmp_path / NAME}{message}")):
        Manifest(tmp_path).entries()


def test_a_manifest_that_is_a_folder_is_named(tmp_path):
    """manifest.jsonl being a folder is a ManifestError naming it, not an IsADirectoryError."""
    (tmp_path / NAME).mkdir()
    with pytest.raises(ManifestError, match=rf"{tmp_path / NAME}: cannot be read"):
        Manifest(tmp_path).reconcile()
