"""OnlineSampleDataset against a producer that is wrong or impersonated: a stub HTTP producer on 127.0.0.1 answers
handles naming files outside the serve folder, links, short files, no file at all, and names folders that are not
the consumer's. Nothing outside the consumer's own folder is read, moved or deleted; every failure is a
ProducerError naming the sample (or the folders) and the producer.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from speculators.train.data import Eagle3SampleFileDataset

from speculators_v016.config import env_name
from speculators_v016.online import OnlineSampleDataset, ProducerError
from speculators_v016.online.readers import SERVE_DIR_VARIABLE
from speculators_v016.run import cli
from speculators_v016.store.checksum import of_bytes
from speculators_v016.store.sample_format import encode_parts

TOKENS = 6


def sample_bytes(seed: int = 0) -> bytes:
    """A sample file's bytes as the service publishes it (4 layers of 8, 6 tokens)."""
    g = torch.Generator().manual_seed(seed)
    sample = {
        "input_ids": torch.arange(TOKENS, dtype=torch.long) + 3,
        "loss_mask": torch.ones(TOKENS, dtype=torch.long),
        "hidden_states": [torch.randn(TOKENS, 8, generator=g) for _ in range(4)],
    }
    return b"".join(bytes(memoryview(p)) for p in encode_parts(sample, "safetensors", [0, 1, 2, 3]))


