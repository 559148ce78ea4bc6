"""The command line is generated from the configuration tree: every option, its variable, its checks."""

import contextlib
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner

from speculators_v016 import config
from speculators_v016.config import (
    CheckConfig,
    CleanShmConfig,
    ConfigError,
    ConsoleConfig,
    DemoConfig,
    EngineConfig,
    RunConfig,
    ServeConfig,
    VerifyConfig,
    option_fields,
)
from speculators_v016.run import cli as cli_module
from speculators_v016.run.cli import _join_multi_value, cli
from speculators_v016.store import disk_forecast

REQUIRED = {
    "target_model_path": "--target-model-path",
    "train_data_path": "--train-data-path",
    "output_dir": "--output-dir",
}


def invoke(argv, env=None):
    """The command as main() runs it: upstream's multi-value --layer-ids joined first."""
    return CliRunner().invoke(cli, _join_multi_value(argv, "--layer-ids"), env=env or {})


def rule(flag: str, command: str | None) -> str:
    """The README's rule, written out independently of the code: SPECULATORS_DATA_GEN_[COMMAND_]OPTION."""
    name = flag.removeprefix("--")
    if command:
        name = f"{command}_{name}"
    return "SPECULATORS_DATA_GEN_" + name.upper().replace("-", "_")


def all_options():
    """(subcommand or None, option) for every option of the command and its subcommands."""
    for name, command in [(None, cli), *cli.commands.items()]:
        for param in command.params:
            if isinstance(param, click.Option):
                yield name, param


@pytest.fixture
def captured(monkeypatch, tmp_path):
    """The config a run of the main command receives, and the console it opens (nothing runs)."""
    seen = {}

    @contextlib.contextmanager
    def console(path, mode, level):
        seen["console"] = (mode, level)
        yield SimpleNamespace(
            echo=lambda *a, **k: None, where=lambda: None, failure=seen.setdefault("failure", []).append
        )

    def run_and_report(opts, _console):
        seen["config"] = opts
        return 0

    monkeypatch.setattr("speculators_v016.run.console.Console", console)
    monkeypatch.setattr("speculators_v016.run.run_report.run_and_report", run_and_report)
    monkeypatch.setattr(config, "visible_gpus", lambda: 1)
    return seen


def test_every_option_of_every_command_reads_the_variable_of_the_rule():
    """--format reads SPECULATORS_DATA_GEN_FORMAT (not _FMT), demo --dir SPECULATORS_DATA_GEN_DEMO_DIR (not _WHERE)."""
    checked = 0
    for command, param in all_options():
        if param.name in ("help", "version"):
            assert param.envvar is None, param.opts
            continue
        flag = max((o for o in param.opts if o.startswith("--")), key=len)
        assert param.envvar == rule(flag, command), (command, param.opts, param.envvar)
        checked += 1
    assert checked == len(cli_module.known_variables(cli)) > 40


def _sample_value(f, tmp_path):
    """A value for field ``f`` other than its default: (the variable's text, the value the config must hold)."""
    if f.meta["kind"] == "layer_ids":
        return "3,5", (3, 5)
    if f.meta["kind"] == "dir":
        return str(tmp_path / "env-out"), tmp_path / "env-out"
    if f.meta["kind"] == "json_object":
        return '{"kv_cache_dtype": "fp8", "enable_expert_parallel": true}', {
            "kv_cache_dtype": "fp8",
            "enable_expert_parallel": True,
        }
    if f.base is bool:
        return "1", not f.meta["negate"]
    if f.choices is not None:
        value = next(c for c in reversed(f.choices) if c != f.default)
        return value.lower() if not f.meta["case_sensitive"] else value, value
    if f.base is tuple:
        return "a.jsonl b.jsonl", ("a.jsonl", "b.jsonl")
    if f.base is int:
        return "3", 3
    if f.base is float:
        return "0.5", 0.5
    return "from-env", "from-env"


