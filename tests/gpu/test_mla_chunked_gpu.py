"""MLA across engine steps: DeepSeek-V3 (MLA's real geometry, ``TRITON_MLA``) with prompts of thousands of tokens
split over many steps by chunked prefill, on vLLM 0.16's own GPU path (GPU kit), bf16, eager and compiled.

A prompt longer than what a step has room for continues in the next steps; there vLLM's MLA
(``_compute_prefill_context``) gathers the latent cache rows of the earlier positions into its
workspace (``_C_cache_ops.gather_and_maybe_dequant_cache``), attends to them without a mask and merges
that with the new tokens' causal attention by their log-sum-exps (``_C.merge_attn_states``): the torch
stand-ins of :mod:`speculators_v016.testing.mla_ops`, checked against loops in
``tests/engine/test_mla_ops.py``; everything else as in ``tests/gpu/test_moe_mla_gpu.py`` (the routing,
alignment and activation stand-ins of :mod:`~speculators_v016.testing.moe_ops` and
:mod:`~speculators_v016.testing.act_ops`; vLLM's Triton MoE GEMMs, MLA decode kernel and its own
scheduler). 256 tokens a step, prompts of 2,800 and 2,100 tokens beside 45, 7 and 300 (the longest over
11 steps and more), four at a time, two steps in flight (async scheduling, our default), ``max_model_len``
4096. Per mode (eager; compiled with CUDA graphs), one engine (the fixtures return data, engines shut down):

* the path was taken: the gather and merge stand-ins ran, at least once per layer and step that continued a
  prefill, every long prompt arrived in three pieces or more, two steps were in flight;
* every captured layer (the last on the final norm's input) within the bf16 bounds of transformers in float32
  per row (``helpers.families.judge``: median, routing-flip share, a row one position off and the
  neighbouring layer far outside, the stream proof's margins, the logit check);
* eager: a fault planted in our assembly (the first row of every later piece of a prompt replaced by the last
  row of the piece before) fails the row judgement at every layer exactly at the chunk boundaries;
* compiled: greedy generation after the long prompts through our loop samples vLLM's own loop's tokens
  (``LLMEngine``, its core in a process of its own with the same stand-ins), and the states captured while
  generating sit within the bounds of a prefill of the final sequences and of transformers.

Figures are printed (``-s``) and kept under ``SPECULATORS_GPU_FIGURES``; the architecture table gains the row
``deepseek_v3 (MLA across steps)``. Skips without CUDA or where vLLM's CUDA platform does not load.
"""

from __future__ import annotations

import os
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from helpers.families import LAYERS, MEDIAN_BOUND, ROW_BOUND, SEPARATION, judge
from helpers.gpu import engine_args, save_figures, vllm_loop, vllm_on_cuda
from helpers.layer_rows import judged
from helpers.reference import hf_layer_outputs, random_prompts
from speculators_v016.checks.fidelity import FLIPPED_ROWS, row_errors
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.engine.assembly import Assembler
from speculators_v016.engine.generation import Generation
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.testing import act_ops, mla_ops, moe_ops

SKIP = vllm_on_cuda()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
if SKIP is None:
    # MLA on (the CPU tiers set VLLM_MLA_DISABLE=1; vLLM reads it at its first engine start in a process)
    os.environ["VLLM_MLA_DISABLE"] = "0"

ARCH = "deepseek_v3_mla"
NAME = "deepseek_v3 (MLA across steps)"  # its own row of the architecture table (deepseek_v3's is one step)
STEP = 256  # max_num_batched_tokens
LENGTHS = [2800, 45, 2100, 7, 300]
LONG = [i for i, n in enumerate(LENGTHS) if n > 2 * STEP]  # over three steps at least
ENGINE = dict(layer_ids=list(range(LAYERS)), max_model_len=4096, dtype="bfloat16", max_num_batched_tokens=STEP,
              max_num_seqs=4, gpu_memory_utilization=0.25)  # fmt: skip
MODES = {"eager": True, "compiled": False}  # enforce_eager
NEW = 24  # tokens generated after each prompt of the greedy test
GREEDY = 4  # its prompts: the first four, all running at once (max_num_seqs), so both loops schedule alike
DTYPE = torch.bfloat16
MEDIAN, ROW = MEDIAN_BOUND[DTYPE], ROW_BOUND[DTYPE]