class StubProducer:
    """/v1/info and /v1/samples: each request answered with the next handle of ``handles``."""

    def __init__(self, serve_dir: Path):
        self.serve_dir, self.handles, self.asked = serve_dir, [], 0
        self.backend = {"kind": "folder", "dir": str(serve_dir)}  # what /v1/info names
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer({"backend": stub.backend, "num_samples": 2, "lengths": [TOKENS, TOKENS]})

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                stub.asked += 1
                self._answer(stub.handles.pop(0) if stub.handles else {"handle": {}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()  # stop: 0.05 s

    def answer(self, *handles: dict) -> None:
        self.handles = [{"handle": h} for h in handles]
        self.asked = 0
        self.backend = {"kind": "folder", "dir": str(self.serve_dir)}


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    serve_dir = tmp_path_factory.mktemp("stub-serve") / "states"
    serve_dir.mkdir()
    stub = StubProducer(serve_dir)
    yield stub
    stub.server.shutdown()


@pytest.fixture
def victim(tmp_path):
    """A valid sample file outside the serve folder, that no handle may reach."""
    data = sample_bytes(7)
    path = tmp_path / "victim" / "data_0.safetensors"
    path.parent.mkdir()
    path.write_bytes(data)
    return path, data


def handle_of(name: str, data: bytes) -> dict:
    return {"backend": "folder", "file": name, "bytes": len(data), "blake3": of_bytes(data, "blake3"), "num_tokens": 6}


def dataset(producer, mode="online", cache=None, folder="own") -> OnlineSampleDataset:
    folder = producer.serve_dir if folder == "own" else folder
    return OnlineSampleDataset(producer.url, max_len=64, mode=mode, cache_dir=cache, retries=0, folder=folder)


def assert_refused(producer, ds, match: str) -> None:
    with pytest.raises(ProducerError) as caught:
        ds[0]
    message = str(caught.value)
    assert message.startswith("sample 0: ") and f"the producer {producer.url}" in message, message
    assert match in message, message


def test_a_served_file_is_read_and_then_deleted(producer):
    """The stub works as the service does: a plain name in the folder, right size and digest, read then deleted."""
    data = sample_bytes(1)
    (producer.serve_dir / "online_1.safetensors").write_bytes(data)
    producer.answer(handle_of("online_1.safetensors", data))
    item = dataset(producer)[0]
    assert item["input_ids"].tolist() == list(range(4, 3 + TOKENS))  # upstream shifts by one
    assert not (producer.serve_dir / "online_1.safetensors").exists()


@pytest.mark.parametrize("mode", ["online", "hybrid"])
@pytest.mark.parametrize("how", ["absolute", "dotdot", "subfolder"])
def test_a_handle_naming_a_file_outside_the_folder_is_refused_and_the_file_left(producer, victim, tmp_path, mode, how):
    """Absolute, ../ and folder-holding names: refused, naming sample and producer; the file is neither read,
    moved into the cache nor deleted, and not asked for again."""
    path, data = victim
    name = {
        "absolute": str(path),
        "dotdot": os.path.relpath(path, producer.serve_dir),
        "subfolder": "sub/online_1.safetensors",
    }[how]
    producer.answer(handle_of(name, data), handle_of(name, data))
    cache = tmp_path / "cache"
    ds = dataset(producer, mode, cache if mode == "hybrid" else None)
    assert_refused(producer, ds, "not a plain name of the service's folder")
    assert path.read_bytes() == data
    assert producer.asked == 1
    assert list(cache.iterdir()) == [] if mode == "hybrid" else True


@pytest.mark.parametrize("mode", ["online", "hybrid"])
def test_a_served_name_that_is_a_link_is_not_followed(producer, victim, tmp_path, mode):
    """online_N.safetensors a symbolic link to a file elsewhere: refused, the file it points to untouched."""
    path, data = victim
    link = producer.serve_dir / "online_2.safetensors"
    link.symlink_to(path)
    try:
        producer.answer(handle_of(link.name, data))
        cache = tmp_path / "cache"
        ds = dataset(producer, mode, cache if mode == "hybrid" else None)
        assert_refused(producer, ds, "is a symbolic link, not a file the service wrote: not followed")
        assert path.read_bytes() == data and link.is_symlink()
        assert not cache.exists() or list(cache.iterdir()) == []
    finally:
        link.unlink()


def test_a_reply_without_a_file_is_a_producer_error(producer):
    """A handle with no `file`: a ProducerError naming the sample and the producer, never a bare KeyError."""
    producer.answer({"backend": "folder", "bytes": 100, "blake3": "0" * 64})
    assert_refused(producer, dataset(producer), "the reply's handle has no 'file'")
    producer.answer({})
    producer.handles = [{"nothing": 1}]
    assert_refused(producer, dataset(producer), "answered without a handle (KeyError")


@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_short_or_altered_file_is_asked_for_again_then_named(producer, damage):
    """A file shorter than its handle says, or of another digest: asked for once more, then a ProducerError naming
    sample, producer and why (never a bare SafetensorError); the file is left for the service to reclaim."""
    data = sample_bytes(3)
    served = producer.serve_dir / "online_3.safetensors"
    bad = data[: len(data) // 2] if damage == "truncated" else data[:-1] + bytes([data[-1] ^ 1])
    served.write_bytes(bad)
    producer.answer(handle_of(served.name, data), handle_of(served.name, data))
    try:
        why = "bytes, the reply says" if damage == "truncated" else "its blake3 differs from the reply's"
        assert_refused(producer, dataset(producer), why)
        assert producer.asked == 2
        assert served.read_bytes() == bad
    finally:
        served.unlink()


def test_a_file_whose_tensors_do_not_reach_its_end_is_refused(producer):
    """Right size and digest (the producer's word) but not a whole safetensors file: named, not handed to torch."""
    data = sample_bytes(4) + b"\0" * 8
    served = producer.serve_dir / "online_4.safetensors"
    served.write_bytes(data)
    producer.answer(handle_of(served.name, data), handle_of(served.name, data))
    try:
        assert_refused(producer, dataset(producer), "a safetensors file whose tensors end at")
    finally:
        served.unlink()


def test_hybrid_keeps_a_served_file_across_filesystems_and_then_removes_it(producer):
    """A cache on another filesystem than the serve folder: the checked file is copied into it, then removed from
    the folder; the next epoch reads the cache and asks nothing."""
    data = sample_bytes(5)
    served = producer.serve_dir / "online_5.safetensors"
    served.write_bytes(data)
    cache = Path(tempfile.mkdtemp(prefix="speculators-test-cache-", dir="/dev/shm"))
    try:
        assert os.stat(cache).st_dev != os.stat(producer.serve_dir).st_dev, "the test needs two filesystems"
        producer.answer(handle_of(served.name, data))
        ds = dataset(producer, "hybrid", cache)
        first = ds[0]
        assert not served.exists() and (cache / "data_0.safetensors").read_bytes() == data
        assert torch.equal(ds[0]["hidden_states"], first["hidden_states"]) and producer.asked == 1
    finally:
        shutil.rmtree(cache)


def test_a_file_replaced_while_it_is_read_is_not_used(producer, monkeypatch):
    """The served name made to hold another file while upstream's reader reads it: a ProducerError, the item not
    used, and the file now under the name left (it is not the one that was checked)."""
    data = sample_bytes(6)
    served = producer.serve_dir / "online_6.safetensors"
    served.write_bytes(data)
    other = producer.serve_dir / ".other"
    other.write_bytes(sample_bytes(8))
    read = Eagle3SampleFileDataset.__getitem__

    def read_then_replace(self, index):
        item = read(self, index)
        os.replace(other, served)
        return item

    monkeypatch.setattr(Eagle3SampleFileDataset, "__getitem__", read_then_replace)
    producer.answer(handle_of(served.name, data))
    try:
        assert_refused(producer, dataset(producer), "was replaced while it was read: the item is not used")
        assert served.read_bytes() == sample_bytes(8)
    finally:
        served.unlink()


def test_without_a_folder_of_its_own_the_consumer_touches_nothing_in_the_folder_the_producer_names(
    producer, victim, monkeypatch
):
    """A producer naming another folder (one holding another service's unread online_0.safetensors) and a consumer
    given no folder: refused at start naming the producer's folder and how to give one; the file is untouched."""
    path, data = victim
    served = path.with_name("online_0.safetensors")
    path.rename(served)
    monkeypatch.delenv(SERVE_DIR_VARIABLE, raising=False)
    producer.answer(handle_of(served.name, data))
    producer.backend = {"kind": "folder", "dir": str(served.parent)}
    with pytest.raises(ProducerError) as caught:
        dataset(producer, folder=None)[0]
    assert str(caught.value) == (
        f"the producer {producer.url} publishes to the folder {str(served.parent)!r}: this consumer reads and "
        "deletes files only in a folder it is given: folder= (where this host sees the service's --serve-dir), or "
        f"{SERVE_DIR_VARIABLE}"
    )
    assert served.read_bytes() == data and producer.asked == 0


def test_a_folder_that_is_not_the_producers_is_refused_naming_both(producer, victim):
    """The consumer's folder and the one the producer names differ (device and inode; the producer names no
    service start): refused at start naming both; nothing asked, nothing read in either."""
    path, data = victim
    producer.answer(handle_of("online_0.safetensors", data))
    producer.backend = {"kind": "folder", "dir": str(path.parent)}
    with pytest.raises(ProducerError) as caught:
        dataset(producer)
    assert str(caught.value) == (
        f"the producer {producer.url} publishes to the folder {str(path.parent)!r}, not to {producer.serve_dir}: "
        "another folder, or none, as this host sees them"
    )
    assert path.read_bytes() == data and producer.asked == 0


def test_a_folder_is_the_producers_by_the_service_journal_it_holds(producer, tmp_path):
    """A producer naming its service start: the consumer's folder must hold that start's journal. Seen under
    another path (another node's mount: the producer's path not found here) it is accepted; holding no journal,
    or another start's, it is refused naming both."""
    journal = producer.serve_dir / "published.jsonl"
    data = sample_bytes(9)
    served = producer.serve_dir / "online_9.safetensors"
    try:
        journal.write_text('{"next": 9, "service": "abc123"}\n{"file": "online_9.safetensors"}\n')
        served.write_bytes(data)
        producer.answer(handle_of(served.name, data))
        producer.backend = {"kind": "folder", "dir": "/elsewhere/states", "service": "abc123"}
        assert dataset(producer)[0]["input_ids"].tolist() == list(range(4, 3 + TOKENS))
        assert not served.exists()
        producer.backend = {"kind": "folder", "dir": str(producer.serve_dir), "service": "def456"}
        with pytest.raises(ProducerError, match=(
            rf"publishes to the folder '{producer.serve_dir}', not to {producer.serve_dir}: {producer.serve_dir} "
            r"holds the journal of another service start \(abc123\), the producer's is def456$"
        )):  # fmt: skip
            dataset(producer)
        journal.unlink()
        with pytest.raises(ProducerError, match=r"holds no service's journal, the producer's is def456$"):
            dataset(producer)
    finally:
        journal.unlink(missing_ok=True)


def test_the_folder_can_come_from_the_services_variable(producer, monkeypatch):
    """folder= not given: SPECULATORS_DATA_GEN_SERVE_SERVE_DIR (the service's own --serve-dir variable) names it."""
    data = sample_bytes(10)
    (producer.serve_dir / "online_10.safetensors").write_bytes(data)
    producer.answer(handle_of("online_10.safetensors", data))
    monkeypatch.setenv(SERVE_DIR_VARIABLE, str(producer.serve_dir))
    assert dataset(producer, folder=None)[0]["input_ids"].tolist() == list(range(4, 3 + TOKENS))
    assert not (producer.serve_dir / "online_10.safetensors").exists()


def test_the_folder_variable_is_the_services_own_serve_dir_variable():
    """SERVE_DIR_VARIABLE is what `serve --serve-dir` reads too: set once, both sides agree."""
    serve = next(c for c in cli.cli.commands.values() if c.name == "serve")
    option = next(p for p in serve.params if "--serve-dir" in getattr(p, "opts", ()))
    assert option.envvar == SERVE_DIR_VARIABLE == env_name("--serve-dir", "serve")
