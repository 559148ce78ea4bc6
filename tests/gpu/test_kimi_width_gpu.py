"""Kimi-K2.5's real width on one H200: a 3-layer slice of its geometry, INT4 experts, prompts of 1k-8k tokens.

The slice (:func:`speculators_v016.testing.kimi_slice.build_kimi_slice`): hidden 7168, 64 heads of MLA
(q LoRA 1536, kv LoRA 512, rope 64, nope 128, v 128, YaRN x32), a dense first layer (MLP 18432), then
two MoE layers of 384 routed experts (8 a token, one group, sigmoid with correction bias, x 2.827) in
Kimi-K2.5's W4A16 ``pack-quantized`` format (~9.5 GB a layer, written from random codes and scales) and
one shared expert, vocabulary 163,840; random weights at scales that keep the stream near unit size;
~25.3 GB of safetensors, written under a temporary folder (generated on the GPU) and deleted at the end.

One compiled engine (CUDA graphs, bf16, 8192 tokens a step, TRITON_MLA, the kit's stand-ins:
:mod:`speculators_v016.testing.gpu_kit`) takes prompts of 1k-8k tokens (most of them span steps:
MLA's chunked prefill with earlier context), two steps in flight. Asserted: vLLM quantized every MoE
layer with ``CompressedTensorsWNA16MoEMethod``; the start-up stream proof passed with margins
>= ``DIFFERENT_FACTOR``; every prompt comes back whole, every layer near unit size; the logit check
(captured last layer -> the checkpoint's norm and 163,840-row head, on the GPU -> vLLM's own prompt
logprobs) passes; the dense first layer's rows are within the bf16 bounds of transformers in float32
on the same tensors (:func:`~speculators_v016.testing.kimi_slice.first_layer_reference`: the one layer
that needs no expert). Printed: the build's bytes and rate, the start-up time, the capture ring's and
its pinned registration's sizes, the GPU staging, the pass's tokens/s. Skips without CUDA.
"""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from test_moe_mla_gpu import family_engine_args

from helpers.gpu import save_figures, vllm_on_cuda
from helpers.reference import random_prompts
from speculators_v016.checks.fidelity import FLIPPED_ROWS, ROW_BOUNDS, row_errors
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.testing import gpu_kit
from speculators_v016.testing.kimi_slice import build_kimi_slice, first_layer_reference, planned_bytes
from speculators_v016.worker.stream_proof import DIFFERENT_FACTOR

SKIP = vllm_on_cuda()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
if SKIP is None:
    os.environ["VLLM_MLA_DISABLE"] = (
        "0"  # MLA on (tests/conftest.py turns it off for the CPU tiers); see test_moe_mla_gpu
    )

LAYERS = 3
VOCAB = 163840
LENGTHS = [1024, 2048, 8000, 3000, 5000, 1500, 7000, 4096]  # 31,668 tokens: 4+ steps of 8192, most prompts span two
CHECKED = (0, 1)  # the logit check's prompts (1k and 2k tokens: vLLM's prompt logprobs over 163,840 entries a row)
MEDIAN_BOUND, ROW_BOUND = ROW_BOUNDS["bfloat16"]
ENGINE = dict(layer_ids=list(range(LAYERS)), max_model_len=8448, dtype="bfloat16", max_num_batched_tokens=8192,
              max_num_seqs=16, gpu_memory_utilization=0.5)  # fmt: skip  # ~25 GB of weights, the rest KV and steps
METHOD = "CompressedTensorsWNA16MoEMethod"
PROMPTS = random_prompts(LENGTHS, vocab=VOCAB - 5, seed=7)


@pytest.fixture(scope="module")
def stand_ins():
    """Every stand-in of the GPU kit registered in this process before the engine starts."""
    return gpu_kit.install()


@pytest.fixture(scope="module")
def kimi_slice(tmp_path_factory):
    """The 3-layer slice at Kimi's width, built on the GPU into a folder of its own; deleted after the module."""
    where = tmp_path_factory.mktemp("kimi-width")
    need, free = planned_bytes(LAYERS), shutil.disk_usage(where).free
    print(f"\nKimi slice: {need / 1e9:.1f} GB to write, {free / 1e9:.1f} GB free under {where}")
    start = time.perf_counter()
    try:
        folder = build_kimi_slice(where / "slice", LAYERS, device="cuda")
        built = {"bytes": need, "seconds": time.perf_counter() - start}
        torch.cuda.empty_cache()
        yield folder, built
    finally:
        shutil.rmtree(where / "slice", ignore_errors=True)  # the folder build_kimi_slice made


