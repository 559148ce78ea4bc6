"""What a service published and no consumer took (speculators_v016.serve.publications), without an engine:
how long publishing waits at the cap and who holds it, and releasing what a client gave up on."""

import threading
import time

import pytest

from speculators_v016.serve import publications
from speculators_v016.serve.auth import ApiKeyError, api_key_of
from speculators_v016.serve.publications import Publications


class InMemory(Publications):
    """Objects in a dict: taken when removed from it."""

    def __init__(self, max_bytes: int):
        super().__init__(max_bytes, lease_seconds=60)
        self.objects: set[str] = set()

    def put(self, name: str, nbytes: int, consumer: dict | None) -> None:
        self.reserve(nbytes, threading.Event())
        self.objects.add(name)
        self._record(name, nbytes, consumer)

    def _taken(self, names):
        return {n for n in names if n not in self.objects}

    def _delete(self, name):
        self.objects.discard(name)


def test_blocked_names_the_wait_the_bytes_and_the_consumer_holding_most(monkeypatch):
    """A publisher waiting at the cap past BLOCKED_SECONDS: blocked() names the bytes held and who holds most."""
    monkeypatch.setattr(publications, "BLOCKED_SECONDS", 0.2)
    store = InMemory(max_bytes=100)
    store.put("a", 60, {"host": "h1", "pid": 7, "start": 1})
    store.put("b", 30, {"host": "h1", "pid": 7, "start": 1})
    assert store.blocked() is None and store.waiting_seconds() == 0
    stop = threading.Event()
    waiter = threading.Thread(target=store.reserve, args=(50, stop))
    waiter.start()
    deadline = time.monotonic() + 10
    while store.blocked() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    message = store.blocked()
    assert "at --max-published-bytes 100: 90 bytes in 2 published objects" in message
    assert "2 of them asked by pid 7 on h1" in message and store.waiting_seconds() >= 0.2
    store.objects.discard("a")  # taken: the waiter goes on
    waiter.join(timeout=10)
    assert not waiter.is_alive() and store.blocked() is None


def test_release_deletes_only_what_is_recorded_and_not_taken():
    """release() deletes a recorded object not yet taken (counted); a taken or unknown one: False, nothing done."""
    store = InMemory(max_bytes=1000)
    store.put("a", 10, None)
    store.put("b", 10, None)
    store.objects.discard("b")  # taken
    assert store.release("a") and "a" not in store.objects and store.reclaimed.released == 1
    assert not store.release("b") and not store.release("zzz") and store.reclaimed.released == 1


def test_the_api_key_comes_from_the_option_or_the_first_line_of_its_file(tmp_path):
    """--api-key as given; --api-key-file's first line; an empty key, an unreadable file or both: named errors."""
    assert api_key_of(None, None) is None and api_key_of("k1", None) == "k1"
    (tmp_path / "key").write_text("k2\nignored\n")
    assert api_key_of(None, tmp_path / "key") == "k2"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ApiKeyError, match="its first line is empty"):
        api_key_of(None, tmp_path / "empty")
    with pytest.raises(ApiKeyError, match="cannot read it"):
        api_key_of(None, tmp_path / "missing")
    with pytest.raises(ApiKeyError, match="--api-key is empty"):
        api_key_of("  ", None)
