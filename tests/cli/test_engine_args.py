"""vLLM's engine arguments through the real command (``--engine-args``): checked by vLLM before anything
is read, recorded with the run, and a resume with other ones refused."""

import json

import pytest

from helpers.cli import conversations, generate, invoke, write_jsonl
from speculators_v016.store.manifest import Manifest

ENGINE_STARTED = "Initializing a V1 LLM engine"
BLOCK_32 = json.dumps({"block_size": 32})


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("engine-args") / "chats.jsonl", conversations(4, seed=5))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model_dir, data_file):
    """A finished run given ``--engine-args '{"block_size": 32}'``."""
    out = tmp_path_factory.mktemp("engine-args-run") / "out"
    result = generate(model_dir, data_file, out, "--engine-args", BLOCK_32)
    assert result.exit_code == 0, result.output
    return out, result


def error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("error:") or "Error:" in line]


def test_a_run_with_engine_args_passes_and_records_them(finished):
    """The engine runs with the arguments given; data_config.json's fingerprint holds them."""
    out, result = finished
    assert "logit check: ok" in result.output and "verify:     ok" in result.output, result.output
    config = json.loads((out / "data_config.json").read_text())
    assert config["speculators_v016"]["fingerprint"]["generation"]["engine_args"] == {"block_size": 32}
    assert len(Manifest(out).entries()) == 4


@pytest.mark.parametrize("other", [json.dumps({"block_size": 16}), None], ids=["other-args", "no-args"])
def test_a_resume_with_other_engine_args_is_refused(finished, model_dir, data_file, other):
    """Resuming the folder with other engine arguments (or none): exit 4 naming the difference, nothing changed."""
    out, _ = finished
    before = sorted(p.name for p in out.iterdir())
    manifest = (out / "manifest.jsonl").read_bytes()
    result = generate(model_dir, data_file, out, *(["--engine-args", other] if other else []))
    assert result.exit_code == 4, result.output
    assert "generation.engine_args.block_size: 32 -> " in result.output, result.output
    assert ENGINE_STARTED not in result.output
    assert sorted(p.name for p in out.iterdir()) == before and (out / "manifest.jsonl").read_bytes() == manifest


def test_the_same_engine_args_resume(finished, model_dir, data_file):
    """The same arguments again: the finished run is a no-op that verifies."""
    out, _ = finished
    result = generate(model_dir, data_file, out, "--engine-args", BLOCK_32)
    assert result.exit_code == 0, result.output
    assert "(4 already done before this run)" in result.output, result.output


@pytest.mark.parametrize(
    "given, needle",
    [
        (
            '{"kv_cache_dtyp": "fp8"}',
            "'kv_cache_dtyp' is not one of vLLM's engine arguments (EngineArgs); did you mean",
        ),
        ('{"kv_cache_dtype": "fp9"}', '{"kv_cache_dtype": "fp9"}: vLLM refused it'),
    ],
    ids=["unknown-key", "bad-value"],
)
def test_bad_engine_args_are_a_usage_error_naming_them(tmp_path, model_dir, data_file, given, needle):
    """A key vLLM does not know, a value it refuses: exit 2 naming it, before the dataset or the engine (the keys
    refused without asking vLLM: tests/unit/test_cli_config.py)."""
    out = tmp_path / "out"
    result = generate(model_dir, data_file, out, "--engine-args", given)
    assert result.exit_code == 2, result.output
    assert "--engine-args" in result.output and needle in result.output, result.output
    assert ENGINE_STARTED not in result.output and "Traceback" not in result.output
    assert not (out / "manifest.jsonl").exists() and not (out / "data_config.json").exists()


def test_engine_args_from_the_environment_reach_serve_and_check(tmp_path, model_dir, data_file):
    """serve and check take --engine-args (and its variables) too: an unknown key is exit 2 naming it."""
    for command, variable in (("serve", "SERVE"), ("check", "CHECK")):
        args = [command, "--target-model-path", model_dir]
        args += ["--serve-dir", tmp_path / "serve"] if command == "serve" else ["--train-data-path", data_file]
        result = invoke(*args, env={f"SPECULATORS_DATA_GEN_{variable}_ENGINE_ARGS": '{"no_such_arg": 1}'})
        assert result.exit_code == 2, (command, result.output)
        assert "'no_such_arg' is not one of vLLM's engine arguments" in result.output, (command, result.output)
        assert ENGINE_STARTED not in result.output