@pytest.fixture(scope="module")
def first_layer(kimi_slice):
    """transformers in float32 (on the GPU, no TF32) of the dense first layer, for the checked prompts; computed
    before the engine starts, its memory given back."""
    start = time.perf_counter()
    reference = first_layer_reference(kimi_slice[0], [PROMPTS[i] for i in CHECKED], device="cuda")
    torch.cuda.empty_cache()
    return reference, time.perf_counter() - start


def moe_methods(gen) -> list[str]:
    """The class of the quantization method of every FusedMoE layer of the loaded model (uniprocess)."""
    from vllm.model_executor.layers.fused_moe import FusedMoE  # noqa: PLC0415 - vLLM: GPU host only

    model = gen.engine.executor.driver_worker.worker.model_runner.get_model()
    return [type(m.quant_method).__name__ for m in model.modules() if isinstance(m, FusedMoE)]


def gpu_logit_checker(model_dir: str, dtype: torch.dtype) -> LogitChecker:
    """The logit check with the checkpoint's final norm and head moved to the GPU (163,840 x 7168: projecting 2k rows
    on the host would take longer than the run); the same arithmetic, fed GPU tensors."""
    checker = LogitChecker(model_dir, dtype, LAYERS - 1)
    if checker.head is not None:
        checker.head.head, checker.head.norm = checker.head.head.cuda(), checker.head.norm.cuda()
    return checker


@pytest.fixture(scope="module")
def run(stand_ins, kimi_slice, first_layer):
    """One compiled engine on the slice: its start-up, the prompts' states (first layer and the checked prompts kept
    whole, the rest summarised), the logit check, the capture ring and its pinned registration."""
    model_dir = str(kimi_slice[0])
    torch.cuda.empty_cache()
    start = time.perf_counter()
    with VllmHiddenStatesGenerator(model_dir, enforce_eager=False, extra_engine_args=family_engine_args("TRITON_MLA"),
                                   **ENGINE) as gen:  # fmt: skip
        started = time.perf_counter() - start
        engine = gen.engine
        info, methods = engine.capture_info[0], moe_methods(gen)
        capture = engine.executor.driver_worker.worker._speculators_capture
        memory = {"ring": engine.ring.spec.describe(), "ring_bytes": engine.ring.spec.total_bytes,
                  "pinned": bool(capture.ring is not None and capture.ring.pinned),
                  "pinned_bytes": capture.ring.spec.total_bytes if capture.ring is not None else 0,
                  "copy_path": info.get("copy_path"), "staging": info.get("staging")}  # fmt: skip
        checker = gpu_logit_checker(model_dir, engine.dtype)
        checked, lengths, rms = {}, {}, {}
        began = time.perf_counter()
        for index, ids, states in engine.stream(enumerate(PROMPTS), prompt_logprobs=lambda key: key in CHECKED):
            lengths[index] = (len(ids), [int(s.shape[0]) for s in states])
            rms[index] = [s.float().pow(2).mean().sqrt().item() for s in states]
            if index in CHECKED:
                checked[index] = [s.cpu() for s in states]
                logprobs = torch.as_tensor(engine.prompt_logprobs.pop(index)).cuda()
                checker.add(index, torch.tensor(ids, device="cuda"), [s.cuda() for s in states], logprobs)
        seconds = time.perf_counter() - began
    torch.cuda.empty_cache()
    return dict(info=info, methods=methods, memory=memory, logit=checker.result, checked=checked, lengths=lengths,
                rms=rms, started=started, seconds=seconds, built=kimi_slice[1], reference=first_layer)  # fmt: skip


