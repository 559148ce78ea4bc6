"""A slice of Kimi-K2.5's text model at its real width, random weights, routed experts in its INT4 format.

Kimi-K2.5's text model is DeepSeek-V3's architecture (``DeepseekV3ForCausalLM`` in vLLM 0.16; the
release wraps it as ``KimiK25ForConditionalGeneration`` with a vision tower): hidden 7168, 64 heads
of MLA (q LoRA 1536, kv LoRA 512, rope 64, nope 128, v 128), a dense first layer (MLP 18432), then
MoE layers of 384 routed experts (8 a token, one group, sigmoid scores with a correction bias,
``noaux_tc``, renormalized, times 2.827) and one shared expert (2048), vocabulary 163,840, YaRN
rope. :func:`build_kimi_slice` writes its first ``num_layers`` layers (:data:`KIMI_K25_TEXT`; the rope
is Kimi-K2's YaRN x32 over 4096 positions) as a checkpoint vLLM loads:

* the routed experts in Kimi-K2.5's own ``pack-quantized`` W4A16 format, group 32
  (:mod:`~speculators_v016.testing.tiny_quant` describes it), written straight from random codes
  and random bf16 scales: no bf16 master (that would be ~40 GB a layer), ~9.5 GB of codes and
  scales a MoE layer;
* everything else random bf16 (the router's correction bias float32, as Kimi ships it), at scales
  that keep the residual stream near unit size through the layers: each projection's weights have
  standard deviation ``1/sqrt(fan_in)``, every norm's weight is 1, the experts' codes times scales
  have the same spread (uniform codes in [-8, 7], scales uniform in [0.5, 1.5] times a base);
* safetensors shards (the embeddings, one per layer, the final norm with ``lm_head``), each tensor
  generated on ``device`` (a GPU where there is one) and streamed to its file as it is made, a
  ``model.safetensors.index.json``, ``config.json`` (with ``quantization_config``),
  ``generation_config.json`` and the tiny models' tokenizer. Its vocabulary (512) is smaller than
  the model's: prompts are token ids below either (vLLM takes a model vocabulary larger than its
  tokenizer's, as the benchmark models of ``tools/benchmarks/gpu_generator.py`` have).

Files are written under a temporary name and renamed once complete; ``config.json`` and the index
come last, so an interrupted build never leaves a folder that looks like a model. The same code
builds a tiny slice (:data:`TINY`: small dimensions) for CPU tests. :func:`first_layer_reference`
computes the dense first layer's output in float32 with transformers from the checkpoint's own
tensors (the one layer that needs no experts). This module is a test kit: no run imports it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from speculators_v016.testing.tiny_models import DEFAULT_CORPUS, train_tokenizer
from speculators_v016.testing.tiny_quant import INT4_PER_WORD, w4a16_config

#: Kimi-K2.5's text model (its ``text_config``), as DeepSeek-V3 fields. The rope is Kimi-K2's YaRN (factor 32
#: over 4096 positions, theta 50000; Kimi-K2-Thinking and K2.5 publish factor 64 over the same 4096, a longer
#: context through the same code path).
KIMI_K25_TEXT = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=384,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    hidden_act="silu",
    vocab_size=163840,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    max_position_embeddings=131072,
    rope_scaling={
        "type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    attention_bias=False,
    tie_word_embeddings=False,
)
#: The same architecture at tiny width (CPU tests): MLA's real latent (512 + 64) kept, everything else small.
TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=96,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    vocab_size=1024,
)
GROUP_SIZE = 32
#: safetensors' names of the dtypes written here
DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32"}
#: Rows of a large tensor generated at a time (bounds the generator's memory: ~235 MB of float32 at width 7168).
CHUNK_ELEMENTS = 1 << 26
#: uniform codes in [-8, 7]: root mean square of a code (sqrt(344 / 16)); scales uniform in [0.5, 1.5] (sqrt(13/12))
CODE_RMS, SCALE_RMS = math.sqrt(21.5), math.sqrt(13 / 12)


@dataclass(frozen=True)
class Spec:
    """One tensor of the checkpoint and how to fill it: ``normal`` (std ``value``), ``ones``, ``codes`` (packed
    uniform int4), ``scales`` (uniform in [0.5, 1.5] times ``value``), ``shape`` (the int32 weight shape ``value``),
    ``bias`` (float32 normal, std ``value``)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: str
    value: float | tuple[int, int] = 0.0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _linear(name: str, out: int, inp: int, scale: float = 1.0) -> Spec:
    return Spec(f"{name}.weight", (out, inp), torch.bfloat16, "normal", scale / math.sqrt(inp))


