"""Where logs go: a folder only this user can enter, files never opened through a link or appended to."""

import os
import stat
import tempfile

import pytest
from loguru import logger

from speculators_v016.run.console import Console, open_log, private_dir, run_log_path, scratch_log_path


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """A temporary folder of this test standing in for /tmp; no XDG_RUNTIME_DIR."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return tmp_path


def test_scratch_logs_go_to_a_folder_only_this_user_can_enter(tmp):
    """verify/check logs: <tmp>/speculators-data-gen-<uid>, made 0700, owned by the user."""
    path = scratch_log_path("verify")
    assert path.parent == tmp / f"speculators-data-gen-{os.geteuid()}"
    info = os.lstat(path.parent)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()
    assert path.name.startswith("verify-") and path.suffix == ".log"


def test_xdg_runtime_dir_is_preferred_when_private(tmp, monkeypatch):
    """With a private $XDG_RUNTIME_DIR the logs go under it."""
    runtime = tmp / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert private_dir() == runtime / "speculators-data-gen"


@pytest.mark.parametrize("plant", ["link", "open-folder", "file"])
def test_a_planted_or_shared_folder_is_not_used(tmp, plant):
    """The per-user name taken by a link, a folder others can enter, or a file: a fresh private folder instead."""
    name = tmp / f"speculators-data-gen-{os.geteuid()}"
    target = tmp / "attacker"
    target.mkdir(mode=0o777)
    if plant == "link":
        name.symlink_to(target)
    elif plant == "open-folder":
        name.mkdir()
        os.chmod(name, 0o777)
    else:
        name.write_text("")
    folder = private_dir()
    assert folder != name and folder.parent == tmp
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    assert os.listdir(target) == []


def test_a_log_is_never_opened_through_a_link_or_appended_to(tmp_path):
    """A link or a file already at the log's name is left alone: the log gets the next free name."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    planted = tmp_path / "verify-20260101-000000.log"
    planted.symlink_to(victim)
    fd, path = open_log(planted)
    os.write(fd, b"log line\n")
    os.close(fd)
    assert path == tmp_path / "verify-20260101-000000-2.log" and path.read_text() == "log line\n"
    assert victim.read_text() == "precious\n"
    fd, third = open_log(planted)
    os.close(fd)
    assert third.name == "verify-20260101-000000-3.log"


def test_shard_logs_go_to_the_output_folder_beside_shard_folders(tmp, tmp_path):
    """OUT holding shard-* folders (and logs) keeps the logs of the other shards and of resumes."""
    out = tmp_path / "out"
    (out / "shard-00000-of-00002").mkdir(parents=True)
    (out / "logs").mkdir()
    assert run_log_path(out, "run", "-shard-00001-of-00002").parent == out / "logs"
    (out / "notes.txt").write_text("not ours")
    assert run_log_path(out, "run").parent == private_dir()


def test_the_library_is_quiet_again_after_the_console_closes():
    """The CLI's console enables our package's log while it runs; once it closes, the library is quiet again."""
    with Console(None, mode="quiet"):
        pass
    seen = []
    sink = logger.add(seen.append)
    try:
        exec("from loguru import logger\nlogger.warning('should not appear')", {"__name__": "speculators_v016.x"})
    finally:
        logger.remove(sink)
    assert seen == []


def test_the_console_unsets_the_variables_it_set_and_keeps_the_callers(monkeypatch):
    """vLLM's logging variables a console set are gone once it closes (a quiet command's WARNING level stayed for
    the next command run in the same process, whose log then lacked vLLM's lines); a caller's own are kept."""
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    with Console(None, mode="quiet"):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"
