"""vLLM's engine arguments: every field classified, the model-changing ones named, secrets never written."""

import dataclasses

import pytest
from vllm.engine.arg_utils import EngineArgs

from speculators_v016.config import ENGINE_ARGS_OWNED, ENGINE_ARGS_REFUSED, EngineConfig
from speculators_v016.engine import arg_kinds
from speculators_v016.engine.engine_args import engine_args, vllm_defaults
from speculators_v016.redact import REDACTED, is_secret_name, redact, redact_text, without_secrets

TOKEN = "hf_" + "Zq9" * 12


def test_every_field_of_vllms_engine_args_is_classified_once():
    """Ours, refused, model-changing, secret, or a group of the rest: each EngineArgs field in exactly one."""
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    groups = {
        "owned": set(ENGINE_ARGS_OWNED),
        "refused": set(ENGINE_ARGS_REFUSED),
        "model-changing": set(arg_kinds.MODEL_CHANGING),
        "secrets": set(arg_kinds.SECRETS),
        **{why: set(names) for why, names in arg_kinds.NOT_CHANGING.items()},
    }
    everything = [name for names in groups.values() for name in names]
    assert sorted(fields - set(everything)) == [], "unclassified EngineArgs fields"
    assert sorted(set(everything) - fields) == [], "classified names that are no EngineArgs field"
    twice = sorted({n for n in everything if everything.count(n) > 1})
    assert twice == [], f"classified twice: {twice}"


@pytest.mark.parametrize(
    "given, named",
    [
        ({"hf_overrides": {"rope_theta": 1.0}}, {"hf_overrides": {"rope_theta": 1.0}}),
        ({"hf_config_path": "/c", "block_size": 32}, {"hf_config_path": "/c"}),
        ({"tokenizer": "/t", "enable_expert_parallel": True}, {"tokenizer": "/t"}),
        ({"kv_cache_dtype": "fp8", "attention_config": {"backend": "TRITON_ATTN"}}, {"kv_cache_dtype": "fp8"}),
        ({"quantization": "fp8", "revision": "abc"}, {"quantization": "fp8", "revision": "abc"}),
        ({"kv_cache_dtype": "auto", "load_format": "auto", "hf_token": TOKEN}, {}),  # vLLM's defaults: no change
        ({"model_loader_extra_config": {"secret": TOKEN}}, {"model_loader_extra_config": {"secret": REDACTED}}),
    ],
    ids=["hf-overrides", "config", "tokenizer", "kv-cache-dtype", "quantization-revision", "defaults", "redacted"],
)
def test_the_arguments_that_change_the_model_are_named(given, named):
    """What the first line, the summary, data_config.json and the headers name: those changing the model only."""
    assert arg_kinds.model_changing(given, vllm_defaults()) == named


def test_the_named_arguments_read_as_key_equals_json():
    """``key=value`` with compact JSON values, as the first line and the summary show them."""
    text = arg_kinds.describe({"hf_overrides": {"rope_theta": 1.0}, "tokenizer": "/t"})
    assert text == 'hf_overrides={"rope_theta": 1.0}, tokenizer="/t"'


@pytest.mark.parametrize(
    "name",
    ["hf_token", "api_key", "aws_secret_access_key", "password", "HF_TOKEN", "auth", "bearer", "sas-token"],
)
def test_secret_names(name):
    """Names ending in token, key, secret, password, ... hold secrets."""
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    ["tokenizer", "tokenizer_mode", "max_num_batched_tokens", "long_prefill_token_threshold", "keys", "kv_cache_dtype"],
)
def test_names_that_are_no_secret(name):
    """Names that mention tokens or keys without holding a credential are kept."""
    assert not is_secret_name(name)


def test_redaction_replaces_secret_values_and_token_shaped_strings():
    """Secret-named strings and token-shaped text anywhere become <redacted>; None, booleans and the rest stay."""
    given = {
        "hf_token": TOKEN,
        "tokenizer": "/t",
        "nested": {"api_key": "k", "other": [f"x {TOKEN} y"], "auth": None},
        "hf_token_flag": {"hf_token": True},
    }
    assert redact(given) == {
        "hf_token": REDACTED,
        "tokenizer": "/t",
        "nested": {"api_key": REDACTED, "other": [f"x {REDACTED} y"], "auth": None},
        "hf_token_flag": {"hf_token": True},
    }
    assert TOKEN not in repr(redact(given)) and redact_text(f"error {TOKEN}") == f"error {REDACTED}"
    assert without_secrets(given) == {"tokenizer": "/t", "nested": {"other": [f"x {TOKEN} y"]}, "hf_token_flag": {}}


def test_prefix_caching_off_as_documented_builds_vllms_arguments():
    """{"enable_prefix_caching": false}, the one value allowed, reaches EngineArgs once (no TypeError)."""
    args = engine_args(EngineConfig(model="m", extra_engine_args={"enable_prefix_caching": False}))
    assert args.enable_prefix_caching is False


def test_an_empty_speculative_config_is_none_and_vllm_gets_copies():
    """{"speculative_config": {}} means none (vLLM would build one from {}); the dicts vLLM gets are copies, so what
    it writes into them never reaches data_config.json."""
    overrides = {"rope_theta": 1.0}
    config = EngineConfig(model="m", extra_engine_args={"speculative_config": {}, "hf_overrides": overrides})
    args = engine_args(config)
    assert args.speculative_config is None
    assert args.hf_overrides == overrides and args.hf_overrides is not overrides
