"""Values that cannot run are usage errors (exit 2) naming the option or variable, before anything starts."""

import gc

import pytest
from click.testing import CliRunner

from speculators_v016.run.cli import _join_multi_value, cli

RUN = ["--target-model-path", "no-model", "--train-data-path", "no-data.jsonl", "--output-dir", "no-out"]


def invoke(argv, env=None):
    """The command as main() runs it: upstream's multi-value --layer-ids joined first."""
    return CliRunner().invoke(cli, _join_multi_value(argv, "--layer-ids"), env=env or {})


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--write-workers", "0", "Invalid value for '--write-workers': 0 is not in the range x>=1"),
        ("--max-samples", "-2", "Invalid value for '--max-samples': -2 is not in the range x>=1"),
        ("--seq-length", "-5", "Invalid value for '--seq-length': -5 is not in the range x>=1"),
        ("--batch-size", "0", "Invalid value for '--batch-size'"),
        ("--max-num-seqs", "0", "Invalid value for '--max-num-seqs'"),
        ("--num-shards", "0", "Invalid value for '--num-shards'"),
        ("--gpu-memory-utilization", "1.5", "Invalid value for '--gpu-memory-utilization'"),
    ],
)
def test_values_that_cannot_run_are_usage_errors(option, value, message):
    """--write-workers 0 (hangs), --max-samples -2 (drops rows), a negative --seq-length ...: exit 2, named."""
    result = invoke(RUN + [option, value])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("variable, value", [("WORLD_SIZE", "abc"), ("WORLD_SIZE", "0"), ("SLURM_NTASKS", "2x")])
def test_a_launcher_variable_that_is_not_a_number_is_a_usage_error(variable, value):
    """WORLD_SIZE=abc: exit 2 naming the variable and its value, no traceback."""
    result = invoke(RUN, env={variable: value})
    assert result.exit_code == 2, result.output
    assert f"environment variable {variable}={value!r} is not a whole number" in result.output
    assert "Traceback" not in result.output


def test_rank_that_is_not_a_number_is_a_usage_error():
    """RANK=x with WORLD_SIZE=2: exit 2 naming RANK."""
    result = invoke(RUN, env={"WORLD_SIZE": "2", "RANK": "x"})
    assert result.exit_code == 2 and "environment variable RANK='x'" in result.output, result.output


@pytest.mark.parametrize(
    "argv",
    [
        ["--layer-ids"],
        ["--layer-ids", ""],
        ["--layer-ids", "--seed", "1"],
        ["--layer-ids="],
        ["check", "--target-model-path", "m", "--train-data-path", "d", "--layer-ids", ""],
    ],
)
def test_an_empty_layer_ids_value_is_refused(argv):
    """--layer-ids with no value (an empty $LAYERS) is refused, never the default layers."""
    result = invoke((RUN if argv[0] != "check" else []) + argv)
    assert result.exit_code == 2 and "no layer id given" in result.output, result.output


@pytest.mark.parametrize("values", [["-1"], ["2", "-1"], ["2,-3"], ["-1", "5"]])
def test_a_negative_layer_id_gets_a_real_message(values):
    """--layer-ids -1 is a value (as upstream's argparse read it), refused saying why, not 'No such option'."""
    result = invoke(RUN + ["--layer-ids", *values])
    assert result.exit_code == 2, result.output
    assert "negative: id L is the output of decoder layer L, from 0 to n-1" in result.output
    assert "No such option" not in result.output


def test_layer_ids_are_joined_in_every_spelling():
    """`--layer-ids 2 16`, `--layer-ids=2 16` and negative values become one value; other options stay."""
    assert _join_multi_value(["--layer-ids", "2", "16", "--seed", "1"], "--layer-ids") == [
        "--layer-ids",
        "2 16",
        "--seed",
        "1",
    ]
    assert _join_multi_value(["--layer-ids=2", "16", "-q"], "--layer-ids") == ["--layer-ids", "2 16", "-q"]
    assert _join_multi_value(["--layer-ids", "-1", "-v"], "--layer-ids") == ["--layer-ids", "-1", "-v"]
    assert _join_multi_value(["--layer-ids"], "--layer-ids") == ["--layer-ids", ""]


def test_main_freezes_the_collector_at_exit_after_the_runs_own_handlers(monkeypatch):
    """main() registers gc.freeze before the run starts: at exit it runs after the handlers the run registered."""
    from speculators_v016.run import cli as command  # noqa: PLC0415 - the module, not its click group

    calls = []
    monkeypatch.setattr(command.exit_gc.atexit, "register", calls.append)
    monkeypatch.setattr(command.huge_pages, "reexec", lambda: calls.append("reexec"))
    monkeypatch.setattr(command.cli, "main", lambda **kwargs: calls.append("run"))
    command.main()
    assert calls == ["reexec", gc.freeze, "run"]