@pytest.mark.parametrize("field", [f for f in option_fields() if f.owner is not ConsoleConfig], ids=lambda f: f.flag)
def test_every_run_option_set_from_its_variable_reaches_the_config(field, captured, tmp_path):
    """Each option of the main command, given only through its variable, lands in its field of the run's config."""
    text, expected = _sample_value(field, tmp_path)
    argv = [a for name, flag in REQUIRED.items() if name != field.param for a in (flag, str(tmp_path / name))]
    if field.name == "shard_index":
        argv += ["--num-shards", "8"]
    if field.meta["section"] == config.REGENERATION and field.name != "regenerate":
        argv += ["--regenerate"]  # sampling options need it (a usage error otherwise: tested apart)
    result = invoke(argv, env={rule(field.flag, None): text})
    assert result.exit_code == 0, result.output
    got = captured["config"]
    owner = got.engine if field.owner is EngineConfig else got
    assert getattr(owner, field.name) == expected


CHECK_REQUIRED = {"target_model_path": "--target-model-path", "train_data_path": "--train-data-path"}


@pytest.mark.parametrize("field", option_fields(config.CHECK_OPTIONS), ids=lambda f: f.flag)
def test_every_check_option_set_from_its_variable_reaches_the_check_config(field, monkeypatch, captured, tmp_path):
    """Each option of check, given only through SPECULATORS_DATA_GEN_CHECK_<OPTION>, lands in its field."""
    seen = {}
    report = type("Report", (), {"ok": True, "lines": lambda self: []})()
    monkeypatch.setattr("speculators_v016.run.console.scratch_log_path", lambda name: tmp_path / name)
    monkeypatch.setattr("speculators_v016.run.check.check", lambda cfg: seen.setdefault("config", cfg) and report)
    text, expected = _sample_value(field, tmp_path)
    argv = [a for name, flag in CHECK_REQUIRED.items() if name != field.param for a in (flag, str(tmp_path / name))]
    result = invoke(["check", *argv], env={rule(field.flag, "check"): text})
    assert result.exit_code == 0, result.output
    got = seen["config"]
    owner = got.engine if field.owner is EngineConfig else got
    assert getattr(owner, field.name) == expected
    assert got.engine.max_model_len == got.seq_length + 1


@pytest.mark.parametrize(
    "variable, value, expected",
    [
        ("LOG_LEVEL", "debug", ("normal", "DEBUG")),
        ("VERBOSE", "1", ("verbose", "INFO")),
        ("QUIET", "1", ("quiet", "INFO")),
    ],
)
def test_terminal_options_from_their_variables(variable, value, expected, captured, tmp_path):
    """--log-level, --verbose and --quiet from the environment reach the console."""
    argv = [a for name, flag in REQUIRED.items() for a in (flag, str(tmp_path / name))]
    result = invoke(argv, env={f"SPECULATORS_DATA_GEN_{variable}": value})
    assert result.exit_code == 0, result.output
    assert captured["console"] == expected


def test_demo_options_from_their_variables(monkeypatch, captured, tmp_path):
    """demo --dir and --format are read from SPECULATORS_DATA_GEN_DEMO_DIR and _DEMO_FORMAT."""
    seen = {}
    monkeypatch.setattr("speculators_v016.run.console.log_path", lambda where, name: where / name)
    monkeypatch.setattr("speculators_v016.run.demo.run_demo", lambda where, fmt, console: seen.update(a=(where, fmt)))
    env = {"SPECULATORS_DATA_GEN_DEMO_DIR": str(tmp_path / "d"), "SPECULATORS_DATA_GEN_DEMO_FORMAT": "pt"}
    result = invoke(["demo"], env=env)
    assert result.exit_code == 0, result.output
    assert seen["a"] == (tmp_path / "d", "pt")


def test_format_pt_from_the_environment_with_fp8_is_refused(tmp_path):
    """SPECULATORS_DATA_GEN_FORMAT=pt with FP8 storage is the usage error --format pt gives, not a safetensors run."""
    argv = [a for name, flag in REQUIRED.items() for a in (flag, str(tmp_path / name))]
    env = {"SPECULATORS_DATA_GEN_FORMAT": "pt", "SPECULATORS_DATA_GEN_HIDDEN_STATES_DTYPE": "fp8_e4m3"}
    result = invoke(argv, env=env)
    assert result.exit_code == 2, result.output
    assert "Invalid value for --format: --hidden-states-dtype fp8_e4m3 is stored as safetensors only" in result.output
    assert not (tmp_path / "output_dir").exists()


