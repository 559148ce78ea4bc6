"""The torch stand-ins for vLLM 0.16's ``_C`` activation kernels (GPU kit), each against its plain formula.

:mod:`speculators_v016.testing.act_ops` stands in for every activation op vLLM's layers and its fused MoE
call through ``torch.ops._C``. Each is checked element by element against the formula written out in
float64 (tanh, erf, sigmoid, the thresholds and clamps), in bf16 as the engine runs and in float32, and
against vLLM's compiled CPU kernel of that name where the CPU build has one; vLLM's own layers
(``NewGELU``, ``FatreluAndMul``, ...) built and run through them.
"""

import math

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers import activation

from speculators_v016.testing import act_ops
from speculators_v016.testing.op_registry import empty_report, register


@pytest.fixture(scope="module", autouse=True)
def installed():
    """The stand-ins registered once for the module (idempotent)."""
    return act_ops.install()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def silu(a: float) -> float:
    return a / (1 + math.exp(-a))


def gelu_tanh(a: float) -> float:
    return 0.5 * a * (1 + math.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))


def swigluoai(gate: float, up: float, alpha: float = 1.702, limit: float = 7.0) -> float:
    g, u = min(gate, limit), max(-limit, min(up, limit))
    return (u + 1) * g / (1 + math.exp(-alpha * g))


#: name -> (formula per element of the activated half, or of x; gated: True where ``out`` is half of ``input``)
GATED = {
    "silu_and_mul": lambda x, y: silu(x) * y,
    "mul_and_silu": lambda x, y: x * silu(y),
    "gelu_and_mul": lambda x, y: 0.5 * x * (1 + math.erf(x / math.sqrt(2))) * y,
    "gelu_tanh_and_mul": lambda x, y: gelu_tanh(x) * y,
    "fatrelu_and_mul": lambda x, y: (x if x > 0.0 else 0.0) * y,
}
ELEMENTWISE = {
    "gelu_new": gelu_tanh,
    "gelu_fast": lambda a: 0.5 * a * (1 + math.tanh(0.7978845608 * a * (1 + 0.044715 * a * a))),
    "gelu_quick": lambda a: a / (1 + math.exp(-1.702 * a)),
}
#: bf16 rounds the activation once and the product once: 2 ulps (2^-7) of the result, plus an absolute floor
TOLERANCE = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def inputs(shape, dtype, seed):
    """Values over the kernels' interesting range: both signs, past the clamps (|x| up to 9)."""
    return (torch.randn(*shape, generator=gen(seed)) * 3).clamp(-9, 9).to(dtype)


def by_formula(formula, *columns: torch.Tensor) -> torch.Tensor:
    flat = [c.double().flatten().tolist() for c in columns]
    return torch.tensor([formula(*values) for values in zip(*flat)], dtype=torch.float64).view(columns[0].shape)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(GATED))
def test_gated_activations_match_their_formula(name, dtype):
    """out [..., d] from input [..., 2d] (3-D as vLLM may pass it): the activated half times the other."""
    x = inputs((2, 5, 2 * 24), dtype, seed=len(name))
    out = torch.full((2, 5, 24), float("nan"), dtype=dtype)
    getattr(act_ops, name)(out, x)
    want = by_formula(GATED[name], x[..., :24], x[..., 24:])
    torch.testing.assert_close(out.double(), want, **TOLERANCE[dtype])