def without_repeats(prompt: list[int]) -> list[int]:
    """No token equal to the one before it (a row planted from its predecessor must differ from its own)."""
    out = list(prompt)
    for i in range(1, len(out)):
        if out[i] == out[i - 1]:
            out[i] = 5 + (out[i] - 5 + 1) % 395  # random_prompts' range, 5..399
    return out


PROMPTS = [without_repeats(p) for p in random_prompts(LENGTHS, seed=5)]


def mla_engine_args() -> dict:
    """The kit's engine arguments with MLA's Triton backend."""
    args = engine_args()
    return {**args, "attention_config": {**args.get("attention_config", {}), "backend": "TRITON_MLA"}}


class Pieces:
    """What the assembler was handed, step by step: (prompt key, first position, rows) per prompt piece."""

    def __init__(self):
        self.steps: list[list[tuple]] = []

    def starts(self) -> dict:
        """{key: the first positions of its pieces, in order}."""
        out: dict = {}
        for step in self.steps:
            for key, start, _ in step:
                out.setdefault(key, []).append(start)
        return {key: sorted(starts) for key, starts in out.items()}

    def boundaries(self) -> dict:
        """{key: positions where a later piece of the prompt begins}."""
        return {key: [s for s in starts if s > 0] for key, starts in self.starts().items()}

    def steps_with_context(self) -> int:
        """Steps in which a prompt continued with more than one row (a prefill with earlier context: MLA's
        context path; a one-row piece runs as a decode)."""
        return sum(any(start > 0 and rows > 1 for _, start, rows in step) for step in self.steps)


@contextmanager
def watched_assembly(pieces: Pieces, plant: bool = False):
    """Record each step's pieces as the assembler receives them; ``plant``: the fault, the first row of every later
    piece of a prompt overwritten with the row before it (in every captured layer), after the real assembly."""
    real_add, real_rows = Assembler.add, Assembler._add_rows

    def add(self, capture, release=None):
        requests = self._requests  # their keys: (the prompt's key, ids, request id)
        pieces.steps.append([(requests[r].key[0], start, rows) for r, start, rows in
                             zip(capture.req_ids, capture.starts, capture.counts)
                             if r in requests and start < requests[r].prompt_len])  # prompt rows only  # fmt: skip
        real_add(self, capture, release)

    def repeat_previous_row(self, req_id, start, rows, scales, pairs, finite=False):
        real_rows(self, req_id, start, rows, scales, pairs, finite)
        req = self._requests.get(req_id)
        if req is not None and req.pieces is None and 0 < start < req.prompt_len:
            pairs += [(out[start], out[start - 1]) for out in req.out]  # copied after the real rows, in order

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Assembler, "add", add)
        if plant:
            patch.setattr(Assembler, "_add_rows", repeat_previous_row)
        yield pieces


@pytest.fixture(scope="module")
def stand_ins():
    """The torch stand-ins registered in this process before any engine starts (uniprocess: the worker is here)."""
    report = {"moe": moe_ops.install(), "act": act_ops.install(), "mla": mla_ops.install()}
    print(f"\nstand-ins: {report}")
    return report


@pytest.fixture(scope="module")
def mla_model(tiny_model):
    return tiny_model(ARCH, LAYERS)


@pytest.fixture(scope="module")
def reference(mla_model):
    """transformers in float32 (CPU), every decoder layer of PROMPTS."""
    return hf_layer_outputs(mla_model, PROMPTS)


