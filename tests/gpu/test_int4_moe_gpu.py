"""INT4 experts in Kimi-K2.5's own format on vLLM 0.16's own GPU path (GPU kit), bf16, eager and compiled.

The target: a tiny DeepSeek-V3 with MLA's real geometry (``deepseek_v3_mla``: latent 576, q LoRA,
16 experts in 4 groups, top-4, a shared expert, a dense first layer, ``noaux_tc``) whose routed experts
are stored as Kimi-K2.5 ships them (compressed-tensors ``pack-quantized`` W4A16, group 32:
:func:`speculators_v016.testing.tiny_quant.build_tiny_w4a16_moe`), everything else bf16, beside its
dequantized twin (float32, exactly the weights the codes stand for), the reference transformers runs.

On the kit (vLLM's Python and Triton code, no compiled library) vLLM runs the experts through
``CompressedTensorsWNA16MoEMethod``: its Triton GEMM ``fused_moe_kernel_gptq_awq`` for prefill-sized
steps and the compiled ``_moe_C.moe_wna16_gemm`` where tokens x top-k / experts <= 6 (every
decode-sized step), stood in for by torch (``speculators_v016.testing.wna16_ops``, beside the
fused-MoE, MLA and activation stand-ins; all installed by :mod:`speculators_v016.testing.gpu_kit`).
A real build runs Marlin instead (``CompressedTensorsWNA16MarlinMoEMethod``); the kit has none, and
``wna16_ops`` steers that choice where Marlin is absent. MLA with ``TRITON_MLA``.

Per mode (eager; compiled with CUDA graphs), one engine: the method vLLM picked for every MoE layer;
every captured layer against transformers in float32 on the twin, per row, within the bf16 bounds of
:mod:`speculators_v016.checks.fidelity` (the median row; at most ``FLIPPED_ROWS`` past the row bound);
the neighbouring layer and rows one position off at least ``SEPARATION`` times the median bound away;
the start-up stream proof's margins (>= ``DIFFERENT_FACTOR``); the logit check; in eager mode our taps
against vLLM's own layers bit for bit. Then, in the same engine, greedy generation: the decode steps
reach the ``moe_wna16_gemm`` stand-in (its call counter, ``wna16_ops.CALLS``), the states captured
while decoding sit within the bounds of a prefill of the final sequences and of transformers, and
(compiled) the tokens are vLLM's own loop's (``LLMEngine`` in a process of its own, same stand-ins).
Last, the real command through :mod:`speculators_v016.testing.gpu_kit`: its default run, FP8 storage and
greedy ``--regenerate`` pass their logit checks and ``verify``.

Figures are printed (``-s``) and, with ``SPECULATORS_GPU_FIGURES`` set, written there as JSON. Skips
without CUDA or where vLLM's CUDA platform does not load.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from test_cli_gpu import COUNT, assert_ok
from test_cli_gpu import run as run_cli
from test_moe_mla_gpu import family_engine_args

from helpers import layer_rows
from helpers.cli import conversations, load_all, write_jsonl
from helpers.families import vllm_layer_outputs
from helpers.gpu import save_figures, vllm_loop, vllm_on_cuda
from helpers.layer_rows import MEDIAN_BOUND
from helpers.reference import hf_layer_outputs, random_prompts
from speculators_v016.checks.fidelity import FLIPPED_ROWS
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.engine.generation import Generation
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.testing import gpu_kit
from speculators_v016.testing.tiny_quant import build_tiny_w4a16_moe

SKIP = vllm_on_cuda()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
if SKIP is None:
    os.environ["VLLM_MLA_DISABLE"] = (
        "0"  # MLA on (tests/conftest.py turns it off for the CPU tiers); see test_moe_mla_gpu
    )

LAYERS = 4
LENGTHS = [40, 200, 3, 90]  # 333 tokens: one step (prompts across steps are the MLA tier's)
NEW = 24  # greedy tokens per prompt: 4 decode tokens a step, 16/16 = 1 <= 6 (tokens x top-k / experts): moe_wna16_gemm
ENGINE = dict(layer_ids=list(range(LAYERS)), max_model_len=512, dtype="bfloat16", max_num_batched_tokens=512,
              max_num_seqs=4, gpu_memory_utilization=0.25)  # fmt: skip
MODES = {"eager": True, "compiled": False}  # enforce_eager
METHOD = "CompressedTensorsWNA16MoEMethod"


@pytest.fixture(scope="module")
def stand_ins():
    """Every stand-in of the GPU kit registered in this process before any engine starts."""
    report = gpu_kit.install()
    print(f"\nstand-ins: {report}")
    return report


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    """(the W4A16 checkpoint, its float32 twin), as strings."""
    quantized, twin = build_tiny_w4a16_moe(tmp_path_factory.mktemp("int4-moe"), "deepseek_v3_mla", num_layers=LAYERS)
    return str(quantized), str(twin)


@pytest.fixture(scope="module")
def reference(int4):
    """transformers in float32 on the twin, every decoder layer, per prompt (CPU)."""
    return hf_layer_outputs(int4[1], random_prompts(LENGTHS, seed=3))


def moe_methods(gen) -> list[str]:
    """The class of the quantization method of every FusedMoE layer of the loaded model (uniprocess)."""
    from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: PLC0415 - vLLM: GPU host only

    model = gen.engine.executor.driver_worker.worker.model_runner.get_model()
    return [type(m.quant_method).__name__ for m in model.modules() if isinstance(m, FusedMoE)]


def wna16_calls() -> int:
    """How often the ``moe_wna16_gemm`` stand-in has run in this process (its Python body: eager steps, and the
    captures of CUDA graphs, whose replays run it without Python)."""
    from speculators_v016.testing import wna16_ops  # noqa: PLC0415 - the kit's stand-ins, GPU host only

    return wna16_ops.CALLS["moe_wna16_gemm"]


@pytest.fixture(scope="module", params=list(MODES))
def run(request, stand_ins, int4):
    """One engine per mode: prefill capture with the logit check (and, eager, vLLM's own layers), then greedy
    generation (decode steps) and a prefill of the final sequences."""
    mode = request.param
    model_dir = int4[0]
    prompts = random_prompts(LENGTHS, seed=3)
    torch.cuda.empty_cache()
    with VllmHiddenStatesGenerator(model_dir, enforce_eager=MODES[mode], extra_engine_args=family_engine_args("TRITON_MLA"),
                                   **ENGINE) as gen:  # fmt: skip
        engine = gen.engine
        info, methods = engine.capture_info[0], moe_methods(gen)
        checker = LogitChecker(model_dir, engine.dtype, LAYERS - 1)
        results = [None] * len(prompts)
        for index, ids, states in engine.stream(enumerate(prompts), prompt_logprobs=lambda _: checker.active):
            results[index] = [s.cpu() for s in states]
            if checker.active:
                checker.add(index, torch.tensor(ids), states, engine.prompt_logprobs.pop(index))
        independent = vllm_layer_outputs(gen, prompts[1][:100]) if MODES[mode] else None
        groups = engine.executor.driver_worker.worker.model_runner.attn_groups
        backend = ",".join(sorted({g.backend.get_name() for by_spec in groups for g in by_spec}))
        del groups
        calls_before = wna16_calls()
        feed = ((i, p, Generation(NEW)) for i, p in enumerate(prompts))
        greedy = {key: (list(ids), [s.cpu() for s in states], engine.generated.pop(key).token_ids)
                  for key, ids, states in engine.stream(feed)}  # fmt: skip
        decode_calls = wna16_calls() - calls_before
        finals = [greedy[i][0] for i in range(len(prompts))]
        prefill = [[s.cpu() for s in r["hidden_states"]] for r in gen.generate(finals)]
    return dict(mode=mode, model_dir=model_dir, twin=int4[1], prompts=prompts, info=info, methods=methods, results=results,
                logit=checker.result, independent=independent, backend=backend, greedy=greedy, finals=finals,
                prefill=prefill, decode_calls=decode_calls, calls=wna16_calls())  # fmt: skip


def test_vllm_runs_the_experts_through_its_triton_wna16_method(run, stand_ins):
    """Every MoE layer is quantized by CompressedTensorsWNA16MoEMethod (Marlin steered away: the kit has none);
    attention is TRITON_MLA; the states come back bf16, one per prompt and layer."""
    print(f"\nINT4 ({run['mode']}): MoE methods {run['methods']}, attention {run['backend']}")
    assert run["methods"] == [METHOD] * (LAYERS - 1), run["methods"]
    assert run["backend"] == "TRITON_MLA", run["backend"]
    for states, ids in zip(run["results"], run["prompts"]):
        assert len(states) == LAYERS and all(s.dtype == torch.bfloat16 and s.shape[0] == len(ids) for s in states)


def test_states_match_the_twin_in_transformers_per_row(run, reference, record_architecture):
    """Every layer (the last included) within the bf16 bounds of fp32 transformers on the dequantized twin; a row
    or a layer off far outside; the stream proof's margins; the logit check."""
    info = run["info"]
    layer_rows.assert_stream_margins(info)
    layers = [layer_rows.layer_figures(run["results"], reference, layer) for layer in range(LAYERS)]
    figures = {"mode": run["mode"], "backend": run["backend"], "moe_methods": run["methods"],
               "model_class": info["model_class"], "stream_margins": info["stream_margins"], "layers": layers,
               "logit_check": run["logit"].line()}  # fmt: skip
    print(f"\nINT4 W4A16 ({run['mode']}): logit check {figures['logit_check']}")
    layer_rows.print_layers(layers)
    save_figures(f"int4-moe-{run['mode']}", figures)
    assert run["logit"].ok and run["logit"].samples > 0, run["logit"].line()
    layer_rows.assert_layers_within_bounds(layers)
    record_architecture(
        "INT4 MoE (Kimi-K2.5 class)",
        info["model_class"],
        "built-in" if info["builtin_ids"] else "taps",
        f"H200, {run['mode']}",
        note=f"W4A16 pack-quantized group 32 (Kimi-K2.5's format), {METHOD} (Triton; moe_wna16_gemm stood in), "
        f"vs the dequantized twin: rows {layer_rows.layers_note(layers)}, MLA on (TRITON_MLA)",
        dtype="bfloat16",
        device=f"cuda-{run['mode']}",
    )


def test_taps_equal_vllms_own_layers(run):
    """Eager: our taps equal vLLM's own decoder-layer outputs bit for bit (compiled graphs skip hooks added later)."""
    if run["independent"] is None:
        pytest.skip("compiled mode: hooks added after compilation do not run inside vLLM's graphs")
    ours, theirs = run["independent"]
    assert len(ours) == len(theirs) == LAYERS
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_decode_steps_run_moe_wna16_gemm_and_match_a_prefill(run):
    """Greedy decode steps (4 tokens: 4 x top-4 / 16 experts = 1 <= 6) reach the moe_wna16_gemm stand-in (eager:
    both GEMMs of every MoE layer, every decode step; compiled: in the CUDA graphs' captures); the states captured
    while decoding sit within the bounds of a prefill of the final sequences and of transformers on the twin."""
    moe_layers, steps = LAYERS - 1, NEW - 1  # the first token comes from the prefill step
    print(f"\nINT4 ({run['mode']}): moe_wna16_gemm stand-in ran {run['decode_calls']} times while decoding, "
          f"{run['calls']} in all")  # fmt: skip
    if run["mode"] == "eager":
        assert run["decode_calls"] >= steps * moe_layers * 2, run["decode_calls"]
    else:
        assert run["calls"] > 0
    decoded = [run["greedy"][i][1] for i in range(len(run["prompts"]))]
    reference = hf_layer_outputs(run["twin"], run["finals"])
    figures = {"mode": run["mode"], "decode_calls": run["decode_calls"], "calls": run["calls"], "layers": []}
    for layer in range(LAYERS):
        vs_prefill = layer_rows.layer_figures(decoded, run["prefill"], layer)
        vs_twin = layer_rows.layer_figures(decoded, reference, layer)
        figures["layers"].append({"layer": layer, "vs_prefill": vs_prefill, "vs_transformers": vs_twin})
        for f in (vs_prefill, vs_twin):
            assert f["median_row"] <= MEDIAN_BOUND and f["past_row_bound"] <= FLIPPED_ROWS, (layer, f)
    save_figures(f"int4-moe-greedy-{run['mode']}", figures)


def test_greedy_tokens_are_vllms_own_loop(stand_ins, int4, tmp_path, run):
    """Compiled: the greedy tokens through our loop are LLMEngine's, token for token (its core in a process of its
    own with the same stand-ins, Marlin steered the same way)."""
    if run["mode"] != "compiled":
        pytest.skip("vLLM's own loop is compared with the compiled engine (what users run)")
    engine = dict(dtype="bfloat16", max_model_len=ENGINE["max_model_len"], enforce_eager=False,
                  max_num_batched_tokens=ENGINE["max_num_batched_tokens"], max_num_seqs=ENGINE["max_num_seqs"],
                  gpu_memory_utilization=ENGINE["gpu_memory_utilization"], **family_engine_args("TRITON_MLA"))  # fmt: skip
    sampling = {"max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    theirs = vllm_loop(tmp_path, int4[0], run["prompts"], engine, sampling, stand_ins=True)["tokens"]
    ours = [run["greedy"][i][2] for i in range(len(run["prompts"]))]
    save_figures("int4-moe-greedy-vs-vllm-loop", {"tokens_equal": [a == b for a, b in zip(ours, theirs)]})
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"prompt {i}: ours {a} vLLM's {b}"


# -- the real command, through the kit's module (stand-ins in its process) ------------------------------------------
@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("int4-cli") / "chats.jsonl", conversations(COUNT, seed=11))


def cli_env() -> dict:
    """The command's engine arguments: the kit's, with MLA's attention backend."""
    return {"SPECULATORS_DATA_GEN_ENGINE_ARGS": json.dumps(family_engine_args("TRITON_MLA"))}


@pytest.fixture(scope="module")
def cli_default(tmp_path_factory, int4, data_file):
    """Every option at its default (bf16 from the checkpoint, compiled, CUDA graphs, async scheduling, uni)."""
    out = tmp_path_factory.mktemp("int4-cli-default") / "out"
    result = run_cli(int4[0], data_file, out, stand_ins=True, env=cli_env())
    assert_ok(result)
    save_figures(
        "int4-moe-cli-default", {"summary": [line for line in result.output.splitlines() if ":" in line][-10:]}
    )
    return out


def test_cli_default_run_passes_its_checks(cli_default):
    """The default run on the INT4 target: logit check and verify pass (assert_ok), every sample written."""
    assert len(load_all(cli_default)) == COUNT


def test_cli_fp8_storage_is_within_its_bound(tmp_path, int4, data_file, cli_default):
    """--hidden-states-dtype fp8_e4m3 on the INT4 target: checks pass, each row within 2**-4 of its largest |value|
    of the bf16 run's (e4m3's 3 bits; the two runs' own bf16 noise is far smaller)."""
    out = tmp_path / "out"
    result = run_cli(int4[0], data_file, out, "--hidden-states-dtype", "fp8_e4m3", stand_ins=True, env=cli_env())
    assert_ok(result)
    worst = layer_rows.fp8_worst_error(out, cli_default)
    save_figures("int4-moe-cli-fp8-vs-bf16", {"worst_error_over_row_amax": worst})
    assert worst <= 2**-4


def test_cli_greedy_regenerate_runs_its_checks(tmp_path, int4, data_file):
    """--regenerate, greedy, on the INT4 target: decode steps (moe_wna16_gemm) captured, logit check, verify."""
    out = tmp_path / "out"
    result = run_cli(int4[0], data_file, out, "--regenerate", "--temperature", 0, "--max-new-tokens", 24,
                     stand_ins=True, env=cli_env())  # fmt: skip
    assert result.exit_code == 0, result.output[-6000:]
    assert re.search(r"logit check: ok", result.output) and "verify:     ok" in result.output, result.output
    save_figures(
        "int4-moe-cli-regenerate", {"summary": [line for line in result.output.splitlines() if ":" in line][-10:]}
    )
