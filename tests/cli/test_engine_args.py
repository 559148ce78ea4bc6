"""vLLM's engine arguments through the real command (``--engine-args``): checked by vLLM before anything
is read, recorded with the run, and a resume with other ones refused; those that change the model named
everywhere, secrets nowhere, the target's weights fingerprinted."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers.cli import conversations, generate, invoke, load_all, write_jsonl
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import read_header_metadata
from speculators_v016.testing.tiny_models import build_tiny_model

ENGINE_STARTED = "Initializing a V1 LLM engine"
BLOCK_32 = json.dumps({"block_size": 32})
TOKEN = "hf_" + "Kx7" * 12  # shaped like a Hugging Face token
#: a model-changing argument, the documented no-op values of two refused keys, and a secret
CHANGED = {
    "hf_overrides": {"rope_theta": 1.0},
    "enable_prefix_caching": False,
    "speculative_config": {},
    "hf_token": TOKEN,
}
NAMED = 'hf_overrides={"rope_theta": 1.0}'


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


@pytest.fixture(scope="module")
def changed(tmp_path_factory, model_dir, data_file):
    """A finished run on a copy of the target given ``CHANGED``: (model copy, output folder, result)."""
    root = tmp_path_factory.mktemp("engine-args-changed")
    model = Path(shutil.copytree(model_dir, root / "model"))
    out = root / "out"
    return model, out, generate(model, data_file, out, "--engine-args", json.dumps(CHANGED))


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
        (
            json.dumps({"hf_token": TOKEN, "kv_cache_dtype": "fp9"}),
            '{"hf_token": "<redacted>", "kv_cache_dtype": "fp9"}: vLLM refused it',
        ),
        (
            '{"hf_overrides": {"num_hidden_layers": 4}}',
            "hf_overrides gives num_hidden_layers 4, the checkpoint's config 8: vLLM would build a model of another "
            "shape than",
        ),
        (
            '{"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}}',
            "kv_transfer_config={'kv_connector': 'ExampleConnector', 'kv_role': 'kv_both'} is refused: a KV "
            "connector loads keys and values computed elsewhere into the prompts",
        ),
        (
            '{"model_weights": "/elsewhere"}',
            "model_weights='/elsewhere' is refused: it points vLLM's sharded_state and runai_streamer loaders at "
            "other weights than --target-model-path",
        ),
    ],
    ids=["unknown-key", "bad-value", "bad-value-with-token", "fewer-layers", "kv-transfer", "model-weights"],
)
def test_bad_engine_args_are_a_usage_error_naming_them(tmp_path, model_dir, data_file, given, needle):
    """A key vLLM does not know, a value it refuses, a shape other than the checkpoint's, a KV connector, weights
    from elsewhere: exit 2 naming it, before the dataset or the engine, no token shown or logged (the keys refused
    without asking vLLM: tests/unit/test_cli_config.py)."""
    out = tmp_path / "out"
    result = generate(model_dir, data_file, out, "--engine-args", given)
    assert result.exit_code == 2, result.output
    assert "--engine-args" in result.output and needle in result.output, result.output
    assert ENGINE_STARTED not in result.output and "Traceback" not in result.output
    assert not (out / "manifest.jsonl").exists() and not (out / "data_config.json").exists()
    assert TOKEN not in result.output
    assert all(TOKEN.encode() not in p.read_bytes() for p in out.rglob("*") if p.is_file())


def test_engine_args_that_change_the_model_are_named_everywhere(changed, finished):
    """hf_overrides: named in the first line, the summary, data_config.json and each file's header; the documented
    enable_prefix_caching false and an empty speculative_config run; the states are the changed model's."""
    model, out, result = changed
    assert result.exit_code == 0, result.output
    first = next(line for line in result.output.splitlines() if line.startswith(f"{model}: layers"))
    assert first.endswith(f"max_num_batched_tokens 8192; MODEL CHANGED by --engine-args {NAMED}; 4 samples to write")
    assert f"model args: {NAMED} (--engine-args that change the model's computation or tokenization" in result.output
    assert "logit check: ok" in result.output and "verify:     ok" in result.output  # they cannot see it: named
    config = json.loads((out / "data_config.json").read_text())["speculators_v016"]
    assert config["model_changing_engine_args"] == {"hf_overrides": {"rope_theta": 1.0}}
    assert config["fingerprint"]["generation"]["engine_args"]["enable_prefix_caching"] is False
    for entry in Manifest(out).entries().values():
        header = read_header_metadata(out / entry.file)
        assert header["model_changing_engine_args"] == '{"hf_overrides":{"rope_theta":1.0}}'
    ours, plain = load_all(out), load_all(finished[0])
    assert all(torch.equal(ours[i]["input_ids"], plain[i]["input_ids"]) for i in plain)
    assert max((ours[i]["hidden_states"][-1] - plain[i]["hidden_states"][-1]).abs().max().item() for i in plain) > 0.1


