"""The capture ring: bounded slots, one shared mapping, and a file the worker maps only if it is the engine's."""

import dataclasses
import os
import shutil
import tempfile

import pytest
import torch

from speculators_v016.shared import slot_ring
from speculators_v016.shared.slot_ring import PREFIX, RingIdentityError, RingSpaceError, SlotRing, file_bytes


@pytest.fixture
def shm():
    """A private tmpfs folder standing in for /dev/shm."""
    where = tempfile.mkdtemp(prefix="speculators-test-ring-", dir="/dev/shm")
    yield where
    shutil.rmtree(where, ignore_errors=True)


def make_ring(shm, **kw):
    return SlotRing.create(
        slots=2, num_ids=2, max_rows=8, hidden=4, dtype=torch.float32, shared=True, directory=shm, **kw
    )


def test_small_dev_shm_is_refused_with_the_bytes_needed(monkeypatch):
    """A /dev/shm that cannot hold the ring fails at once, naming the bytes and how to need fewer."""
    monkeypatch.setattr(slot_ring, "_shm_free_bytes", lambda directory=None: 64 * 2**20)
    with pytest.raises(RingSpaceError) as info:
        SlotRing.create(slots=3, num_ids=4, max_rows=8192, hidden=7168, dtype=torch.bfloat16, shared=True)
    message = str(info.value)
    assert "1,409,286,144 bytes" in message and "--max-num-batched-tokens (now 8192)" in message
    assert "--shm-size" in message and "64 MiB free" in message
    assert not [p for p in os.listdir(slot_ring.SHM_DIR) if p.startswith(f"{PREFIX}{os.getpid()}-")]


def test_ring_file_is_gone_once_mapped_and_slots_are_bounded():
    """The owner unlinks the /dev/shm name after mapping; slots come back only when released."""
    ring = SlotRing.create(slots=2, num_ids=2, max_rows=8, hidden=4, dtype=torch.float32, shared=True)
    worker = SlotRing.attach(ring.spec)
    worker.slot(1)[0, :3] = 7.0
    assert (ring.slot(1)[0, :3] == 7.0).all()  # one shared mapping
    ring.unlink()
    assert not os.path.exists(ring.spec.path)
    assert (ring.acquire(), ring.acquire()) == (0, 1)
    with pytest.raises(RuntimeError, match="all 2 capture slots are in use"):
        ring.acquire()
    ring.release(0)
    with pytest.raises(RuntimeError, match="released twice"):
        ring.release(0)
    assert ring.acquire() == 0
    ring.close()


def test_the_creator_reports_the_file_before_reserving_it(shm):
    """``created`` sees the new file (name, device, inode) first: a run records it before anything can fail."""
    seen = []
    ring = make_ring(shm, created=lambda name, st: seen.append((name, st.st_ino, os.path.exists(f"{shm}/{name}"))))
    assert seen == [(ring.spec.name, os.stat(ring.spec.path).st_ino, True)]
    assert os.path.getsize(ring.spec.path) == file_bytes(ring.spec) == slot_ring.HEADER_BYTES + ring.spec.total_bytes
    assert ring.buffer.data_ptr() % 4096 == 0  # slots page-aligned (pinned registration on GPUs)
    ring.close()
    assert os.listdir(shm) == []


def test_a_vanished_ring_is_refused_and_never_recreated(shm):
    """A ring name deleted before the worker maps it: a clear error, and no new (zero) file appears."""
    ring = make_ring(shm)
    os.unlink(ring.spec.path)
    with pytest.raises(RingIdentityError, match=r"is gone: something removed it .*Refusing to create a new one"):
        SlotRing.attach(ring.spec)
    assert os.listdir(shm) == []
    ring.close()


@pytest.mark.parametrize("how", ["same-size", "other-size", "same-header-other-token", "symlink", "folder"])
def test_a_replaced_ring_is_refused_and_left_alone(shm, how):
    """A file that took the ring's name (any size, a copied header, a link) is not mapped, and not deleted."""
    ring = make_ring(shm)
    original = open(ring.spec.path, "rb").read()
    os.unlink(ring.spec.path)
    path = ring.spec.path
    if how == "symlink":
        target = os.path.join(shm, "elsewhere")
        open(target, "wb").write(original)
        os.symlink(target, path)
    elif how == "folder":
        os.mkdir(path)
    else:
        data = bytearray(len(original) if how != "other-size" else len(original) + 4096)
        if how == "same-header-other-token":
            data[:64] = original[:64]
            data[16:32] = bytes(16)
        open(path, "wb").write(bytes(data))
    expected = {
        "same-size": "identity token",
        "other-size": "bytes",
        "same-header-other-token": "identity token",
        "symlink": "symbolic link",
        "folder": "cannot be opened",
    }[how]
    with pytest.raises(RingIdentityError, match=expected):
        SlotRing.attach(ring.spec)
    ring.close()  # the owner unlinks only the file it created
    assert os.path.lexists(path)


def test_a_spec_without_token_is_refused(shm):
    """A shared spec that carries no identity token cannot be attached."""
    ring = make_ring(shm)
    with pytest.raises(RingIdentityError, match="no identity token"):
        SlotRing.attach(dataclasses.replace(ring.spec, token=""))
    ring.close()
