"""Which of vLLM 0.16's engine arguments change the model a run captures: every ``EngineArgs`` field, classified.

A run's states are those of the model vLLM builds and the token ids it is given. ``--engine-args`` can
change either while every check of ours still passes: the logit check and ``verify`` compare the run
with itself, so ``hf_overrides {"rope_theta": 1.0}`` or a ``tokenizer`` with two ids swapped give
consistent, wrong data. Such arguments are not refused (rope settings, a quantization, an FP8 KV cache
are what some users mean to run), but named: in the run's first line and summary, in ``data_config.json``
(``speculators_v016.model_changing_engine_args``) and in each safetensors file's header, where a trainer sees
them.

Every field of vLLM 0.16's ``EngineArgs`` is in exactly one of: ours (``config.ENGINE_ARGS_OWNED``),
refused (``config.ENGINE_ARGS_REFUSED``), :data:`MODEL_CHANGING`, :data:`SECRETS`, or a group of
:data:`NOT_CHANGING`; a unit test keeps it so, and a vLLM with new fields fails it until they are
classified. The line drawn: an argument that changes the function the model computes (its config, its
weights, the precision of its attention inputs) or the token ids is model-changing; one that changes
only which kernel computes the same function (rounding), how memory is laid out, how steps are
batched or placed, or what is logged, is not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from speculators_v016.redact import redact

#: Engine arguments that change the model's computation or its tokenization, with what each changes.
MODEL_CHANGING: dict[str, str] = {
    "hf_overrides": "the model's config as vLLM builds it (rope_theta, rope_scaling, ...)",
    "hf_config_path": "the model's config, read from another file",
    "config_format": "how the model's config is read",
    "revision": "another revision of the checkpoint",
    "code_revision": "another revision of the model's own code",
    "tokenizer": "another tokenizer: other token ids for the same text",
    "tokenizer_revision": "another revision of the tokenizer",
    "tokenizer_mode": "another tokenizer implementation",
    "quantization": "the weights quantized by another method",
    "load_format": "how the weights are read ('dummy': random weights)",
    "ignore_patterns": "which checkpoint files are read",
    "model_loader_extra_config": "the weight loader's own settings",
    "kv_cache_dtype": "keys and values kept in another precision: attention reads them rounded",
    "calculate_kv_scales": "the KV cache's scales computed, not read from the checkpoint",
    "override_attention_dtype": "attention computed in another dtype",
    "disable_sliding_window": "attention over the whole context where the model slides a window",
    "model_impl": "another implementation of the model",
    "mamba_cache_dtype": "recurrent states kept in another precision",
    "mamba_ssm_cache_dtype": "recurrent states kept in another precision",
    "runner": "the model run as another kind",
    "convert": "the model converted to another kind",
    "worker_cls": "another worker class runs the model",
    "logits_processors": "what the target generates (--regenerate)",
}

#: Engine arguments that hold credentials: never written, never logged, left out of the resume check.
SECRETS = frozenset({"hf_token"})

#: The other engine arguments, by why they leave a sample's contents as they are.
NOT_CHANGING: dict[str, frozenset[str]] = {
    "kernels, compilation and CUDA graphs: the same model, rounding may differ": frozenset(
        {
            "attention_backend",
            "attention_config",
            "kernel_config",
            "compilation_config",
            "optimization_level",
            "cudagraph_capture_sizes",
            "max_cudagraph_capture_size",
            "enable_flashinfer_autotune",
            "disable_cascade_attn",
            "disable_custom_all_reduce",
            "all2all_backend",
            "enable_dbo",
            "ubatch_size",
            "dbo_decode_token_threshold",
            "dbo_prefill_token_threshold",
        }
    ),
    "memory, KV cache size and offloading: the same values, kept elsewhere": frozenset(
        {
            "block_size",
            "swap_space",
            "cpu_offload_gb",
            "kv_cache_memory_bytes",
            "num_gpu_blocks_override",
            "kv_offloading_size",
            "kv_offloading_backend",
            "mamba_block_size",
            "mamba_cache_mode",
            "disable_hybrid_kv_cache_manager",
            "kv_sharing_fast_prefill",  # vLLM 0.16: "no prefill optimization takes place" yet
            "enable_sleep_mode",
            "prefix_caching_hash_algo",  # prefix caching is off
        }
    ),
    "scheduling and batching: which prompts share a step": frozenset(
        {
            "enable_chunked_prefill",
            "max_num_partial_prefills",
            "max_long_partial_prefills",
            "long_prefill_token_threshold",
            "scheduling_policy",
            "scheduler_cls",
            "stream_interval",
            "disable_chunked_mm_input",
        }
    ),
    "parallel layout, placement and start-up": frozenset(
        {
            "master_addr",
            "master_port",
            "nnodes",
            "node_rank",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
            "dcp_kv_cache_interleave_size",
            "cp_kv_cache_interleave_size",
            "data_parallel_rank",
            "data_parallel_start_rank",
            "data_parallel_size_local",
            "data_parallel_address",
            "data_parallel_rpc_port",
            "data_parallel_hybrid_lb",
            "data_parallel_external_lb",
            "data_parallel_backend",
            "disable_nccl_for_dp_synchronization",
            "enable_expert_parallel",
            "enable_eplb",
            "eplb_config",
            "expert_placement_strategy",
            "max_parallel_loading_workers",
            "ray_workers_use_nsight",
            "_api_process_count",
            "_api_process_rank",
        }
    ),
    "how the same files are fetched and read": frozenset(
        {"download_dir", "safetensors_load_strategy", "use_tqdm_on_load", "pt_load_map_location"}
    ),
    "multimodal inputs: a run's prompts are token ids": frozenset(
        {
            "enable_prompt_embeds",
            "allowed_local_media_path",
            "allowed_media_domains",
            "limit_mm_per_prompt",
            "enable_mm_embeds",
            "interleave_mm_strings",
            "media_io_kwargs",
            "mm_processor_kwargs",
            "mm_processor_cache_gb",
            "mm_processor_cache_type",
            "mm_shm_cache_max_object_size_mb",
            "mm_encoder_only",
            "mm_encoder_tp_mode",
            "mm_encoder_attn_backend",
            "io_processor_plugin",
            "skip_mm_profiling",
            "video_pruning_rate",
            "ec_transfer_config",
        }
    ),
    "LoRA adapters: no request of a run names one": frozenset(
        {
            "enable_lora",
            "max_loras",
            "max_lora_rank",
            "default_mm_loras",
            "fully_sharded_loras",
            "max_cpu_loras",
            "lora_dtype",
            "enable_tower_connector_lora",
            "specialize_active_lora",
        }
    ),
    "what requests may ask for, and outputs the capture does not read": frozenset(
        {
            "served_model_name",
            "skip_tokenizer_init",
            "max_logprobs",
            "logprobs_mode",
            "structured_outputs_config",
            "reasoning_parser",
            "reasoning_parser_plugin",
            "logits_processor_pattern",
            "generation_config",  # vLLM's default sampling; --regenerate reads generation_config.json itself
            "override_generation_config",
            "enable_return_routed_experts",
            "tokens_only",
            "pooler_config",
            "allow_deprecated_quantization",  # only lets a quantization be chosen; quantization is named
            "weight_transfer_config",  # weights sent by a trainer at run time: nothing sends any here
        }
    ),
    "logging, metrics, tracing and profiling": frozenset(
        {
            "disable_log_stats",
            "aggregate_engine_logging",
            "show_hidden_metrics_for_version",
            "otlp_traces_endpoint",
            "collect_detailed_traces",
            "kv_cache_metrics",
            "kv_cache_metrics_sample",
            "cudagraph_metrics",
            "enable_layerwise_nvtx_tracing",
            "enable_mfu_metrics",
            "enable_logging_iteration_details",
            "enable_mm_processor_stats",
            "profiler_config",
            "kv_events_config",
        }
    ),
}


def model_changing(extra: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The arguments of ``extra`` (``--engine-args``) that change the model, secrets redacted; one given at
    vLLM's own default (``defaults``: field name to default value) changes nothing and is left out."""
    defaults = defaults or {}
    return {
        key: redact(value)
        for key, value in extra.items()
        if key in MODEL_CHANGING and not (key in defaults and value == defaults[key])
    }


def describe(args: Mapping[str, Any]) -> str:
    """``key=value`` for each of ``args`` (values as compact JSON), joined by ``, ``."""
    return ", ".join(f"{k}={json.dumps(v, sort_keys=True, default=str)}" for k, v in args.items())
