"""The manifest's digest: standard BLAKE3 by default, sha256 on request, old sha256 lines read and kept as they are."""

import hashlib
import json
import re

import blake3
import pytest
import torch

from speculators_v016.run.pipeline import checksum_of_run
from speculators_v016.store import atomic_files, checksum
from speculators_v016.store.atomic_files import write_atomic, write_durable
from speculators_v016.store.manifest import NAME, Entry, Manifest, ManifestError
from speculators_v016.store.run_config import ResumeMismatchError
from speculators_v016.store.writer import SampleWriter

# An earlier release's manifest line, byte for byte (json.dumps(asdict(entry), sort_keys=True)), of b"x" * 12.
OLD_DIGEST = "59ffe12a70df15109e0345955e3230a978f31ebc28d8fe3e42d306afb28b8e81"
OLD_LINE = (
    b'{"bytes": 12, "file": "data_0.safetensors", "index": 0, "sha256": "%s", "tokens": 3}\n' % OLD_DIGEST.encode()
)


def parts(total: int, pieces: int) -> list[bytes]:
    """``total`` pseudo-random bytes cut into ``pieces`` buffers of uneven sizes."""
    data = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)).numpy()
    cuts = sorted({0, total, *(total * k // pieces + 7 * k for k in range(1, pieces))})
    return [data[a:b].tobytes() for a, b in zip(cuts, cuts[1:])]


def test_blake3_is_the_standard_one():
    """Our BLAKE3 is BLAKE3-256 as b3sum prints it: the reference test vector of the empty input."""
    assert checksum.of_bytes(b"", "blake3") == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_the_digest_is_of_the_bytes_written(tmp_path, monkeypatch, algorithm):
    """Parts hashed chunk by chunk as written give the one-shot digest of the file as read back from disk."""
    monkeypatch.setattr(atomic_files, "WRITE_CHUNK", 1000)  # many chunks, boundaries inside and across parts
    buffers = parts(10_007, 5)
    size, digest = write_durable(tmp_path, "f.bin", buffers, algorithm=algorithm)
    raw = (tmp_path / "f.bin").read_bytes()
    assert raw == b"".join(buffers) and size == len(raw)
    one_shot = blake3.blake3(raw).hexdigest() if algorithm == "blake3" else hashlib.sha256(raw).hexdigest()
    assert digest == one_shot == checksum.of_file(tmp_path / "f.bin", algorithm)


def test_the_default_is_blake3(tmp_path):
    """write_atomic without an algorithm gives the BLAKE3 digest of the file."""
    _, digest = write_atomic(tmp_path, "f.bin", parts(3000, 2))
    assert digest == blake3.blake3((tmp_path / "f.bin").read_bytes()).hexdigest()


def test_an_unknown_algorithm_is_refused_before_any_file(tmp_path):
    """An algorithm we do not know: ValueError naming it and ours, and no file (not even a temporary one)."""
    with pytest.raises(
        ValueError, match=re.escape("unknown checksum algorithm 'md5'; choose from ['blake3', 'sha256']")
    ):
        write_durable(tmp_path, "f.bin", [b"x"], algorithm="md5")
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        SampleWriter(tmp_path, "safetensors", [1], checksum="md5")
    assert list(tmp_path.iterdir()) == []


def test_an_earlier_releases_line_reads_and_is_kept_byte_for_byte(tmp_path):
    """A sha256 line of an earlier release parses as a sha256 entry; compacting writes the same bytes back."""
    (tmp_path / "data_0.safetensors").write_bytes(b"x" * 12)
    (tmp_path / NAME).write_bytes(OLD_LINE + OLD_LINE[:20])  # and a torn line, so reconcile rewrites
    entries = Manifest(tmp_path).reconcile()
    assert entries == {0: Entry(0, "data_0.safetensors", 12, OLD_DIGEST, 3, "sha256")}
    assert (tmp_path / NAME).read_bytes() == OLD_LINE


def test_a_blake3_entry_is_named_by_its_key(tmp_path):
    """A BLAKE3 entry's line holds its digest under "blake3" (and no sha256 key), and reads back equal."""
    entry = Entry(4, "data_4.safetensors", 9, "cd" * 32, 2, "blake3")
    Manifest(tmp_path).append(entry)
    record = json.loads((tmp_path / NAME).read_text())
    assert record == {"index": 4, "file": "data_4.safetensors", "bytes": 9, "blake3": "cd" * 32, "tokens": 2}
    assert Manifest(tmp_path).entries() == {4: entry}


@pytest.mark.parametrize(
    "digests", [{}, {"sha256": "ab", "blake3": "cd"}, {"md5": "ab"}], ids=["none", "both", "unknown"]
)
def test_a_line_without_exactly_one_known_digest_is_not_an_entry(tmp_path, digests):
    """No digest, two digests, or an unknown algorithm's: ManifestError naming the line."""
    bad = {"index": 1, "file": "data_1.safetensors", "bytes": 3, "tokens": 1, **digests}
    (tmp_path / NAME).write_bytes((json.dumps(bad) + "\n").encode() + OLD_LINE)
    with pytest.raises(ManifestError, match=re.escape(f"{tmp_path / NAME}:1: not a manifest entry of this tool")):
        Manifest(tmp_path).entries()


def sample(i: int) -> dict:
    return {
        "input_ids": torch.arange(5) + i,
        "loss_mask": torch.ones(5, dtype=torch.long),
        "hidden_states": [torch.randn(5, 8, generator=torch.Generator().manual_seed(i)) for _ in range(2)],
    }


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_the_writer_lists_the_algorithm_it_was_given(tmp_path, algorithm):
    """SampleWriter(checksum=...) lists every file with that algorithm's digest of its bytes on disk."""
    writer = SampleWriter(tmp_path, "safetensors", [1, 2], workers=2, checksum=algorithm)
    for i in range(6):
        writer.put(i, sample(i))
    writer.close()
    entries = Manifest(tmp_path).entries()
    assert sorted(entries) == list(range(6))
    for entry in entries.values():
        assert entry.algorithm == algorithm
        assert entry.digest == checksum.of_bytes((tmp_path / entry.file).read_bytes(), algorithm)
    assert {json.loads(line).get(algorithm) is not None for line in (tmp_path / NAME).read_text().splitlines()} == {
        True
    }


def config(checksum_field=None) -> dict:
    section = {"format": "safetensors"}
    if checksum_field is not None:
        section["checksum"] = checksum_field
    return {"speculators_v016": section}


def entries(algorithm: str, count: int = 2) -> dict:
    return {i: Entry(i, f"data_{i}.safetensors", 1, "ab", 1, algorithm) for i in range(count)}


def test_a_new_folder_gets_blake3_or_what_is_asked(tmp_path):
    """No folder yet (or one with nothing listed): the default BLAKE3, or the --checksum given."""
    assert checksum_of_run(tmp_path, None, {}, None) == "blake3"
    assert checksum_of_run(tmp_path, None, {}, "sha256") == "sha256"
    assert checksum_of_run(tmp_path, config("blake3"), {}, "sha256") == "sha256"


def test_an_earlier_releases_folder_resumes_with_sha256(tmp_path):
    """A config without a checksum field and sha256 entries: the resume keeps sha256, asked for it or not."""
    assert checksum_of_run(tmp_path, config(), entries("sha256"), None) == "sha256"
    assert checksum_of_run(tmp_path, config(), entries("sha256"), "sha256") == "sha256"
    assert checksum_of_run(tmp_path, config("blake3"), entries("blake3"), None) == "blake3"


@pytest.mark.parametrize(
    "held, asked, existing", [("sha256", "blake3", config()), ("blake3", "sha256", config("blake3"))]
)
def test_a_resume_asking_for_another_algorithm_is_refused_naming_both(tmp_path, held, asked, existing):
    """--checksum other than the folder's, with samples listed: ResumeMismatchError naming both algorithms."""
    message = f"{tmp_path} holds 2 samples listed with {held} digests; this run asks for --checksum {asked}"
    with pytest.raises(ResumeMismatchError, match=re.escape(message)):
        checksum_of_run(tmp_path, existing, entries(held), asked)


def test_entries_that_disagree_with_the_config_are_refused(tmp_path):
    """A manifest whose digests are not the algorithm data_config.json names: refused, naming both."""
    with pytest.raises(ResumeMismatchError, match="lists blake3 digests, data_config.json says sha256"):
        checksum_of_run(tmp_path, config(), entries("blake3"), None)