def test_fatrelu_and_mul_keeps_values_above_its_threshold_only():
    """threshold 0.5: x <= 0.5 gives 0, above it x, times y (MiniCPM-S's FATReLU)."""
    x = torch.tensor([[0.25, 0.5, 0.75, -3.0, 2.0, 1.0, 1.0, 3.0, 4.0, 4.0]])
    out = torch.empty(1, 5)
    torch.ops._C.fatrelu_and_mul(out, x, 0.5)  # vLLM's CPU build has none: the stand-in
    assert out.tolist() == [[0.0, 0.0, 2.25, 0.0, 8.0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_swigluoai_and_mul_reads_gate_and_up_interleaved(dtype):
    """GPT-OSS: gate at even, up at odd positions, clamped at 7 (gate from above, up both ways); alpha 1.702."""
    x = inputs((7, 2 * 16), dtype, seed=11)
    out = torch.empty(7, 16, dtype=dtype)
    torch.ops._C.swigluoai_and_mul(out, x)  # the stand-in (vLLM's CPU build has none), its default alpha and limit
    want = by_formula(swigluoai, x[:, 0::2], x[:, 1::2])
    torch.testing.assert_close(out.double(), want, **TOLERANCE[dtype])
    custom = torch.empty_like(out)
    torch.ops._C.swigluoai_and_mul(custom, x, 1.0, 2.0)
    want = by_formula(lambda g, u: swigluoai(g, u, 1.0, 2.0), x[:, 0::2], x[:, 1::2])
    torch.testing.assert_close(custom.double(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_gelus_match_their_formula_and_vllms_cpu_kernel(name, dtype):
    """gelu_new / gelu_fast / gelu_quick: the formula per element; equal to vLLM's compiled CPU kernel within rounding."""
    x = inputs((9, 32), dtype, seed=len(name) + 20)
    ours = torch.empty_like(x)
    getattr(act_ops, name)(ours, x)
    torch.testing.assert_close(ours.double(), by_formula(ELEMENTWISE[name], x), **TOLERANCE[dtype])
    theirs = torch.empty_like(x)
    getattr(torch.ops._C, name)(theirs, x)  # vLLM's CPU build has these kernels
    torch.testing.assert_close(ours.double(), theirs.double(), **TOLERANCE[dtype])


@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"])
def test_gated_stand_ins_equal_vllms_cpu_kernels(name):
    """Where vLLM's CPU build has the kernel (16-wide halves), the stand-in equals it within bf16 rounding."""
    x = inputs((7, 2 * 16), torch.bfloat16, seed=30)
    ours, theirs = torch.empty(7, 16, dtype=torch.bfloat16), torch.empty(7, 16, dtype=torch.bfloat16)
    getattr(act_ops, name)(ours, x)
    getattr(torch.ops._C, name)(theirs, x)
    torch.testing.assert_close(ours.float(), theirs.float(), **TOLERANCE[torch.bfloat16])


def test_vllms_layers_run_through_the_stand_ins():
    """vLLM's own MulAndSilu, FatreluAndMul and SwigluOAIAndMul CUDA forwards, run on CPU, equal their native forwards."""
    x = inputs((6, 2 * 32), torch.float32, seed=40)
    with set_current_vllm_config(VllmConfig()):
        layers = (activation.MulAndSilu(), activation.FatreluAndMul(threshold=0.3), activation.SwigluOAIAndMul())
    kernels = {activation.MulAndSilu: "mul_and_silu", activation.FatreluAndMul: "fatrelu_and_mul"}
    for layer in layers:
        if type(layer) in kernels:  # on CPU vLLM looks no kernel up: the one its CUDA build looks up
            layer.op = getattr(torch.ops._C, kernels[type(layer)])
        torch.testing.assert_close(layer.forward_cuda(x), layer.forward_native(x), rtol=1e-5, atol=1e-6)


def test_install_registers_every_activation_op_once(installed):
    """Every activation op of vLLM's _C is ours or compiled; the CPU build's kernels are kept; idempotent."""
    assert sorted(installed["installed"] + installed["kept"]) == sorted(f"_C::{name}" for name in act_ops.OPS)
    assert set(installed["kept"]) == {f"_C::{n}" for n in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul",
                                                            "gelu_new", "gelu_fast", "gelu_quick")}  # fmt: skip
    assert act_ops.install() == installed
    assert all(isinstance(getattr(torch.ops._C, name), torch._ops.OpOverloadPacket) for name in act_ops.OPS)


def test_a_kit_placeholder_gives_way_and_a_compiled_op_stays():
    """As on the GPU kit (its _C sets raising placeholders as attributes): the stand-in replaces one; a compiled op
    of the name (vLLM's CPU build's gelu_new) is kept."""
    namespace = "_speculators_kit_test"

    def placeholder(*args):
        raise NotImplementedError(f"torch.ops.{namespace}.gelu_new: vLLM's compiled kernels are not in this kit")

    getattr(torch.ops, namespace).gelu_new = placeholder
    x, out = torch.randn(6, generator=gen(50)), torch.empty(6)
    with pytest.raises(NotImplementedError, match="not in this kit"):
        getattr(torch.ops, namespace).gelu_new(out, x)
    report = empty_report()
    register(namespace, "gelu_new", act_ops.gelu_new, ("out",), None, report)
    getattr(torch.ops, namespace).gelu_new(out, x)
    assert report == {"installed": [f"{namespace}::gelu_new"], "kept": []}
    torch.testing.assert_close(out.double(), by_formula(ELEMENTWISE["gelu_new"], x), rtol=1e-5, atol=1e-6)
    compiled = empty_report()
    register("_C", "gelu_new", act_ops.gelu_new, ("out",), None, compiled)
    assert compiled == {"installed": [], "kept": ["_C::gelu_new"]}