def run_mode(mode: str, model_dir: str) -> dict:
    """One engine: PROMPTS captured (logit check on, pieces recorded, stand-in calls counted); eager, the same again
    with the fault planted; compiled, greedy generation after the first GREEDY prompts and a prefill of the finals."""
    out: dict = {"mode": mode}
    before = Counter(mla_ops.CALLS)
    torch.cuda.empty_cache()
    with VllmHiddenStatesGenerator(model_dir, enforce_eager=MODES[mode], extra_engine_args=mla_engine_args(),
                                   **ENGINE) as gen:  # fmt: skip
        engine = gen.engine
        checker = LogitChecker(model_dir, engine.dtype, LAYERS - 1)
        results = [None] * len(PROMPTS)
        with watched_assembly(Pieces()) as pieces:
            for index, ids, states in engine.stream(enumerate(PROMPTS), prompt_logprobs=lambda _: checker.active):
                results[index] = states
                if checker.active:
                    checker.add(index, torch.tensor(ids), states, engine.prompt_logprobs.pop(index))
        out.update(info=engine.capture_info[0], results=results, logit=checker.result, pieces=pieces,
                   calls=dict(Counter(mla_ops.CALLS) - before), in_flight=engine.stats.max_in_flight,
                   dtype=engine.dtype)  # fmt: skip
        if mode == "eager":
            with watched_assembly(Pieces(), plant=True) as planted:
                out["planted"] = [r["hidden_states"] for r in gen.generate(PROMPTS)]
            out["planted_pieces"] = planted
        else:
            feed = ((i, p, Generation(NEW)) for i, p in enumerate(PROMPTS[:GREEDY]))
            generated = {
                key: (list(ids), states, engine.generated.pop(key)) for key, ids, states in engine.stream(feed)
            }
            out["finals"] = [generated[i][0] for i in range(GREEDY)]
            out["decoded"] = [generated[i][1] for i in range(GREEDY)]
            out["tokens"] = [generated[i][2].token_ids for i in range(GREEDY)]
            out["prefill"] = [r["hidden_states"] for r in gen.generate(out["finals"])]
        groups = engine.executor.driver_worker.worker.model_runner.attn_groups
        out["backend"] = ",".join(sorted({g.backend.get_name() for by_spec in groups for g in by_spec}))
        del groups
    torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def eager(stand_ins, mla_model):
    return run_mode("eager", mla_model)


@pytest.fixture(scope="module")
def compiled(stand_ins, mla_model):
    return run_mode("compiled", mla_model)


@pytest.fixture(params=list(MODES))
def run(request):
    return request.getfixturevalue(request.param)


def test_the_context_path_was_taken(run):
    """TRITON_MLA; long prompts in 3+ pieces, two steps in flight; the gather and merge stand-ins ran every such step."""
    pieces, calls = run["pieces"], run["calls"]
    starts = pieces.starts()
    figures = {"mode": run["mode"], "backend": run["backend"], "pieces": {i: len(starts[i]) for i in starts},
               "steps": len(pieces.steps), "steps_with_context": pieces.steps_with_context(), "calls": calls,
               "in_flight": run["in_flight"]}  # fmt: skip
    save_figures(f"mla-chunked-path-{run['mode']}", figures)
    assert run["backend"] == "TRITON_MLA", run["backend"]
    assert run["info"]["async_scheduling"] and run["in_flight"] == 2, figures
    assert all(len(starts[i]) >= 3 and starts[i][0] == 0 for i in LONG), figures
    assert pieces.steps_with_context() >= 3, figures
    assert calls.get("gather_and_maybe_dequant_cache", 0) >= LAYERS * pieces.steps_with_context(), figures
    assert calls.get("merge_attn_states", 0) >= calls["gather_and_maybe_dequant_cache"], figures


def test_states_match_transformers_per_row(run, mla_model, reference, record_architecture):
    """Every layer within the bf16 bounds of fp32 transformers (flips counted), one row / one layer off far; logits."""
    info = run["info"]
    figures = judge("deepseek_v3", mla_model, info, run["results"], run["logit"], None, DTYPE, PROMPTS, reference)
    layers = [dict(layer=i, median_row=m, worst_row=w, past_row_bound=f) for i, (m, w, f) in enumerate(figures)]
    save_figures(f"mla-chunked-{run['mode']}", {"mode": run["mode"], "backend": run["backend"], "layers": layers,
                                                 "logit_check": run["logit"].line(), "lengths": LENGTHS,
                                                 "step": STEP})  # fmt: skip
    median, worst, flipped = (max(f[k] for f in figures) for k in range(3))
    record_architecture(
        NAME,
        info["model_class"],
        "built-in" if info["builtin_ids"] else "taps",
        f"H200, {run['mode']}",
        note=f"rows: median {median:.1e}, worst {worst:.1e}, {flipped:.1%} past {ROW:g} (routing flips); "
        f"MLA across steps: prompts up to {max(LENGTHS):,} tokens at {STEP} a step (TRITON_MLA, chunked prefill)",
        dtype="bfloat16",
        device=f"cuda-{run['mode']}",
    )


