"""speculators-data-gen speaks with one voice: ours on the terminal, everything else in a log file."""

import pytest

from helpers.cli import assert_one_voice, conversations, invoke, write_jsonl


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("console-data") / "chats.jsonl", conversations(12, seed=2))


def run(model_dir, data_file, out, *flags):
    return invoke(
        *flags,
        "--target-model-path",
        model_dir,
        "--train-data-path",
        data_file,
        "--output-dir",
        out,
        "--seq-length",
        256,
        "--token-freq-path",
        "",
        env={"SPECULATORS_DATA_GEN_NO_PROGRESS": "0"},
    )


def test_run_shows_progress_and_summary_and_logs_the_rest(tmp_path, model_dir, data_file):
    """A run's terminal holds the start line, the progress bar and the summary; vLLM's lines are in OUT/logs."""
    out = tmp_path / "out"
    result = run(model_dir, data_file, out)
    assert result.exit_code == 0, result.output
    log = assert_one_voice(result.output, [out / "logs"])
    assert "logit check: ok (4 samples" in result.output  # on by default
    assert log.name.startswith("run-")
    assert invoke("verify", out).exit_code == 0  # the logs folder is part of the output folder


def test_quiet_shows_only_the_summary(tmp_path, model_dir, data_file):
    """-q: no start line, no progress; the summary and the log path remain."""
    result = run(model_dir, data_file, tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    assert "samples:" not in result.output and "vLLM aux ids" not in result.output
    assert "written:    12 samples" in result.output and "log:        " in result.output


def test_verbose_shows_everything_and_writes_no_log(tmp_path, model_dir, data_file):
    """--verbose: third-party output on the terminal as it comes, and no log file."""
    out = tmp_path / "out"
    result = run(model_dir, data_file, out, "--verbose")
    assert result.exit_code == 0, result.output
    assert "[Gloo]" in result.output and "Initializing a V1 LLM engine" in result.output
    assert not (out / "logs").exists()
