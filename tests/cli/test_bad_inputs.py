"""Bad inputs and unusable folders through the real command: each fails before the engine starts, with one
message naming the input and the documented exit code, and leaves what was written as it was.

Read-only, full and unwritable filesystems are real ones: a tmpfs in a private mount namespace
(``unshare -rm``), or the folder seen by a user that does not own it (``unshare --map-user``).
"""

import json
import os
import re
import subprocess
import sys

import pytest

from helpers.cli import CPU, conversations, invoke, write_jsonl
from speculators_v016.store.manifest import Manifest

ENGINE_STARTED = "Initializing a V1 LLM engine"


def _unshare_works(*flags) -> bool:
    try:
        return subprocess.run(["unshare", *flags, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


needs_mount_ns = pytest.mark.skipif(not _unshare_works("-rm"), reason="no unprivileged mount namespace here")


class Result:
    def __init__(self, proc):
        self.exit_code, self.output = proc.returncode, proc.stdout + proc.stderr


def invoke_in_namespace(setup: str, *args) -> Result:
    """The real command in a private mount namespace after the shell commands ``setup`` (mounts)."""
    cmd = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        f'{setup} && exec "$@"',
        "sh",
        sys.executable,
        "-m",
        "speculators_v016.run.cli",
        *map(str, args),
    ]
    return Result(subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **CPU}, timeout=600))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("bad-inputs") / "chats.jsonl", conversations(6, seed=3))


def run_args(model_dir, data, out, *extra):
    return [
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--token-freq-path",
        "",
        *extra,
    ]


def assert_one_message(result, code: int, *needles: str) -> None:
    """Exit ``code``, our error line holding every needle, no traceback on the terminal, no engine started."""
    assert result.exit_code == code, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    for needle in needles:
        assert needle in errors[0], result.output
    assert "Traceback" not in result.output and ENGINE_STARTED not in result.output, result.output


@needs_mount_ns
def test_a_read_only_output_dir_is_refused_by_name(tmp_path, model_dir, data_file):
    """--output-dir on a read-only filesystem: exit 4 naming it, no traceback (was: exit 1, console.py)."""
    mount = tmp_path / "ro"
    mount.mkdir()
    result = invoke_in_namespace(
        f"mount -t tmpfs tmpfs {mount} && mount -o remount,ro {mount}", *run_args(model_dir, data_file, mount / "out")
    )
    assert_one_message(result, 4, f"cannot create or read {mount}/out (Read-only file system)")


def test_an_unwritable_output_dir_is_refused_by_name(tmp_path, model_dir, data_file):
    """A folder the user cannot write: exit 4 naming it (a user that does not own it, where we run as root)."""
    out = tmp_path / "locked"
    out.mkdir()
    out.chmod(0o555)
    prefix = []
    if os.geteuid() == 0:
        if not _unshare_works("--user", "--map-user=1000", "--map-group=1000"):
            pytest.skip("running as root, and no user namespace to drop it")
        prefix = ["unshare", "--user", "--map-user=1000", "--map-group=1000"]
    cmd = [*prefix, sys.executable, "-m", "speculators_v016.run.cli", *map(str, run_args(model_dir, data_file, out))]
    result = Result(subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **CPU}, timeout=600))
    assert_one_message(result, 4, f"cannot create or write {out}/.speculators-data-gen.lock (Permission denied)")
    assert os.listdir(out) == []


@needs_mount_ns
def test_an_already_full_output_disk_is_exit_6_naming_the_file(tmp_path, model_dir, data_file):
    """A full output filesystem: exit 6 naming the file that could not be written (was: exit 1, nothing named)."""
    mount = tmp_path / "full"
    mount.mkdir()
    result = invoke_in_namespace(
        f"mount -t tmpfs -o size=64k tmpfs {mount} && (dd if=/dev/zero of={mount}/filler bs=4k 2>/dev/null; true)",
        *run_args(model_dir, data_file, mount / "out"),
    )
    assert_one_message(result, 6, f"cannot write {mount}/out/", "No space left on device")


