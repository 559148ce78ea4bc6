"""The Kimi-K2.5 slice builder (speculators_v016.testing.kimi_slice) on its tiny-dimension mode, and its full-width plan.

The tiny slice goes through the same code as the 7168-wide one (the GPU tier builds that:
``tests/gpu/test_kimi_width_gpu.py``): its config holds Kimi-K2.5's fields, its index names every
tensor of every shard, every expert decodes (compressed-tensors' own unpacking), transformers reads the
config, and the first-layer reference equals transformers' whole model on a twin decoded from the codes.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import namedtuple

import pytest
import torch
from compressed_tensors.compressors.quantized_compressors.pack_quantized import unpack_from_int32
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from helpers.reference import hf_layer_outputs
from speculators_v016.testing import kimi_slice
from speculators_v016.testing.kimi_slice import (
    KIMI_K25_TEXT,
    TINY,
    Spec,
    StreamingSafetensors,
    build_kimi_slice,
    first_layer_reference,
    planned_bytes,
    shard_plan,
    slice_config,
)
from speculators_v016.testing.tiny_quant import KIMI_K25_QUANTIZATION, dequantize_groups

LAYERS = 3


@pytest.fixture(scope="module")
def tiny_slice(tmp_path_factory):
    return build_kimi_slice(tmp_path_factory.mktemp("kimi") / "slice", LAYERS, progress=None, **TINY)


def tensors_of(folder) -> dict:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys()})
    return out


def test_config_holds_kimis_fields(tiny_slice):
    """config.json: DeepSeek-V3 with Kimi-K2.5's fields (the tiny dimensions overridden), bf16, its quantization."""
    config = json.loads((tiny_slice / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["model_type"] == "deepseek_v3"
    for key, value in {**KIMI_K25_TEXT, **TINY, "num_hidden_layers": LAYERS}.items():
        if key == "rope_scaling":
            assert {k: config[key][k] for k in value} == value
        else:
            assert config[key] == value, key
    assert config["quantization_config"] == KIMI_K25_QUANTIZATION and config["dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_transformers_reads_the_config(tiny_slice):
    """AutoConfig builds the model's config from the folder: the geometry and the YaRN rope as written."""
    config = AutoConfig.from_pretrained(tiny_slice)
    assert type(config).__name__ == "DeepseekV3Config"
    assert (config.hidden_size, config.n_routed_experts, config.num_experts_per_tok) == (256, 16, 4)
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.n_group, config.topk_group) == (512, 64, 1, 1)
    assert config.rope_scaling["factor"] == 32.0 and config.rope_scaling["original_max_position_embeddings"] == 4096
    assert config.routed_scaling_factor == 2.827 and config.scoring_func == "sigmoid"


def test_index_names_every_tensor_of_every_shard(tiny_slice):
    """model.safetensors.index.json maps each tensor to the shard that holds it, and nothing else; total_size is
    the sum of the tensors' bytes; each shard holds the plan's tensors with their shapes and dtypes."""
    index = json.loads((tiny_slice / "model.safetensors.index.json").read_text())
    found, total = {}, 0
    for path in sorted(tiny_slice.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            for name in fh.keys():
                found[name] = path.name
                total += math.prod(fh.get_slice(name).get_shape()) * fh.get_tensor(name).element_size()
    assert index["weight_map"] == found and index["metadata"]["total_size"] == total
    plan = shard_plan(json.loads((tiny_slice / "config.json").read_text()))
    assert [name for name, _ in plan] == sorted({f for f in found.values()})
    for name, specs in plan:
        with safe_open(str(tiny_slice / name), "pt") as fh:
            assert sorted(fh.keys()) == sorted(s.name for s in specs)
            for s in specs:
                t = fh.get_tensor(s.name)
                assert (tuple(t.shape), t.dtype) == (s.shape, s.dtype), s.name
    assert not list(tiny_slice.glob("*.partial"))


def decode_experts(tensors: dict) -> dict:
    """Every routed expert's weight, ``[out, in]`` float32, from its packed codes and scales (compressed-tensors'
    own unpacking; the shape from weight_shape)."""
    out = {}
    for name in [n for n in tensors if n.endswith(".weight_packed")]:
        prefix = name.removesuffix(".weight_packed")
        shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
        codes = unpack_from_int32(tensors[name], 4, shape)
        out[f"{prefix}.weight"] = dequantize_groups(codes, tensors[f"{prefix}.weight_scale"])
    return out


def test_every_expert_decodes_with_kimis_spread(tiny_slice):
    """Every expert of every MoE layer decodes to its [out, in] weight; the codes cover [-8, 7] evenly and the
    weights spread as a dense layer's (std near 1/sqrt(fan_in))."""
    tensors = tensors_of(tiny_slice)
    experts = decode_experts(tensors)
    assert len(experts) == (LAYERS - 1) * TINY["n_routed_experts"] * 3
    gate = experts["model.layers.2.mlp.experts.5.gate_proj.weight"]
    down = experts["model.layers.1.mlp.experts.0.down_proj.weight"]
    assert gate.shape == (TINY["moe_intermediate_size"], TINY["hidden_size"])
    assert down.shape == (TINY["hidden_size"], TINY["moe_intermediate_size"])
    packed = torch.cat([t.flatten() for n, t in tensors.items() if n.endswith("weight_packed")])
    codes = unpack_from_int32(packed.view(1, -1), 4, torch.Size([1, packed.numel() * 8]))
    counts = torch.bincount((codes.flatten().long() + 8), minlength=16).float()
    assert counts.min() > 0.9 * counts.mean() and counts.max() < 1.1 * counts.mean()
    for weight, fan_in in ((gate, TINY["hidden_size"]), (down, TINY["moe_intermediate_size"])):
        assert 0.85 < weight.std().item() * math.sqrt(fan_in) < 1.15


def test_first_layer_reference_is_transformers_on_the_decoded_model(tiny_slice, tmp_path):
    """The dense first layer's reference (transformers' one-layer model on the checkpoint's tensors) equals layer 0
    of transformers' whole model on a twin whose experts are decoded from the codes; the residual stream stays
    near unit size through every layer."""
    tensors = tensors_of(tiny_slice)
    twin = {n: t.float() for n, t in tensors.items() if "mlp.experts." not in n}
    twin.update(decode_experts(tensors))
    folder = tmp_path / "twin"
    shutil.copytree(tiny_slice, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    save_file(twin, str(folder / "model.safetensors"), metadata={"format": "pt"})
    prompts = [[5, 9, 200, 31, 7, 1000, 64], [3, 4]]
    whole = hf_layer_outputs(str(folder), prompts)
    ours = first_layer_reference(tiny_slice, prompts)
    for got, want in zip(ours, whole):
        assert torch.equal(got, want[0])
    rms = [layer.pow(2).mean().sqrt().item() for layer in whole[0]]
    assert all(0.3 < r < 10 for r in rms), rms


def test_yarn_rope_is_read_alike_by_vllm_and_transformers(tiny_slice):
    """The slice's YaRN (factor 32 over 4096, betas 1): vLLM's DeepSeek rotary (its model's deepseek_yarn) and
    transformers' give the same frequencies and no extra scaling of cos/sin."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: PLC0415 - the same
        DeepseekV3RotaryEmbedding,
    )
    from vllm.config import VllmConfig, set_current_vllm_config  # noqa: PLC0415 - vLLM: slow to import, this test only
    from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: PLC0415 - the same
    from vllm.transformers_utils.config import get_config  # noqa: PLC0415 - the same

    config = get_config(str(tiny_slice), trust_remote_code=False)
    parameters = {**config.rope_parameters, "rope_type": "deepseek_yarn"}  # as vLLM's DeepSeek attention sets it
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=131072, is_neox_style=False, rope_parameters=parameters, dtype=torch.float32)
    theirs = DeepseekV3RotaryEmbedding(AutoConfig.from_pretrained(tiny_slice))
    torch.testing.assert_close(rope._compute_inv_freq(32.0), theirs.inv_freq.float(), rtol=1e-6, atol=0)
    assert rope.mscale == theirs.attention_scaling == 1.0
    positions = torch.tensor([0, 7, 4095, 5000, 100000])
    cos, sin = theirs(torch.zeros(1, 1, 64), positions[None])
    half = rope.cos_sin_cache[positions]
    torch.testing.assert_close(half[:, :32], cos[0, :, :32], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(half[:, 32:], sin[0, :, :32], rtol=1e-4, atol=1e-4)


def test_kimis_width_plans_9_5_gb_of_experts_a_layer():
    """At Kimi's real width: 384 experts of codes and scales are ~9.5 GB a MoE layer, 25.3 GB in all for 3
    layers; the shapes those tensors have are Kimi-K2.5's."""
    config = slice_config(3)
    plan = dict(shard_plan(config))
    layer = plan["model-00003-of-00005.safetensors"]
    experts = sum(s.nbytes for s in layer if ".mlp.experts." in s.name)
    assert 9.4e9 < experts < 9.6e9
    assert 25.0e9 < planned_bytes(3) < 25.6e9
    shapes = {s.name: s.shape for s in layer}
    assert shapes["model.layers.1.mlp.experts.383.gate_proj.weight_packed"] == (2048, 896)
    assert shapes["model.layers.1.mlp.experts.383.down_proj.weight_scale"] == (7168, 64)
    assert shapes["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert shapes["model.layers.1.self_attn.q_b_proj.weight"] == (64 * 192, 1536)
    head = plan["model-00005-of-00005.safetensors"][1]
    assert (head.name, head.shape, head.dtype) == ("lm_head.weight", (163840, 7168), torch.bfloat16)


def test_streaming_writer_makes_a_file_safetensors_reads(tmp_path):
    """Tensors written in pieces in the header's order read back exactly; the file appears only when complete."""
    specs = [Spec("a", (5, 3), torch.bfloat16, "normal"), Spec("b", (2,), torch.int32, "shape"),
             Spec("c", (4, 8), torch.int32, "codes")]  # fmt: skip
    values = {"a": torch.randn(5, 3).to(torch.bfloat16), "b": torch.tensor([7, 9], dtype=torch.int32),
              "c": torch.randint(-(2**31), 2**31 - 1, (4, 8), dtype=torch.int32)}  # fmt: skip
    writer = StreamingSafetensors(tmp_path / "x.safetensors", specs)
    writer.write(values["a"][:2])
    writer.write(values["a"][2:])
    assert not (tmp_path / "x.safetensors").exists()
    writer.write(values["b"])
    writer.write(values["c"])
    writer.close()
    assert {k: v for k, v in tensors_of(tmp_path).items()}.keys() == values.keys()
    for name, value in tensors_of(tmp_path).items():
        assert torch.equal(value, values[name])
    assert not list(tmp_path.glob("*.partial"))


def test_streaming_writer_refuses_wrong_pieces(tmp_path):
    """A piece of another dtype, too many bytes, or closing before the end is refused; nothing is left."""
    specs = [Spec("a", (2, 2), torch.bfloat16, "normal")]
    writer = StreamingSafetensors(tmp_path / "x.safetensors", specs)
    with pytest.raises(TypeError, match="a: a torch.float32 piece for a torch.bfloat16 tensor"):
        writer.write(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="a: 12 bytes written where 8 were left"):
        writer.write(torch.zeros(6, dtype=torch.bfloat16))
    writer.write(torch.zeros(1, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x.safetensors: closed before a was complete"):
        writer.close()
    writer.abandon()
    assert not list(tmp_path.iterdir())


def test_build_refuses_a_folder_with_files_and_a_full_disk(tmp_path, monkeypatch):
    """The slice goes into a new or empty folder only (nothing there is overwritten), and not onto a disk without
    room for it (refused before a byte is written)."""
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="busy: the slice is written into a new or empty folder"):
        build_kimi_slice(tmp_path / "busy", LAYERS, progress=None, **TINY)
    assert (tmp_path / "busy" / "mine.txt").read_text() == "keep"
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(kimi_slice.shutil, "disk_usage", lambda path: usage(10**12, 10**12, 10**6))
    with pytest.raises(OSError, match=r"full: the slice needs 0\.0 GB \(and 1 GB to spare\), the disk has 0\.0 GB"):
        build_kimi_slice(tmp_path / "full", LAYERS, progress=None, **TINY)
    assert not list((tmp_path / "full").iterdir())


def test_a_slice_needs_a_moe_layer_and_whole_groups():
    """One layer (dense only) or a width that is not a multiple of the 32-channel groups is refused, named."""
    with pytest.raises(ValueError, match="num_layers 1: a slice holds the dense first layer and at least one MoE"):
        slice_config(1, **TINY)
    with pytest.raises(ValueError, match="moe_intermediate_size 48: the experts' groups of 32 need a multiple of it"):
        slice_config(3, **{**TINY, "moe_intermediate_size": 48})


def test_first_layer_reference_refuses_a_checkpoint_missing_a_tensor(tiny_slice, tmp_path):
    """A layer-0 tensor absent from the index is named, not silently left at transformers' random init."""
    folder = tmp_path / "partial"
    shutil.copytree(tiny_slice, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.0.self_attn.kv_b_proj.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match=r"partial: layer 0's tensors do not fit .*missing \['layers.0.self_attn.kv_b_proj"
    ):
        first_layer_reference(folder, [[5, 6, 7]])
