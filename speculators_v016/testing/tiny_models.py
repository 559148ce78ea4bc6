"""Tiny random-weight causal LMs with a locally trained tokenizer.

No model hub is needed: the demo and the tests build a model of a real
architecture (random weights, fp32), train a byte-level BPE tokenizer on a
few sentences, give it a ChatML-style chat template, and save everything to
a folder that both transformers and vLLM load.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

#: architecture name -> (transformers config class name, extra config fields)
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # DeepSeek-V3 (and Kimi-K2's text model): dense first layer, then grouped noaux_tc MoE with a
    # shared expert; MLA with q LoRA. vLLM's CPU backend runs it with VLLM_MLA_DISABLE=1.
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": 96,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 32,
            "v_head_dim": 32,
            "moe_intermediate_size": 64,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            # Real checkpoints name both in config.json; transformers' class hard-codes them, vLLM reads
            # them (without scoring_func it routes with softmax; without topk_method it cannot load the bias).
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        },
    ),
    # DeepSeek-V3 with MLA's real geometry (vLLM's MLA kernels take only the latent size 576 = kv_lora_rank
    # 512 + qk_rope_head_dim 64; TRITON_MLA refuses others): 8 heads (one GPU's share of a TP-8 Kimi-K2),
    # 16 experts in 4 groups, 2 groups kept, top-4, a shared expert, a dense first layer, noaux_tc routing
    # with its correction bias. On CPU vLLM runs it with VLLM_MLA_DISABLE=1; on GPUs with TRITON_MLA.
    "deepseek_v3_mla": (
        "DeepseekV3Config",
        {
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "q_lora_rank": 128,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "moe_intermediate_size": 128,
            "n_routed_experts": 16,
            "n_shared_experts": 1,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1,
        },
    ),
    # Sandwich norms (extra norms after attention and MLP), embeddings scaled by sqrt(hidden).
    # (vLLM's Gemma-2 requires tied embeddings, as every released Gemma has.)
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 64,
            "hidden_act": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 64,
            "sliding_window_pattern": 2,
            "tie_word_embeddings": True,
        },
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        {
            "head_dim": 32,
            "moe_intermediate_size": 64,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "partial_rotary_factor": 0.5,
        },
    ),
    "phi3": ("Phi3Config", {"num_key_value_heads": 4, "pad_token_id": 0}),
    # Post-norm blocks without fused add-norm: each layer takes the residual stream as one tensor.
    "olmo2": ("Olmo2Config", {"num_key_value_heads": 4, "pad_token_id": 0}),
    "gpt_oss": (
        "GptOssConfig",
        {"head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64},
    ),
    # DeepSeek-V2-Lite-like: no q LoRA, greedy softmax routing over 2 shared + 8 routed experts.
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 32,
            "v_head_dim": 32,
            "moe_intermediate_size": 64,
            "n_routed_experts": 8,
            "n_shared_experts": 2,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": False,
        },
    ),
    # Parallel blocks (attention and MLP from one LayerNorm, added to the stream together); the
    # layers take a `residual` argument they do not add (Command-R). Cohere2 (Command-R7B / Command-A):
    # sliding-window layers with RoPE, every 4th layer global without it.
    "cohere": ("CohereConfig", {"tie_word_embeddings": True}),
    "cohere2": ("Cohere2Config", {"head_dim": 32, "sliding_window": 64, "tie_word_embeddings": True}),
    # GPT-NeoX / Pythia: parallel residual, decoder held as gpt_neox.layers + final_layer_norm.
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.25, "use_parallel_residual": True}),
    # Llama 4 text: chunked attention on RoPE layers (chunks of 128 tokens: vLLM needs a multiple of its
    # KV block size), no RoPE every 4th layer, qk norm. Dense layers only: vLLM 0.16's CPU MoE asserts on
    # Llama 4's router weight applied to the input (`assert not apply_router_weight_on_input`), so its
    # MoE layers (interleave_moe_layer_step=1 or 2 in real models) cannot run here. Attention temperature
    # tuning off: vLLM decides it from generation_config.json (default: on above 32K context), not from
    # config.json as transformers does, so at this context length the two would differ.
    "llama4": (
        "Llama4TextConfig",
        {
            "head_dim": 32,
            "intermediate_size": 64,
            "intermediate_size_mlp": 256,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 8,
            "attention_chunk_size": 128,
            "attn_temperature_tuning": False,
            "use_qk_norm": True,
            "rope_scaling": None,
        },
    ),
    # Hybrid: three gated-delta-net (linear attention) layers per full-attention layer, MoE MLPs.
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            "head_dim": 32,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "partial_rotary_factor": 0.5,
        },
    ),
    # MiniMax-Text-01: lightning (linear) attention layers and softmax attention layers, MoE MLPs.
    "minimax": ("MiniMaxConfig", {"head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 16}),
    # EXAONE 4: post-norm blocks (norms after attention and MLP, added to the stream); a layer returns the
    # stream and an intermediate, and the final norm takes the stream alone. Sliding-window and global layers.
    "exaone4": ("Exaone4Config", {"head_dim": 32, "sliding_window": 64, "sliding_window_pattern": 2}),
    # ERNIE 4.5 MoE: dense first layer, then MoE with shared experts.
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        {
            "moe_intermediate_size": 64,
            "moe_k": 2,
            "moe_num_experts": 4,
            "moe_num_shared_experts": 1,
            "moe_layer_start_index": 1,
            "tie_word_embeddings": False,
        },
    ),
}

#: Parameters left at zero, per architecture, where vLLM's CPU backend ignores them (so that a tiny
#: model compares vLLM with transformers on what vLLM computes): ERNIE 4.5's expert-score correction
#: bias, which vLLM 0.16's CPU MoE routing drops for non-grouped top-k (cpu_fused_moe.select_experts;
#: vLLM's GPU routing applies it).
_ZERO = {"ernie4_5_moe": ("e_score_correction_bias",)}

DEFAULT_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts several tokens and the target model verifies them",
    "hidden states of a few layers are saved for every token of every conversation",
    "user assistant system: how do I sort a list in python? use sorted(items).",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \"",
]


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer (transformers' fast tokenizer) trained on ``corpus``."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(list(corpus), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out: str | Path,
    arch: str = "llama",
    *,
    num_layers: int = 8,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    vocab_size: int = 512,
    dtype: str = "float32",
    model_vocab_size: int | None = None,
    **overrides,
) -> Path:
    """Save a tiny random ``arch`` model and its tokenizer to ``out``; return the path.

    ``dtype``: the checkpoint's (``bfloat16``: weights stored and declared bf16, as released models are).
    ``model_vocab_size``: the model's vocabulary where it must be larger than the tokenizer's (benchmarks
    with a target's embedding and lm_head sizes; their prompts are token ids).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCHITECTURES)}")
    out = Path(out)
    config_cls, extra = ARCHITECTURES[arch]
    tokenizer = train_tokenizer(corpus or DEFAULT_CORPUS, vocab_size)
    vocab = max(model_vocab_size or 0, len(tokenizer))
    fields = {**_COMMON, **extra, "vocab_size": vocab, "num_hidden_layers": num_layers, **overrides}
    config = getattr(transformers, config_cls)(**fields)
    config.dtype = torch.float32  # saved as the checkpoint's dtype
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is tiny in scale; widen it so layers differ visibly
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
        for name, buffer in model.named_buffers():  # routing that a zero bias would not exercise
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
        for name, param in model.named_parameters():
            if name.endswith(_ZERO.get(arch, ())):
                param.zero_()
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
        model.config.dtype = getattr(torch, dtype)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def zero_embedding_rows(model_dir: str | Path, token_ids: Iterable[int]) -> None:
    """Set the input embedding rows of ``token_ids`` to zero in a tiny model's checkpoint (as real checkpoints
    have for padding and reserved tokens)."""
    path = Path(model_dir) / "model.safetensors"
    tensors = load_file(path)
    (name,) = [n for n in tensors if n.endswith("embed_tokens.weight")]
    tensors[name][list(token_ids)] = 0
    save_file(tensors, path, metadata={"format": "pt"})
