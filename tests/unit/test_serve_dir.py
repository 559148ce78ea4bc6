"""The serve folder's lock and names (speculators_v016.serve.folder.ServeDir), without an engine: a lock
file reached through a link or holding what is not ours is refused untouched, a deleted lock is
restored by the running service, and file names are never reused across starts."""

import errno
import fcntl
import json
import os
import stat
import subprocess
import sys
import threading

import pytest

from speculators_v016.serve.folder import JOURNAL, LOCK, ServeDir, ServeDirError


def open_dir(path) -> ServeDir:
    return ServeDir(path, max_bytes=1 << 20, lease_seconds=60).open()


def publish_one(serve: ServeDir) -> str:
    serve.reserve(4, threading.Event())
    return serve.publish([b"abcd"], 4, None)["file"]


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    """A pre-made folder whose lock is a symlink to another file: refused naming it; the target keeps its bytes."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious contents")
    folder = tmp_path / "states"
    folder.mkdir()
    (folder / LOCK).symlink_to(victim)
    with pytest.raises(ServeDirError, match=rf"{LOCK} .*is not a regular file"):
        open_dir(folder)
    assert victim.read_text() == "precious contents"


def test_a_lock_file_hard_linked_or_holding_other_bytes_is_refused_untouched(tmp_path):
    """A lock that is a hard link to another file, or holds anything but a pid, is not ours: refused, untouched."""
    folder = tmp_path / "states"
    folder.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("12345")
    os.link(victim, folder / LOCK)
    with pytest.raises(ServeDirError, match=r"has 2 links"):
        open_dir(folder)
    assert victim.read_text() == "12345"
    (folder / LOCK).unlink()
    (folder / LOCK).write_text("not a pid at all")
    with pytest.raises(ServeDirError, match=r"holds something other than a pid"):
        open_dir(folder)
    assert (folder / LOCK).read_text() == "not a pid at all"


def test_a_lock_of_an_earlier_service_is_taken_and_names_its_pid(tmp_path):
    """The lock an earlier service left (its pid) is reused: the new service writes its own pid."""
    folder = tmp_path / "states"
    serve = open_dir(folder)
    serve.close()
    assert (folder / LOCK).read_text() == str(os.getpid())
    serve = open_dir(folder)
    try:
        assert (folder / LOCK).read_text() == str(os.getpid())
    finally:
        serve.close()


def test_a_deleted_lock_is_restored_and_a_second_service_refused(tmp_path):
    """Lock file deleted while a service runs: its check restores it, so another process cannot take the folder."""
    folder = tmp_path / "states"
    serve = open_dir(folder)
    try:
        name = publish_one(serve)
        (folder / LOCK).unlink()
        assert serve.check_lock() == "restored"
        script = (
            "import sys; from speculators_v016.serve.folder import ServeDir, ServeDirError\n"
            "try:\n    ServeDir(sys.argv[1], 1 << 20, 60).open()\n"
            "except ServeDirError as exc:\n    print(exc)\n"
        )
        other = subprocess.run([sys.executable, "-c", script, folder], capture_output=True, text=True, timeout=60)
        assert f"is in use by a running service (pid {os.getpid()})" in other.stdout, other.stderr
        assert (folder / name).exists()  # the other process deleted nothing
    finally:
        serve.close()


def test_a_replaced_lock_is_found_by_the_running_service(tmp_path):
    """Lock file replaced by another file while a service runs: its check says so (ServeDirError naming the lock)."""
    folder = tmp_path / "states"
    serve = open_dir(folder)
    try:
        (folder / LOCK).unlink()
        (folder / LOCK).write_text("999")
        with pytest.raises(ServeDirError, match=rf"{LOCK} was replaced"):
            serve.check_lock()
    finally:
        serve.close()


def test_names_are_never_reused_after_a_start_that_published_nothing(tmp_path):
    """Publish online_0, restart, publish nothing, restart: the next name is online_1, not online_0 again."""
    folder = tmp_path / "states"
    serve = open_dir(folder)
    assert publish_one(serve) == "online_0.safetensors"
    (folder / "online_0.safetensors").unlink()  # taken
    serve.close()
    open_dir(folder).close()  # a start that published nothing
    serve = open_dir(folder)
    try:
        assert publish_one(serve) == "online_1.safetensors"
        lines = [json.loads(line) for line in (folder / JOURNAL).read_text().splitlines()]
        assert lines[0] == {"next": 1, "service": serve.identity} and lines[1]["file"] == "online_1.safetensors"
    finally:
        serve.close()


def test_a_deleted_lock_file_lets_no_second_service_take_the_folder_meanwhile(tmp_path):
    """Lock file deleted under a live service and a second one started at once, before the first made it again:
    refused (the folder itself is locked), and the first one's unread file is still there."""
    folder = tmp_path / "states"
    serve = open_dir(folder)
    try:
        name = publish_one(serve)
        (folder / LOCK).unlink()
        with pytest.raises(ServeDirError, match=r"is in use by a running service \(pid \? \(its lock file was deleted"):
            open_dir(folder)
        assert (folder / name).read_bytes() == b"abcd" and not (folder / LOCK).exists()
        assert serve.check_lock() == "restored"
        with pytest.raises(ServeDirError, match=rf"is in use by a running service \(pid {os.getpid()}\)"):
            open_dir(folder)
    finally:
        serve.close()
    open_dir(folder).close()  # the lock goes with the service


def test_a_moved_or_replaced_folder_stops_the_service(tmp_path):
    """The folder renamed while a service serves, and another made at its path: the service's check says so
    (ServeDirError naming the folder); nothing of it is touched."""
    folder = tmp_path / "states"
    serve = open_dir(folder)
    try:
        name = publish_one(serve)
        folder.rename(tmp_path / "moved")
        folder.mkdir()
        with pytest.raises(ServeDirError, match=rf"--serve-dir {folder} is no longer the folder this service locked"):
            serve.check_lock()
        assert (tmp_path / "moved" / name).exists() and os.listdir(folder) == []
    finally:
        serve.close()


def test_a_serve_dir_given_through_a_link_is_the_folder_it_leads_to_at_start(tmp_path):
    """--serve-dir through a symlink: the folder it leads to at start is the one locked, published to and named
    (/v1/info); the link retargeted later leads nowhere new."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    serve = open_dir(link)
    try:
        assert serve.describe() == {"kind": "folder", "dir": str(real), "service": serve.identity}
        other = tmp_path / "other"
        other.mkdir()
        link.unlink()
        link.symlink_to(other)
        assert (real / publish_one(serve)).exists() and os.listdir(other) == []
        assert serve.check_lock() == "held"
    finally:
        serve.close()


def test_where_the_filesystem_locks_no_folder_the_lock_file_alone_keeps_others_out(tmp_path, monkeypatch):
    """A filesystem refusing a lock on a folder (NFSv4: ENOLCK; simulated): the service starts on its lock file's
    lock alone, warned of, and a second service is still refused by that lock."""
    real_flock = fcntl.flock

    def no_folder_locks(fd, operation):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.ENOLCK, "No locks available")
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", no_folder_locks)
    folder = tmp_path / "states"
    serve = open_dir(folder)
    try:
        assert not serve.folder_locked
        with pytest.raises(ServeDirError, match=rf"is in use by a running service \(pid {os.getpid()}\)"):
            open_dir(folder)
    finally:
        serve.close()
