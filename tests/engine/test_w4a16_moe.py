"""Kimi-K2.5's INT4 expert format (compressed-tensors ``pack-quantized`` W4A16, group 32) as the tiny builder writes it.

The packed checkpoint is decoded by compressed-tensors' own decompressor (an independent reference) and
equals its dequantized twin exactly; vLLM 0.16's own MoE layer, built on the CPU from the checkpoint's
``quantization_config``, loads every expert tensor through its weight loader and, after its post-load
processing, holds exactly the twin's weights in the layout its Triton WNA16 kernel reads. vLLM's CPU
engine cannot run this format (it picks the Marlin method, whose repack kernel the CPU build lacks; the
Triton method needs a GPU): ``tests/gpu/test_int4_moe_gpu.py`` runs it.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.quantized_compressors.pack_quantized import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from safetensors.torch import load_file

from speculators_v016.testing.tiny_quant import (
    EXPERT,
    KIMI_K25_QUANTIZATION,
    build_tiny_w4a16_moe,
    dequantize_groups,
    pack_int4,
)

LAYERS = 3
EXPERTS, HIDDEN, INTER = 16, 256, 128  # deepseek_v3_mla's


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny DeepSeek-V3 (MLA geometry) with W4A16 experts, and its twin: (folder, tensors) of each."""
    quantized, twin = build_tiny_w4a16_moe(tmp_path_factory.mktemp("w4a16"), num_layers=LAYERS)
    return quantized, load_file(str(quantized / "model.safetensors")), twin, load_file(str(twin / "model.safetensors"))