@needs_mount_ns
def test_a_full_log_disk_keeps_the_exit_code_and_one_message(tmp_path, model_dir):
    """The log's disk full while the run fails on a bad row: exit 3, one message, no traceback (was: exit 1, two)."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(conversations(1)[0]) + "\n{not json\n")
    result = invoke_in_namespace(
        f"mount -t tmpfs -o size=16k tmpfs {out}/logs && "
        f"(dd if=/dev/zero of={out}/logs/filler bs=4k 2>/dev/null; true)",
        *run_args(model_dir, data, out),
    )
    assert_one_message(result, 3, f"{data}:2: not valid JSON")


def test_a_non_utf8_dataset_names_file_and_line(tmp_path, model_dir):
    """Bytes that are not UTF-8: exit 3 naming file and line (was: exit 5, a bare UnicodeDecodeError)."""
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(json.dumps(conversations(1)[0]).encode() + b"\n" + '{"conversations": "café"}\n'.encode("latin-1"))
    result = invoke(*run_args(model_dir, data, tmp_path / "out"))
    assert_one_message(result, 3, f"{data}:2: not UTF-8 text")


@pytest.mark.parametrize(
    "given, message",
    [
        ("folder", "a folder holding no *.parquet files and not a datasets save_to_disk folder"),
        ("sharegtp", "no such file, and not a dataset name upstream knows"),
    ],
)
def test_a_folder_or_unknown_dataset_name_is_bad_input(tmp_path, model_dir, given, message):
    """An empty folder or a misspelt dataset name: exit 3 naming it (was: exit 5)."""
    (tmp_path / "folder").mkdir()
    data = tmp_path / given if given == "folder" else given
    result = invoke(*run_args(model_dir, data, tmp_path / "out"))
    assert_one_message(result, 3, f"--train-data-path {data}: {message}")


def _unsharded_run(out):
    """What a finished unsharded run leaves (enough for the refusal, which happens before anything is read)."""
    out.mkdir(parents=True)
    (out / "data_config.json").write_text("{}")
    (out / "manifest.jsonl").write_text("")
    (out / "data_0.safetensors").write_bytes(b"0")


def test_a_sharded_run_into_an_unsharded_run_is_refused(tmp_path, model_dir, data_file):
    """Shard 0 of 2 into a folder holding an unsharded run: exit 4, nothing added but the log."""
    out = tmp_path / "out"
    _unsharded_run(out)
    result = invoke(*run_args(model_dir, data_file, out, "--num-shards", 2, "--shard-index", 0))
    assert_one_message(
        result,
        4,
        f"--output-dir {out} holds an unsharded run (data_0.safetensors, data_config.json, manifest.jsonl)",
        "recursively",
    )
    assert sorted(os.listdir(out)) == ["data_0.safetensors", "data_config.json", "logs", "manifest.jsonl"]


def test_an_unsharded_run_into_shard_folders_is_refused(tmp_path, model_dir, data_file):
    """An unsharded run into a folder of shard folders: exit 4 naming them."""
    out = tmp_path / "out"
    (out / "shard-00000-of-00002").mkdir(parents=True)
    result = invoke(*run_args(model_dir, data_file, out))
    assert_one_message(result, 4, "holds the shard folders of a sharded run (shard-00000-of-00002)")


def test_logs_of_other_shards_go_to_the_output_folder(tmp_path, model_dir, data_file):
    """With shard-* folders present, shard 1's log goes to OUT/logs (was: the node's /tmp)."""
    out = tmp_path / "out"
    (out / "shard-00000-of-00002").mkdir(parents=True)
    result = invoke(*run_args(model_dir, data_file, out, "--num-shards", 2, "--shard-index", 1, "--layer-ids", 99))
    assert_one_message(result, 3, "out of range")
    log = re.search(r"(?:last lines of the log \(|log: )(\S+\.log)", result.output)
    assert log and log.group(1).startswith(f"{out}/logs/run-") and log.group(1).endswith("-shard-00001-of-00002.log")


def test_verify_reports_a_broken_manifest_as_a_finding(tmp_path):
    """verify on a folder whose manifest holds garbage before its last line: a FAIL line, exit 1, no traceback."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "data_config.json").write_text(
        json.dumps(
            {
                "model": {"hidden_size": 8},
                "speculators_v016": {
                    "format": "safetensors",
                    "layers": {"layer_ids": [1]},
                    "dtype": "float32",
                    "shard": {"index": 0, "count": 1},
                    "dataset_samples": 1,
                    "start_idx": 0,
                },
            }
        )
    )
    (out / "manifest.jsonl").write_bytes(b"garbage\n\xff\n")
    result = invoke("verify", out)
    assert result.exit_code == 1, result.output
    assert f"FAIL {out}/manifest.jsonl:1: not a manifest entry of this tool" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(ValueError):
        Manifest(out).entries()


def _full_logs(out) -> str:
    return (
        f"mount -t tmpfs -o size=16k tmpfs {out}/logs && (dd if=/dev/zero of={out}/logs/filler bs=4k 2>/dev/null; true)"
    )


@needs_mount_ns
def test_a_full_log_disk_with_a_good_dataset_names_the_log(tmp_path, model_dir, data_file):
    """The log's disk full, a good dataset: exit 6 naming the log file (was: a bare [Errno 28]), and a warning."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    result = invoke_in_namespace(_full_logs(out), *run_args(model_dir, data_file, out))
    assert result.exit_code == 6, result.output
    log = re.search(r"error: cannot write the log (\S+/logs/run-[\d-]+\.log): No space left on device", result.output)
    assert log, result.output
    assert f"warning: the log {log.group(1)} could not be written (No space left on device)" in result.output
    assert "Traceback" not in result.output


@needs_mount_ns
def test_a_full_log_disk_with_a_bad_dataset_warns_of_the_log(tmp_path, model_dir):
    """The log's disk full, a bad row: exit 3 naming the row, and a warning that the log could not be written."""
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(conversations(1)[0]) + "\n{not json\n")
    result = invoke_in_namespace(_full_logs(out), *run_args(model_dir, data, out))
    assert_one_message(result, 3, f"{data}:2: not valid JSON")
    assert re.search(
        r"warning: the log \S+/logs/run-[\d-]+\.log could not be written \(No space left on device\): it holds "
        r"nothing or only its start",
        result.output,
    ), result.output
    assert "last lines of the log" not in result.output