def _norm(name: str, size: int) -> Spec:
    return Spec(f"{name}.weight", (size,), torch.bfloat16, "ones")


def _experts(prefix: str, experts: int, hidden: int, inter: int) -> list[Spec]:
    """Every routed expert's gate, up and down projections in ``pack-quantized`` W4A16 (codes, scales, shape)."""
    specs = []
    for e in range(experts):
        for proj, out, inp in (("gate_proj", inter, hidden), ("up_proj", inter, hidden), ("down_proj", hidden, inter)):
            name = f"{prefix}.experts.{e}.{proj}"
            base = 1 / math.sqrt(inp) / (CODE_RMS * SCALE_RMS)  # the weight's std 1/sqrt(fan_in), as a dense one
            specs += [
                Spec(f"{name}.weight_packed", (out, inp // INT4_PER_WORD), torch.int32, "codes"),
                Spec(f"{name}.weight_scale", (out, inp // GROUP_SIZE), torch.bfloat16, "scales", base),
                Spec(f"{name}.weight_shape", (2,), torch.int32, "shape", (out, inp)),
            ]
    return specs


def layer_specs(c: dict, i: int) -> list[Spec]:
    """Decoder layer ``i``'s tensors (names as DeepSeek-V3 checkpoints have them)."""
    p, h = f"model.layers.{i}", c["hidden_size"]
    heads, nope, rope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    specs = [
        _norm(f"{p}.input_layernorm", h),
        _linear(f"{p}.self_attn.q_a_proj", c["q_lora_rank"], h),
        _norm(f"{p}.self_attn.q_a_layernorm", c["q_lora_rank"]),
        _linear(f"{p}.self_attn.q_b_proj", heads * (nope + rope), c["q_lora_rank"]),
        _linear(f"{p}.self_attn.kv_a_proj_with_mqa", c["kv_lora_rank"] + rope, h),
        _norm(f"{p}.self_attn.kv_a_layernorm", c["kv_lora_rank"]),
        _linear(f"{p}.self_attn.kv_b_proj", heads * (nope + v), c["kv_lora_rank"]),
        _linear(f"{p}.self_attn.o_proj", h, heads * v),
        _norm(f"{p}.post_attention_layernorm", h),
    ]
    if i < c["first_k_dense_replace"]:
        inter = c["intermediate_size"]
        return specs + [
            _linear(f"{p}.mlp.gate_proj", inter, h),
            _linear(f"{p}.mlp.up_proj", inter, h),
            _linear(f"{p}.mlp.down_proj", h, inter),
        ]
    inter, shared = c["moe_intermediate_size"], c["moe_intermediate_size"] * c["n_shared_experts"]
    return specs + [
        _linear(f"{p}.mlp.gate", c["n_routed_experts"], h),
        Spec(f"{p}.mlp.gate.e_score_correction_bias", (c["n_routed_experts"],), torch.float32, "bias", 0.1),
        *_experts(f"{p}.mlp", c["n_routed_experts"], h, inter),
        _linear(f"{p}.mlp.shared_experts.gate_proj", shared, h),
        _linear(f"{p}.mlp.shared_experts.up_proj", shared, h),
        _linear(f"{p}.mlp.shared_experts.down_proj", h, shared),
    ]


def shard_plan(c: dict) -> list[tuple[str, list[Spec]]]:
    """``(file name, its tensors)``: the embeddings, one shard per decoder layer, the final norm and ``lm_head``."""
    n = c["num_hidden_layers"]
    groups = [
        [Spec("model.embed_tokens.weight", (c["vocab_size"], c["hidden_size"]), torch.bfloat16, "normal", 1.0)],
        *(layer_specs(c, i) for i in range(n)),
        [_norm("model.norm", c["hidden_size"]), _linear("lm_head", c["vocab_size"], c["hidden_size"])],
    ]
    return [(f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors", specs) for k, specs in enumerate(groups)]


def slice_config(num_layers: int, **overrides) -> dict:
    """``config.json`` of the slice: :data:`KIMI_K25_TEXT` (with ``overrides``) as a DeepSeek-V3 config, bf16,
    Kimi-K2.5's ``quantization_config``, the tokenizer's special ids."""
    import transformers  # noqa: PLC0415 - transformers only where a checkpoint is built

    fields = {**KIMI_K25_TEXT, **overrides, "num_hidden_layers": num_layers, "bos_token_id": 1, "eos_token_id": 2}
    for dim in ("hidden_size", "moe_intermediate_size"):
        if fields[dim] % GROUP_SIZE:
            raise ValueError(f"{dim} {fields[dim]}: the experts' groups of {GROUP_SIZE} need a multiple of it")
    if not 0 < fields["first_k_dense_replace"] < num_layers:
        raise ValueError(f"num_layers {num_layers}: a slice holds the dense first layer and at least one MoE layer")
    # every field written out (also those equal to transformers' defaults), transformers' normal form where it has one
    config = {**fields, **transformers.DeepseekV3Config(**fields).to_diff_dict()}
    config.update(
        architectures=["DeepseekV3ForCausalLM"], dtype="bfloat16", quantization_config=w4a16_config(GROUP_SIZE)
    )
    config.pop("torch_dtype", None)
    return config


class StreamingSafetensors:
    """A safetensors file written tensor by tensor, in the order of its specs, each in as many pieces as it takes.

    The header (every name, dtype, shape and byte range) goes first; the data follows in order. The file
    is written as ``NAME.partial`` and renamed by :meth:`close` once every byte is there (a process that
    dies midway leaves no file under the final name).
    """

    def __init__(self, path: Path, specs: list[Spec]):
        self.path, self.specs = Path(path), specs
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for s in specs:
            header[s.name] = {
                "dtype": DTYPES[s.dtype],
                "shape": list(s.shape),
                "data_offsets": [offset, offset + s.nbytes],
            }
            offset += s.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        self.total = 8 + len(text) + offset
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.fh = open(self.partial, "xb")  # noqa: SIM115 - closed by close()
        self.fh.write(struct.pack("<Q", len(text)) + text)
        self.index, self.left = 0, specs[0].nbytes if specs else 0

    def write(self, piece: torch.Tensor) -> None:
        """The next bytes of the current tensor (a contiguous piece in its dtype)."""
        spec = self.specs[self.index]
        if piece.dtype != spec.dtype:
            raise TypeError(f"{spec.name}: a {piece.dtype} piece for a {spec.dtype} tensor")
        data = piece.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes > self.left:
            raise ValueError(f"{spec.name}: {data.nbytes} bytes written where {self.left} were left")
        self.fh.write(memoryview(data))
        self.left -= data.nbytes
        while self.left == 0 and self.index < len(self.specs) - 1:
            self.index += 1
            self.left = self.specs[self.index].nbytes

    def close(self) -> None:
        if self.left or self.index != len(self.specs) - 1:
            raise ValueError(f"{self.path.name}: closed before {self.specs[self.index].name} was complete")
        self.fh.close()  # no fsync: a test fixture, read back at once from the page cache (a crash rebuilds it)
        os.replace(self.partial, self.path)

    def abandon(self) -> None:
        """Close and remove the partial file (this writer made it)."""
        self.fh.close()
        self.partial.unlink(missing_ok=True)


def generate(spec: Spec, gen: torch.Generator, device: torch.device) -> Iterator[torch.Tensor]:
    """The tensor of ``spec`` in pieces of at most :data:`CHUNK_ELEMENTS` elements (whole rows)."""
    if spec.fill == "shape":
        yield torch.tensor(spec.value, dtype=torch.int32)
        return
    if spec.fill == "ones":
        yield torch.ones(spec.shape, dtype=spec.dtype)
        return
    rows, row = spec.shape[0], math.prod(spec.shape[1:])
    step = max(1, CHUNK_ELEMENTS // max(row, 1))
    for first in range(0, rows, step):
        shape = (min(step, rows - first), *spec.shape[1:])
        if spec.fill == "codes":  # every nibble uniform in 0..15: codes uniform in [-8, 7]
            words = torch.randint(0, 256, (math.prod(shape) * 4,), dtype=torch.uint8, device=device, generator=gen)
            yield words.view(torch.int32).view(shape)
        elif spec.fill == "scales":
            yield ((torch.rand(shape, device=device, generator=gen) + 0.5) * spec.value).to(spec.dtype)
        elif spec.fill in ("normal", "bias"):
            yield (torch.randn(shape, device=device, generator=gen) * spec.value).to(spec.dtype)
        else:
            raise ValueError(f"{spec.name}: unknown fill {spec.fill!r}")


def planned_bytes(num_layers: int = 3, **overrides) -> int:
    """The size of the slice's safetensors shards (what :func:`build_kimi_slice` needs on disk, tokenizer aside)."""
    return sum(s.nbytes for _, specs in shard_plan(slice_config(num_layers, **overrides)) for s in specs)


def build_kimi_slice(
    out: str | Path,
    num_layers: int = 3,
    *,
    device: str | torch.device | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = print,
    **overrides,
) -> Path:
    """Write the first ``num_layers`` layers of Kimi-K2.5's geometry (:data:`KIMI_K25_TEXT`, with ``overrides``,
    e.g. ``**TINY``) with random weights into ``out`` (a new or empty folder); return it.

    ``device``: where tensors are generated (default: the GPU where there is one); ``progress``: told each
    shard's bytes and rate (None: quiet). Refuses a folder that holds anything, and a disk without room.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: the slice is written into a new or empty folder")
    config = slice_config(num_layers, **overrides)
    plan = shard_plan(config)
    total = sum(s.nbytes for _, specs in plan for s in specs)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if free < total + (1 << 30):
        raise OSError(
            f"{out}: the slice needs {total / 1e9:.1f} GB (and 1 GB to spare), the disk has {free / 1e9:.1f} GB"
        )
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=device).manual_seed(seed)
    say = progress or (lambda line: None)
    say(f"Kimi slice: {num_layers} layers, hidden {config['hidden_size']}, {config['n_routed_experts']} experts, "
        f"{total / 1e9:.2f} GB in {len(plan)} shards into {out} (generated on {device})")  # fmt: skip
    weight_map, start = {}, time.perf_counter()
    for name, specs in plan:
        began = time.perf_counter()
        writer = StreamingSafetensors(out / name, specs)
        try:
            for spec in specs:
                for piece in generate(spec, gen, device):
                    writer.write(piece)
            writer.close()
        except BaseException:
            writer.abandon()
            raise
        weight_map.update({s.name: name for s in specs})
        seconds = time.perf_counter() - began
        size = writer.total
        say(f"  {name}: {len(specs)} tensors, {size / 1e9:.2f} GB in {seconds:.1f} s ({size / 1e9 / seconds:.2f} GB/s)")
    train_tokenizer(DEFAULT_CORPUS, 512).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    say(f"Kimi slice written: {total / 1e9:.2f} GB of tensors in {time.perf_counter() - start:.1f} s")
    return out


def first_layer_reference(model_dir: str | Path, prompts: list[list[int]], device: str = "cpu") -> list[torch.Tensor]:
    """The dense first decoder layer's output (the residual stream after layer 0, what the capture's layer id 0
    holds) per prompt, ``[len, hidden]`` float32 on the CPU: transformers' DeepSeek-V3 with that one layer, in
    float32 on ``device``, loaded with the checkpoint's own embeddings and layer-0 tensors (no expert needed)."""
    import transformers  # noqa: PLC0415 - transformers only where a reference is computed
    from safetensors import safe_open  # noqa: PLC0415 - the same

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    config = transformers.DeepseekV3Config.from_dict({**config, "num_hidden_layers": 1})
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    wanted = {n: f for n, f in weight_map.items() if n.startswith(("model.embed_tokens.", "model.layers.0."))}
    state = {}
    for file in sorted(set(wanted.values())):
        with safe_open(str(model_dir / file), "pt", device=str(device)) as fh:
            state.update({n.removeprefix("model."): fh.get_tensor(n).float() for n in wanted if wanted[n] == file})
    with torch.device(device):
        model = transformers.DeepseekV3Model(config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if not n.startswith("norm.")]  # the final norm is not applied to layer 0's output
    if missing or unexpected:
        raise ValueError(f"{model_dir}: layer 0's tensors do not fit transformers' model: missing {missing}, "
                         f"unexpected {unexpected}")  # fmt: skip
    outputs, seen = [], {}

    def keep(module, args, out):
        seen[0] = out[0] if isinstance(out, tuple) else out

    hook = model.layers[0].register_forward_hook(keep)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # a float32 reference: no TF32 on a GPU
    try:
        with torch.no_grad():
            for ids in prompts:
                model(torch.tensor([ids], device=device))
                outputs.append(seen[0][0].float().cpu())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        hook.remove()
    return outputs