def test_pack_int4_layout_is_pack_quantized():
    """Codes 8k+i sit in nibble i of word k as code + 8, lowest first: by hand, and compressed-tensors agrees."""
    codes = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int8)
    words = pack_int4(codes)
    assert words.dtype == torch.int32 and words.shape == (1, 2)
    assert words[0, 0].item() == 0x76543210
    assert words[0, 1].item() == 0xFEDCBA98 - 2**32  # two's complement
    random = torch.randint(-8, 8, (37, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    assert torch.equal(pack_int4(random), pack_to_int32(random, 4))
    assert torch.equal(unpack_from_int32(pack_int4(random), 4, random.shape), random)


@pytest.mark.parametrize(
    ("codes", "message"),
    [
        (torch.full((2, 8), 8, dtype=torch.int8), r"codes outside \[-8, 7\] \(8\.\.8\)"),
        (torch.zeros(2, 8, dtype=torch.int32), "int8 .rows, cols. with cols a multiple of 8"),
        (
            torch.zeros(2, 12, dtype=torch.int8),
            r"int8 .rows, cols. with cols a multiple of 8, got torch.int8 \(2, 12\)",
        ),
    ],
)
def test_pack_int4_refuses_what_it_cannot_pack(codes, message):
    """A code outside 4 bits, another dtype or a row not of whole words is refused, named."""
    with pytest.raises(ValueError, match=message):
        pack_int4(codes)


def test_the_checkpoint_is_kimis_format(built):
    """Config and tensors as Kimi-K2.5 ships them: its quantization_config, int32 codes and shapes, bf16 scales
    and non-expert weights, the router's correction bias float32, no unquantized expert weight left."""
    quantized, q, _, _ = built
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"] == KIMI_K25_QUANTIZATION and config["dtype"] == "bfloat16"
    prefix = "model.layers.2.mlp.experts.7.up_proj"
    assert (q[f"{prefix}.weight_packed"].dtype, tuple(q[f"{prefix}.weight_packed"].shape)) == (torch.int32, (INTER, 32))
    assert (q[f"{prefix}.weight_scale"].dtype, tuple(q[f"{prefix}.weight_scale"].shape)) == (torch.bfloat16, (INTER, 8))
    assert q[f"{prefix}.weight_shape"].dtype == torch.int32 and q[f"{prefix}.weight_shape"].tolist() == [INTER, HIDDEN]
    assert q["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert not [n for n in q if n.endswith(".weight") and "experts." in n and "shared_experts" not in n]
    others = {n: t.dtype for n, t in q.items() if "mlp.experts." not in n and not n.endswith("correction_bias")}
    assert set(others.values()) == {torch.bfloat16}, others
    assert len([n for n in q if n.endswith("weight_packed")]) == (LAYERS - 1) * EXPERTS * 3


def test_compressed_tensors_decodes_the_checkpoint_into_the_twin(built):
    """compressed-tensors' own decompressor turns every packed expert into the twin's weight, exactly (scales read
    as float32: the products are exact there); every other tensor is the twin's, bf16-rounded."""
    quantized, q, _, t = built
    scheme = KIMI_K25_QUANTIZATION["config_groups"]["group_0"]["weights"]
    compressor = BaseCompressor.load_from_registry(KIMI_K25_QUANTIZATION["format"])
    experts = [n for n in t if re.search(EXPERT, n)]
    assert len(experts) == (LAYERS - 1) * EXPERTS * 3
    for name in experts:
        prefix = name.removesuffix(".weight")
        packed = {key: q[f"{prefix}.{key}"] for key in ("weight_packed", "weight_scale", "weight_shape")}
        packed["weight_scale"] = packed["weight_scale"].float()
        assert torch.equal(compressor.decompress_weight(packed, QuantizationArgs(**scheme)), t[name]), name
    for name, tensor in q.items():
        if "mlp.experts." not in name:
            assert torch.equal(tensor.float(), t[name]), name


@pytest.fixture(scope="module")
def vllm_parallel_state(tmp_path_factory):
    """vLLM's parallel state for one CPU process (a layer needs it to be built), torn down after the module."""
    from vllm.distributed import (  # noqa: PLC0415 - vLLM: slow to import, this module's tests only
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.distributed.parallel_state import (  # noqa: PLC0415 - the same
        cleanup_dist_env_and_memory,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():  # set up by an earlier test of this process: used as it is
        yield
        return
    where = tmp_path_factory.mktemp("dist") / "init"
    init_distributed_environment(1, 0, f"file://{where}", 0, backend="gloo")
    initialize_model_parallel(1, 1)
    yield
    cleanup_dist_env_and_memory()


def moe_layer(quantized, marlin: bool = True):
    """vLLM's FusedMoE for layer 1 of the tiny model, quantized by the checkpoint's config (``marlin`` False:
    vLLM's check that Marlin fits the layer answers no, as where Marlin is absent)."""
    from unittest import mock  # noqa: PLC0415 - this helper only

    from vllm.config import VllmConfig, set_current_vllm_config  # noqa: PLC0415 - vLLM: this module's tests only
    from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: PLC0415 - the same
    from vllm.model_executor.layers.quantization.compressed_tensors import (  # noqa: PLC0415 - the same
        compressed_tensors_moe,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: PLC0415
        CompressedTensorsConfig,
    )

    config = CompressedTensorsConfig.from_config(
        json.loads((quantized / "config.json").read_text())["quantization_config"]
    )
    steer = mock.patch.object(compressed_tensors_moe, "check_moe_marlin_supports_layer", lambda *a: marlin)
    with set_current_vllm_config(VllmConfig()), steer:
        return FusedMoE(num_experts=EXPERTS, top_k=4, hidden_size=HIDDEN, intermediate_size=INTER,
                        params_dtype=torch.bfloat16, reduce_results=False, renormalize=True, quant_config=config,
                        use_grouped_topk=True, num_expert_group=4, topk_group=2, prefix="model.layers.1.mlp.experts",
                        scoring_func="sigmoid", e_score_correction_bias=torch.zeros(EXPERTS))  # fmt: skip


def load_experts(layer, tensors: dict) -> set[str]:
    """Every routed-expert tensor of layer 1 into ``layer`` through vLLM's expert mapping and weight loader (as its
    DeepSeek-V2/V3 model's load_weights routes them); the parameters written."""
    from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: PLC0415 - vLLM: this module's tests only

    holder = torch.nn.Module()
    holder.experts = layer
    mapping = FusedMoE.make_expert_params_mapping(holder, "gate_proj", "down_proj", "up_proj", num_experts=EXPERTS)
    written = set()
    for name, tensor in tensors.items():
        if not name.startswith("model.layers.1.mlp.experts."):
            continue
        [(param_name, weight_name, expert_id, shard_id)] = [m for m in mapping if m[1] in name]
        mapped = name.removeprefix("model.layers.1.mlp.").replace(weight_name, param_name)
        param = getattr(layer, mapped.removeprefix("experts."))
        assert layer.weight_loader(param, tensor, mapped, shard_id=shard_id, expert_id=expert_id, return_success=True)
        written.add(mapped.removeprefix("experts."))
    return written


def test_vllm_picks_marlin_on_this_cpu_and_loads_the_tensors(built, vllm_parallel_state):
    """Unsteered, vLLM 0.16 picks CompressedTensorsWNA16MarlinMoEMethod (the shapes fit Marlin; a real GPU build
    runs it) and its loader takes every expert tensor under its names, shapes and dtypes."""
    quantized, q, _, _ = built
    layer = moe_layer(quantized)
    assert type(layer.quant_method).__name__ == "CompressedTensorsWNA16MarlinMoEMethod"
    written = load_experts(layer, q)
    assert written == {f"w{i}_weight_{k}" for i in (13, 2) for k in ("packed", "scale", "shape")}


def test_vllms_triton_wna16_layout_holds_exactly_the_twin(built, vllm_parallel_state):
    """Where Marlin does not fit, vLLM picks CompressedTensorsWNA16MoEMethod; after loading and its post-load
    processing, decoding its tensors as its Triton kernel reads them (byte k // 2 of row n, nibble k % 2, minus 8,
    times scale [n, k // group]) gives every expert's gate, up and down weights of the twin, exactly."""
    quantized, q, _, t = built
    layer = moe_layer(quantized, marlin=False)
    assert type(layer.quant_method).__name__ == "CompressedTensorsWNA16MoEMethod"
    load_experts(layer, q)
    assert layer.w13_weight_shape[3].tolist() == [INTER, HIDDEN] and layer.w2_weight_shape[3].tolist() == [
        HIDDEN,
        INTER,
    ]
    layer.quant_method.process_weights_after_loading(layer)

    def as_kernel_reads(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        assert packed.dtype == torch.uint8  # [experts, n, k / 2]
        k = torch.arange(packed.shape[-1] * 2)
        nibbles = (packed[..., k // 2].to(torch.int32) >> ((k % 2) * 4)) & 0xF
        return (nibbles - 8).float() * scales.float()[..., k // 32]

    w13 = as_kernel_reads(layer.w13_weight_packed, layer.w13_weight_scale)  # [experts, 2 * inter, hidden]
    w2 = as_kernel_reads(layer.w2_weight_packed, layer.w2_weight_scale)  # [experts, hidden, inter]
    for e in range(EXPERTS):
        p = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(w13[e, :INTER], t[f"{p}.gate_proj.weight"]), e
        assert torch.equal(w13[e, INTER:], t[f"{p}.up_proj.weight"]), e
        assert torch.equal(w2[e], t[f"{p}.down_proj.weight"]), e


def test_the_ignore_list_keeps_every_other_linear_unquantized(built, vllm_parallel_state):
    """vLLM's compressed-tensors config quantizes the routed experts only: attention, the shared experts, the dense
    first MLP and lm_head get no scheme (bf16, as Kimi-K2.5 runs them)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: PLC0415
        CompressedTensorsConfig,
    )

    quantized = built[0]
    config = CompressedTensorsConfig.from_config(
        json.loads((quantized / "config.json").read_text())["quantization_config"]
    )

    class ReplicatedLinear(torch.nn.Module):  # matched by class name, as vLLM's linear layers are
        pass

    class FusedMoE(torch.nn.Module):
        pass

    config._add_fused_moe_to_target_scheme_map()
    bf16 = ["model.layers.1.self_attn.q_a_proj", "model.layers.1.self_attn.kv_b_proj", "model.layers.0.mlp.gate_up_proj",
            "model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.gate_up_proj",
            "model.layers.1.mlp.shared_experts.down_proj", "lm_head"]  # fmt: skip
    assert all(config.get_scheme_dict(ReplicatedLinear(), name) is None for name in bf16)
    scheme = config.get_scheme_dict(FusedMoE(), "model.layers.1.mlp.experts.0.gate_proj")
    assert scheme is not None and scheme["input_activations"] is None and scheme["format"] == "pack-quantized"
    assert (scheme["weights"].num_bits, scheme["weights"].group_size, scheme["weights"].symmetric) == (4, 32, True)


def test_the_twin_groups_are_codes_times_scales(built):
    """dequantize_groups: the twin's expert weight is code times its group's scale, group by group."""
    _, q, _, t = built
    prefix = "model.layers.1.mlp.experts.0.down_proj"
    codes = unpack_from_int32(q[f"{prefix}.weight_packed"], 4, torch.Size([HIDDEN, INTER]))
    scales = q[f"{prefix}.weight_scale"]
    assert torch.equal(dequantize_groups(codes, scales), t[f"{prefix}.weight"])
    assert torch.equal(t[f"{prefix}.weight"][3, 40:64], codes[3, 40:64].float() * scales[3, 1].float())