def test_a_row_planted_at_each_chunk_boundary_fails_exactly_there(eager, reference):
    """Eager, our assembly faulted: each later piece's first row = the row before; those rows fail, no other does."""
    planted, boundaries = eager["planted"], eager["planted_pieces"].boundaries()
    assert all(len(boundaries.get(i, [])) >= 2 for i in LONG), boundaries
    figures = []
    for layer in range(LAYERS):
        at, elsewhere = [], []
        for i, (states, ref) in enumerate(zip(planted, reference)):
            mask = torch.zeros(len(ref[layer]), dtype=torch.bool)
            mask[boundaries.get(i, [])] = True
            assert all(torch.equal(states[layer][b], states[layer][b - 1]) for b in boundaries.get(i, []))  # in place
            rows = row_errors(states[layer], ref[layer])
            at.append(rows[mask])
            elsewhere.append(rows[~mask])
            if layer == 0:  # the dense first layer: no routing flips, every clean row within the row bound
                assert (row_errors(eager["results"][i][0], ref[0]) <= ROW).all(), i
                assert torch.equal(rows > ROW, mask), (i, torch.nonzero(rows > ROW).flatten(), boundaries.get(i))
        at, elsewhere = torch.cat(at), torch.cat(elsewhere)
        figures.append(dict(layer=layer, boundary_rows=len(at), boundary_min=at.min().item(),
                            boundary_median=at.median().item(), other_median=elsewhere.median().item(),
                            other_past_row_bound=(elsewhere > ROW).float().mean().item()))  # fmt: skip
    save_figures("mla-chunked-planted-boundary-rows", {"layers": figures, "boundaries": boundaries})
    for f in figures:
        assert f["boundary_min"] > ROW and f["boundary_median"] >= SEPARATION * MEDIAN, f
        assert f["other_median"] <= MEDIAN and f["other_past_row_bound"] <= FLIPPED_ROWS, f


def test_greedy_after_long_prompts_is_vllms_loop(compiled, mla_model, tmp_path):
    """Compiled: greedy tokens after the long prompts are LLMEngine's; states captured while decoding within the
    bounds of a prefill of the final sequences and of transformers."""
    loop_engine = dict(dtype="bfloat16", max_model_len=ENGINE["max_model_len"], enforce_eager=False,
                       max_num_batched_tokens=STEP, max_num_seqs=ENGINE["max_num_seqs"],
                       gpu_memory_utilization=ENGINE["gpu_memory_utilization"], **mla_engine_args())  # fmt: skip
    sampling = {"max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    theirs = vllm_loop(tmp_path, mla_model, PROMPTS[:GREEDY], loop_engine, sampling, stand_ins=True)["tokens"]
    reference = hf_layer_outputs(mla_model, compiled["finals"])
    figures = {"prompts": LENGTHS[:GREEDY], "new_tokens": NEW, "layers": []}
    for layer in range(LAYERS):
        figures["layers"].append({"layer": layer, "vs_prefill": judged(compiled["decoded"], compiled["prefill"], layer),
                                  "vs_transformers": judged(compiled["decoded"], reference, layer)})  # fmt: skip
    figures["tokens_equal"] = [ours == tokens for ours, tokens in zip(compiled["tokens"], theirs)]
    save_figures("mla-chunked-greedy", figures)
    assert all(len(ids) == n + NEW for ids, n in zip(compiled["finals"], LENGTHS))
    for i, tokens in enumerate(theirs):
        assert compiled["tokens"][i] == tokens, f"prompt {i}: ours {compiled['tokens'][i]} vLLM's {tokens}"
    for f in figures["layers"]:
        for judgement in (f["vs_prefill"], f["vs_transformers"]):
            assert judgement["median_row"] <= MEDIAN and judgement["past_row_bound"] <= FLIPPED_ROWS, f
