"""vLLM's engine arguments for a capture engine: our settings field by field, the user's own passed through.

A user's ``--engine-args`` (``EngineConfig.extra_engine_args``) reach vLLM's ``EngineArgs`` as given,
after :func:`speculators_v016.config.refuse_engine_args` refused those an option of ours sets and
those that would break the capture. Whether vLLM knows a key, and takes its value, is vLLM's to say:
:func:`vllm_config` builds vLLM's whole config (no weights are read) and blames the passed-through
arguments, by name, for a failure only they cause. :func:`check_engine_args` runs it before a run
reads its dataset, so a wrong key or value, or a ``--seq-length`` past the model's context, costs seconds,
not a preprocessing pass and a model load.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os

from speculators_v016.config import ConfigError, EngineConfig
from speculators_v016.engine import worker_env
from speculators_v016.engine.context_length import context_length_error
from speculators_v016.engine.cpu_attention import attention_overrides
from speculators_v016.protocol import CaptureConfig
from speculators_v016.redact import redact

#: Passed-through arguments at the one value the capture allows that say what vLLM does without them: left
#: out of vLLM's arguments (``enable_prefix_caching`` is ours to give; vLLM reads ``{}`` as a speculative config).
_SAME_AS_ABSENT = {"enable_prefix_caching": False, "speculative_config": {}}

#: The model's shape: vLLM's config (after ``hf_overrides``, ``hf_config_path``, ...) must keep the checkpoint's.
SHAPE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
)

#: The worker extension every worker of a capture engine carries.
EXTENSION = "speculators_v016.worker.capture.CaptureWorkerExtension"
OPTION = "--engine-args"


def _unknown_keys(extra: dict, engine_args_class) -> None:
    """ConfigError naming a key that is no field of vLLM's ``EngineArgs`` (with the nearest ones)."""
    fields = {f.name for f in dataclasses.fields(engine_args_class)}
    for key in extra:
        if key not in fields:
            near = difflib.get_close_matches(key, sorted(fields), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise ConfigError(f"{key!r} is not one of vLLM's engine arguments (EngineArgs){hint}", OPTION)


def engine_args(config: EngineConfig, capture: CaptureConfig | None = None):
    """vLLM's ``EngineArgs`` of an engine of ``config`` (with ``capture`` in its config and so in its hash:
    compiled graphs cached on disk without these capture ids are never reused for this engine)."""
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415 - vLLM only when an engine starts

    # a copy: vLLM writes into the dicts it is given (a speculative config gets the target's ModelConfig)
    extra = {
        k: copy.deepcopy(v)
        for k, v in config.extra_engine_args.items()
        if not (k in _SAME_AS_ABSENT and v == _SAME_AS_ABSENT[k] and type(v) is type(_SAME_AS_ABSENT[k]))
    }
    _unknown_keys(extra, EngineArgs)
    return EngineArgs(
        model=config.model,
        dtype=config.dtype,
        seed=config.seed,
        max_model_len=config.max_model_len,
        max_num_batched_tokens=config.batched_tokens,
        max_num_seqs=config.max_num_seqs,
        tensor_parallel_size=config.tensor_parallel_size,
        pipeline_parallel_size=config.pipeline_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enforce_eager=config.enforce_eager,
        trust_remote_code=config.trust_remote_code,
        distributed_executor_backend=config.executor,
        enable_prefix_caching=False,  # a cached prefix is not recomputed: no states for it
        worker_extension_cls=EXTENSION,
        additional_config={"speculators_v016": capture.as_dict()} if capture is not None else {},
        **attention_overrides(config.dtype, extra),
        **extra,
    )


def vllm_config(config: EngineConfig, capture: CaptureConfig | None = None):
    """vLLM's ``VllmConfig`` for ``config``; a failure the passed-through arguments alone cause is a
    ConfigError naming them (the same config without them is built to tell)."""
    try:
        return engine_args(config, capture).create_engine_config()
    except ConfigError:
        raise
    except Exception as exc:
        too_long = context_length_error(exc)
        if too_long is not None:
            raise too_long from None
        if config.extra_engine_args and _builds_without_extra(config):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            given = json.dumps(redact(config.extra_engine_args))
            raise ConfigError(f"{given}: vLLM refused it ({type(exc).__name__}: {redact(first)})", OPTION) from exc
        raise


def _builds_without_extra(config: EngineConfig) -> bool:
    try:
        engine_args(dataclasses.replace(config, extra_engine_args={})).create_engine_config()
    except Exception:  # noqa: BLE001 - only whether it builds matters here
        return False
    return True


def vllm_defaults() -> dict:
    """vLLM's ``EngineArgs`` defaults, by field (those with a plain default)."""
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415 - vLLM only when an engine is asked about

    return {f.name: f.default for f in dataclasses.fields(EngineArgs) if f.default is not dataclasses.MISSING}


def check_engine_args(config: EngineConfig):
    """Before anything else of a run: vLLM builds the engine's config from our settings and the passed-through
    arguments (ConfigError naming them if it cannot; ContextLengthError for a ``--seq-length`` the model's
    context cannot hold), so neither costs a pass over the dataset first; the model the arguments make has the
    checkpoint's shape, and the variables vLLM's workers read are usable. No weights are read. Returns vLLM's
    config (the model's width and dtype, as the engine will have them)."""
    built = vllm_config(config)
    text = built.model_config.hf_text_config
    if config.extra_engine_args:
        check_shape(config, text)
    worker_env.check(
        os.environ,
        cpu=built.device_config.device_type == "cpu",
        workers=built.parallel_config.world_size,
        stages=built.parallel_config.pipeline_parallel_size,
        num_layers=text.num_hidden_layers,
    )
    return built


def _checkpoint_config(config: EngineConfig):
    from transformers import AutoConfig  # noqa: PLC0415 - slow to import; only where a check needs the config

    loaded = AutoConfig.from_pretrained(config.model, trust_remote_code=config.trust_remote_code)
    return loaded.get_text_config()


def check_shape(config: EngineConfig, built) -> None:
    """ConfigError where the model vLLM builds (``built``: its text config, after the passed-through arguments)
    differs in shape from the checkpoint's config: its weights would not load (vLLM fails on a missing tensor),
    and the layer ids, the token checks and ``verify`` read the checkpoint's config."""
    own = _checkpoint_config(config)
    for name in SHAPE_FIELDS:
        theirs, ours = getattr(built, name, None), getattr(own, name, None)
        if theirs is None or ours is None or theirs == ours:
            continue
        overrides = config.extra_engine_args.get("hf_overrides")
        blamed = (
            "hf_overrides"
            if isinstance(overrides, dict) and name in overrides
            else " and ".join(
                k for k in ("hf_config_path", "config_format", "revision") if k in config.extra_engine_args
            )
            or "the engine arguments"
        )
        raise ConfigError(
            f"{blamed} gives {name} {theirs}, the checkpoint's config {ours}: vLLM would build a model of another "
            f"shape than {config.model}'s weights, and the layer ids, the token checks and verify read the "
            "checkpoint's config; an argument that changes the model's shape is refused",
            OPTION,
        )