@pytest.mark.parametrize(
    "variable, nearest, argv",
    [
        ("SPECULATORS_DATA_GEN_FMT", "SPECULATORS_DATA_GEN_FORMAT", None),
        ("SPECULATORS_DATA_GEN_DEMO_WHERE", "SPECULATORS_DATA_GEN_DEMO_DIR", None),
        ("SPECULATORS_DATA_GEN_OUTPUT_DIRR", "SPECULATORS_DATA_GEN_OUTPUT_DIR", ["verify", "."]),
    ],
)
def test_an_unknown_variable_is_a_usage_error_naming_the_nearest(variable, nearest, argv, tmp_path):
    """A SPECULATORS_DATA_GEN_* typo is exit 2 naming it and the nearest known variable, for any subcommand."""
    argv = argv or [a for name, flag in REQUIRED.items() for a in (flag, str(tmp_path / name))]
    result = invoke(argv, env={variable: "x"})
    assert result.exit_code == 2, result.output
    assert f"unknown environment variable {variable} (nearest: {nearest}" in result.output
    assert not (tmp_path / "output_dir").exists()


@pytest.mark.parametrize("prefix", [[], ["check"]])
def test_dtype_garbage_is_refused_before_the_dataset_is_read(prefix, tmp_path):
    """--dtype garbage: exit 2 naming the choices, though the dataset does not even exist."""
    argv = prefix + ["--target-model-path", "m", "--train-data-path", str(tmp_path / "none.jsonl")]
    argv += [] if prefix else ["--output-dir", str(tmp_path / "out")]
    result = invoke(argv + ["--dtype", "garbage"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--dtype': 'garbage' is not one of 'auto', 'bfloat16', 'float16'" in result.output


@pytest.mark.parametrize(
    "variable, argv",
    [("LAYER_IDS", None), ("CHECK_LAYER_IDS", ["check", "--target-model-path", "m", "--train-data-path", "d"])],
)
def test_an_empty_layer_ids_variable_is_refused_like_the_empty_option(variable, argv, tmp_path):
    """SPECULATORS_DATA_GEN_LAYER_IDS="" is the usage error --layer-ids "" is, never the default layers."""
    argv = argv or [a for name, flag in REQUIRED.items() for a in (flag, str(tmp_path / name))]
    result = invoke(argv, env={f"SPECULATORS_DATA_GEN_{variable}": ""})
    assert result.exit_code == 2 and "no layer id given" in result.output, result.output


def test_the_commands_have_one_option_per_field_and_every_field_a_doc():
    """A new option is one field: every command's options are exactly its fields, each documented."""
    specs = {
        None: config.MAIN_OPTIONS,
        "check": config.CHECK_OPTIONS,
        "verify": config.VERIFY_OPTIONS,
        "demo": config.DEMO_OPTIONS,
        "clean-shm": config.CLEAN_SHM_OPTIONS,
        "serve": config.SERVE_OPTIONS,
    }
    assert set(specs) == {None, *cli.commands}
    for name, spec in specs.items():
        command = cli.commands[name] if name else cli
        params = {p.name for p in command.params if isinstance(p, click.Option) and p.name not in ("help", "version")}
        assert params == {f.param for f in option_fields(spec)}, command.name
    classes = (
        EngineConfig,
        RunConfig,
        ConsoleConfig,
        CheckConfig,
        VerifyConfig,
        DemoConfig,
        CleanShmConfig,
        ServeConfig,
    )
    for cls in classes:
        undocumented = [f.name for f in config.fields_of(cls) if f.name != "engine" and not f.meta.get("help")]
        assert not undocumented, (cls.__name__, undocumented)


def test_the_run_config_derives_the_engine_values_once():
    """max_model_len = seq_length + 1 and the engine's seed come from the run's values, in RunConfig.build."""
    run = RunConfig.build(
        {"model": "m", "tensor_parallel_size": 1}, train_data_path=("d",), output_dir=Path("o"), seq_length=300, seed=7
    )
    assert (run.engine.max_model_len, run.engine.seed, run.num_shards, run.shard_index) == (301, 7, 1, 0)
    with pytest.raises(ConfigError, match="stored as safetensors only") as info:
        RunConfig.build(
            {"model": "m", "tensor_parallel_size": 1, "hidden_states_dtype": "fp8_e4m3"},
            train_data_path=("d",),
            output_dir=Path("o"),
            format="pt",
        )
    assert info.value.option == "--format"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"executor": "threads"}, "executor 'threads': choose from ('uni', 'mp', 'ray')"),
        ({"dtype": "garbage"}, "dtype 'garbage': choose from"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization 0.0: must be > 0"),
        ({"max_num_seqs": 0}, "max_num_seqs 0: must be >= 1"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size 0: must be >= 1"),
    ],
)
def test_the_engine_config_checks_choices_and_bounds(fields, message):
    """The generator's keywords are checked by the same field declarations as the options."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model="m", **fields)


@pytest.mark.parametrize(
    "given, needle",
    [
        ('{"dtype": "float16"}', "'dtype' is set by --dtype: give that option instead"),
        ('{"worker_extension_cls": "x.Y"}', "'worker_extension_cls' is set by the capture itself"),
        ('{"enable_prefix_caching": true}', "enable_prefix_caching=True is refused: a cached prefix is not computed"),
        ('{"pipeline_parallel_size": 2}', "'pipeline_parallel_size' is set by --pipeline-parallel-size"),
        ('{"speculative_config": {"method": "ngram"}}', "is refused: speculative decoding adds draft steps"),
        ('{"data_parallel_size": 2}', "data_parallel_size=2 is refused: a run drives one engine core"),
        (
            '{"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both", '
            '"kv_connector_extra_config": {"api_key": "s3cr3t"}}}',
            "kv_transfer_config={'kv_connector': 'ExampleConnector', 'kv_role': 'kv_both', "
            "'kv_connector_extra_config': {'api_key': '<redacted>'}} is refused: a KV connector loads keys and "
            "values computed elsewhere into the prompts",
        ),
        ('{"model_weights": "/w"}', "model_weights='/w' is refused: it points vLLM's sharded_state and"),
        ("kv_cache_dtype=fp8", "is not JSON"),
        ('["fp8"]', "is a JSON list"),
    ],
    ids=[
        "owned",
        "capture-owned",
        "prefix-caching",
        "pipeline",
        "speculative",
        "data-parallel",
        "kv-transfer",
        "model-weights",
        "not-json",
        "list",
    ],
)
def test_engine_args_that_cannot_be_given_are_usage_errors(captured, tmp_path, given, needle):
    """--engine-args: one of our options' keys, one that breaks the capture, not a JSON object: exit 2 naming it."""
    argv = [a for name, flag in REQUIRED.items() for a in (flag, str(tmp_path / name))]
    result = invoke([*argv, "--engine-args", given])
    assert result.exit_code == 2, result.output
    assert "--engine-args" in result.output and needle in result.output, result.output
    assert "config" not in captured and "s3cr3t" not in result.output