def test_the_slice_starts_with_the_wna16_method_and_its_proofs(run):
    """vLLM quantizes both MoE layers with CompressedTensorsWNA16MoEMethod; the start-up stream proof passed for
    every captured layer and the final norm, each with a margin >= DIFFERENT_FACTOR."""
    info = run["info"]
    print(f"\nKimi width: built {run['built']['bytes'] / 1e9:.1f} GB in {run['built']['seconds']:.0f} s; engine "
          f"started in {run['started']:.0f} s; MoE methods {run['methods']}; model {info['model_class']}")  # fmt: skip
    print(f"  capture ring: {run['memory']['ring']}; pinned (cudaHostRegister): {run['memory']['pinned']}, "
          f"{run['memory']['pinned_bytes'] / 2**20:,.0f} MiB; copy path {run['memory']['copy_path']}, "
          f"GPU staging {run['memory']['staging']}")  # fmt: skip
    assert run["methods"] == [METHOD] * (LAYERS - 1), run["methods"]
    assert run["memory"]["pinned"] and run["memory"]["pinned_bytes"] == run["memory"]["ring_bytes"]
    margins = info["stream_margins"]
    assert len(margins) == LAYERS, margins  # ids 1, 2 (layers 0, 1) and 3 (the final norm's input)
    for line in margins.values():
        assert line.startswith(("layer", "final norm")), line
        if "margin" in line:
            assert float(line.rsplit("margin ", 1)[1].rstrip("x")) >= DIFFERENT_FACTOR, line


def test_long_prompts_come_back_whole_and_the_logit_check_passes(run):
    """Prompts of 1k-8k tokens at 8192 tokens a step: every layer of every prompt has its rows, the stream stays
    near unit size, and the logit check (the 1k and 2k prompts, 163,840-entry vocabulary) passes."""
    tokens = sum(LENGTHS)
    figures = {"tokens": tokens, "seconds": run["seconds"], "tokens_per_s": tokens / run["seconds"],
               "started_s": run["started"], "built": run["built"], "memory": run["memory"],
               "logit_check": run["logit"].line(), "layer_rms": run["rms"], "margins": run["info"]["stream_margins"]}  # fmt: skip
    print(f"\nKimi width: {tokens:,} tokens in {run['seconds']:.1f} s ({tokens / run['seconds']:,.0f} tokens/s, "
          f"compiled, uniprocess); logit check {figures['logit_check']}")  # fmt: skip
    print(f"  layer rms per prompt: { {i: [round(r, 2) for r in v] for i, v in run['rms'].items()} }")
    assert sorted(run["lengths"]) == list(range(len(PROMPTS)))
    for index, (length, rows) in run["lengths"].items():
        assert length == LENGTHS[index] and rows == [length] * LAYERS, (index, length, rows)
    assert all(0.1 < r < 100 for values in run["rms"].values() for r in values), run["rms"]
    assert run["logit"].ok and run["logit"].samples == len(CHECKED), run["logit"].line()
    save_figures("kimi-width", figures)


def test_the_dense_first_layer_matches_transformers_in_float32(run):
    """Layer 0 (MLA with YaRN and the 18432-wide MLP at Kimi's width) of the checked prompts, per row, within the bf16
    bounds of transformers in float32 on the same tensors; one row off lands far outside."""
    reference, seconds = run["reference"]
    rows = torch.cat([row_errors(run["checked"][i][0], ref) for i, ref in zip(CHECKED, reference)])
    shifted = torch.cat([row_errors(run["checked"][i][0][1:], ref[:-1]) for i, ref in zip(CHECKED, reference)])
    figures = {"median_row": rows.median().item(), "worst_row": rows.max().item(), "rows": len(rows),
               "past_row_bound": (rows > ROW_BOUND).float().mean().item(), "row_one_off_median": shifted.median().item(),
               "reference_seconds": seconds}  # fmt: skip
    print(f"\nKimi width, layer 0 vs transformers fp32: rows median {figures['median_row']:.2e}, worst "
          f"{figures['worst_row']:.2e}; one row off {figures['row_one_off_median']:.2f} ({seconds:.0f} s reference)")  # fmt: skip
    save_figures("kimi-width-first-layer", figures)
    assert figures["median_row"] <= MEDIAN_BOUND and figures["past_row_bound"] <= FLIPPED_ROWS, figures
    assert figures["worst_row"] <= ROW_BOUND, figures  # a dense layer: no routing to flip
    assert figures["row_one_off_median"] >= 8 * MEDIAN_BOUND, figures