def test_a_token_is_written_nowhere(changed):
    """hf_token: not in any file of the output folder (the log included) nor on the terminal; said to be given."""
    _, out, result = changed
    assert result.exit_code == 0, result.output
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.parent.name == "logs" and p.stat().st_size > 0 for p in files)
    assert [p for p in files if TOKEN.encode() in p.read_bytes()] == []
    assert TOKEN not in result.output
    config = json.loads((out / "data_config.json").read_text())["speculators_v016"]
    assert config["fingerprint"]["generation"]["engine_args"]["hf_token"] == "<redacted>"


def test_a_checkpoint_replaced_in_place_is_refused_on_resume(changed, data_file, tmp_path):
    """The target's weights replaced by another model's of the same names and sizes: the resume is exit 4 naming
    the weight file, before the engine starts; the folder is as it was. (Last of the tests using ``changed``.)"""
    model, out, _ = changed
    other = build_tiny_model(tmp_path / "other", "llama", seed=1) / "model.safetensors"
    weights = model / "model.safetensors"
    assert other.stat().st_size == weights.stat().st_size and other.read_bytes() != weights.read_bytes()
    kept = sorted(out.glob("data_*")) + [out / "manifest.jsonl"]  # the samples, their manifest and config
    before = {p: p.read_bytes() for p in kept}
    shutil.copyfile(other, weights)
    result = generate(model, data_file, out, "--engine-args", json.dumps(CHANGED))
    assert result.exit_code == 4, result.output
    assert re.search(
        r"Differs:\n  model\.weight_digests\.model\.safetensors: 'sampled-sha256-v1:[0-9a-f]{64}' -> "
        r"'sampled-sha256-v1:[0-9a-f]{64}'\n\(the target's weight files hold other contents than when the folder's "
        r"samples were made: the checkpoint was replaced in place \(same names and sizes, other weights\)\)",
        result.output,
    ), result.output
    assert ENGINE_STARTED not in result.output
    assert {p: p.read_bytes() for p in kept} == before and len(before) == 6


def test_engine_args_from_the_environment_reach_serve_and_check(tmp_path, model_dir, data_file):
    """serve and check take --engine-args (and its variables) too: an unknown key is exit 2 naming it."""
    for command, variable in (("serve", "SERVE"), ("check", "CHECK")):
        args = [command, "--target-model-path", model_dir]
        args += ["--serve-dir", tmp_path / "serve"] if command == "serve" else ["--train-data-path", data_file]
        result = invoke(*args, env={f"SPECULATORS_DATA_GEN_{variable}_ENGINE_ARGS": '{"no_such_arg": 1}'})
        assert result.exit_code == 2, (command, result.output)
        assert "'no_such_arg' is not one of vLLM's engine arguments" in result.output, (command, result.output)
        assert ENGINE_STARTED not in result.output