@pytest.mark.parametrize("allowed", [{"enable_prefix_caching": False}, {"data_parallel_size": 1}, {}])
def test_engine_args_keeping_the_capture_intact_are_taken(allowed):
    """The refused keys at the one value that keeps the capture exact pass through to the engine's config."""
    assert EngineConfig(model="m", extra_engine_args=allowed).extra_engine_args == allowed


def test_the_tokenizer_passed_to_vllm_is_the_one_the_dataset_is_tokenized_with():
    """--engine-args' tokenizer is the run's tokenizer too (ids the engine gets are ids of that tokenizer)."""
    assert EngineConfig(model="m").tokenizer == "m"
    assert EngineConfig(model="m", extra_engine_args={"tokenizer": "t"}).tokenizer == "t"


@pytest.mark.parametrize(("cores", "workers"), [(1, 4), (2, 4), (10, 5), (16, 8), (128, 8)])
def test_serve_write_workers_follow_the_cores(cores, workers):
    """serve's publishing threads default to half the cores, from 4 (a disk's worth) to 8."""
    assert config.default_write_workers(cores) == workers


@pytest.mark.parametrize(
    ("cores", "hidden", "fp8", "workers"),
    [(16, 7168, False, 12), (16, 4096, False, 8), (16, 7168, True, 7), (16, 4096, True, 4), (8, 7168, True, 6),
     (2, 7168, False, 4), (2, 512, False, 4), (64, 7168, False, 14), (64, 512, False, 4), (128, 7168, False, 14)],
)  # fmt: skip
def test_run_write_workers_follow_the_width_and_the_cores(cores, hidden, fp8, workers):
    """A run's writers: one per 4 KiB a stored token weighs (4 layers), from 4 to 3/4 of the cores and 16."""
    weight = disk_forecast.stored_token_bytes(4, hidden, 2, fp8)
    assert config.write_workers_for(cores, weight) == workers


def test_run_write_workers_stop_at_16_threads():
    """32 layers at hidden 7168 on 128 cores would ask for 112 writers: the threads' cap, 16, holds."""
    wide = disk_forecast.stored_token_bytes(32, 7168, 2, False)
    assert config.write_workers_for(128, wide) == config.MAX_WRITE_WORKERS == 16


def test_the_last_samples_get_more_threads_only_without_write_workers_given():
    """Once the engine is done the queued samples get up to 3/4 of the cores, but never past --write-workers given."""
    assert config.last_samples_threads(16, 8, given=False) == 4
    assert config.last_samples_threads(16, 12, given=False) == 0
    assert config.last_samples_threads(2, 4, given=False) == 0
    assert config.last_samples_threads(16, 1, given=True) == 0  # was 11: the GPU host's kill test saw 7 listed, not 2
    assert config.last_samples_threads(64, 4, given=True) == 0


@pytest.mark.parametrize(
    ("cores", "hidden", "fp8", "workers"),
    [(16, 7168, False, 12), (16, 4096, False, 8), (16, 7168, True, 7), (2, 7168, False, 4), (64, 7168, False, 14),
     (12, 7168, False, 9)],
)  # fmt: skip
def test_write_helpers_are_opt_in_and_lift_the_threads_cap(cores, hidden, fp8, workers):
    """With --write-helpers on the writers follow the width up to 3/4 of the cores; the default is the threads."""
    weight = disk_forecast.stored_token_bytes(4, hidden, 2, fp8)
    assert config.write_workers_for(cores, weight, helpers=True) == workers
    assert config.write_workers_for(cores, weight) == min(workers, config.MAX_WRITE_WORKERS)
    assert config.write_helpers_used("on") and not config.write_helpers_used("off")
    assert RunConfig(engine=EngineConfig(model="m"), train_data_path=("d",), output_dir="o").write_helpers == "off"


def test_write_helpers_auto_is_refused_naming_the_choices(tmp_path):
    """--write-helpers auto (it picked helpers where they lost, the H100 host 2026-12-05): exit 2 naming on, off."""
    argv = [a for name, flag in REQUIRED.items() for a in (flag, str(tmp_path / name))]
    result = invoke(argv + ["--write-helpers", "auto"])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--write-helpers': 'auto' is not one of 'on', 'off'" in result.output
    assert not (tmp_path / "output_dir").exists()


def test_run_write_workers_default_is_resolved_by_the_run():
    """--write-workers left out is None in the config (the run resolves it from the model), given is kept."""
    assert RunConfig(engine=EngineConfig(model="m"), train_data_path=("d",), output_dir="o").write_workers is None
    assert (
        RunConfig(engine=EngineConfig(model="m"), train_data_path=("d",), output_dir="o", write_workers=3).write_workers
        == 3
    )
