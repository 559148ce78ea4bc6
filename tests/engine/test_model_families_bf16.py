"""Every family of the architecture table on the CPU engine in bfloat16 (the dtype users run), a few in float16.

The start-up stream proof must pass (the same conventions as in float32, with
the margin it reports); every captured layer is compared with transformers in
float32 on the same weights, per row (token): ``||ours - theirs|| / ||theirs||``,
with the bounds ``check`` judges bf16 and fp16 engines by (``checks/fidelity.py``).

Bounds, and why: bfloat16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3);
vLLM rounds the weights to it and every activation after each operation, so a
row of a 4-layer model sits a few units of that away from float32 (medians
6e-3 to 1.3e-2 measured on every family). :data:`MEDIAN_BOUND` (2.5e-2) bounds
the median row of each layer; a dense family keeps every row within
:data:`ROW_BOUND` (5e-2). In an MoE a near-tied router flips its choice of
expert under bfloat16 rounding and that row takes another expert's output,
O(0.1-0.7) off, the target's own behaviour in that dtype: at most
:data:`FLIPPED_ROWS` of an MoE's rows may pass ``ROW_BOUND``, and our taps are
checked bit for bit against an independent reading of vLLM's own forward
(hooks on its decoder layers), which no flip can excuse. A wrong layer, or the
rows one position off, sit at medians of 0.24 to 1.9: :data:`SEPARATION`
times the median bound at least, asserted on the same data. float16 (11 bits)
sits 8x closer (medians ~1e-3) and is held to an 8x smaller bound.
"""

import pytest
import torch

from helpers.families import FAMILIES, LAYERS, ROW_BOUND, judge, run_family
from helpers.reference import random_prompts
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.worker import aux_outputs
from speculators_v016.worker.stream_proof import StreamProofError

LENGTHS = [40, 200, 3, 90]
ENGINE = dict(max_model_len=512, enforce_eager=True, max_num_batched_tokens=128, max_num_seqs=3)
PROMPTS = random_prompts(LENGTHS, seed=3)
#: float16 where vLLM's CPU backend runs it: a fused add-norm, an MoE, a parallel block, a whole-stream layer
FP16 = ["llama", "mixtral", "cohere", "olmo2"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_in_bf16(arch, tiny_model, record_architecture):
    """bf16: the proof passes with its margin, states within the bf16 bounds of fp32 transformers, taps exact."""
    model_dir = tiny_model(arch, LAYERS)
    info, results, logit, independent, engine_dtype = run_family(model_dir, "bfloat16", PROMPTS, ENGINE)
    assert engine_dtype == torch.bfloat16
    figures = judge(arch, model_dir, info, results, logit, independent, torch.bfloat16, PROMPTS)
    median, worst = max(f[0] for f in figures), max(f[1] for f in figures)
    flipped = max(f[2] for f in figures)
    record_architecture(
        arch,
        info["model_class"],
        "built-in" if info["builtin_ids"] else "taps",
        "engine (CPU, bf16)",
        note=f"rows: median {median:.1e}, worst {worst:.1e}"
        + (f", {flipped:.1%} past {ROW_BOUND[torch.bfloat16]:g} (MoE routing flips)" if flipped else ""),
        dtype="bfloat16",
    )


@pytest.mark.parametrize("arch", FP16)
def test_family_in_fp16(arch, tiny_model):
    """fp16: the same checks with bounds 8x tighter (11 significant bits against 8)."""
    model_dir = tiny_model(arch, LAYERS)
    info, results, logit, independent, engine_dtype = run_family(model_dir, "float16", PROMPTS, ENGINE)
    assert engine_dtype == torch.float16
    judge(arch, model_dir, info, results, logit, independent, torch.float16, PROMPTS)


@pytest.mark.parametrize("arch,wrong", [("llama", "drop the residual"), ("cohere", "add the residual")])
def test_a_wrong_tap_convention_is_refused_in_bf16(arch, wrong, tiny_model, monkeypatch):
    """Injected in bf16: taps that drop (fused add-norm) or add (parallel block) the residual refuse the start."""
    if wrong == "drop the residual":
        monkeypatch.setattr(aux_outputs, "tap_locations", lambda conv: conv.slots[:1])
    else:
        monkeypatch.setattr(aux_outputs, "tap_locations", lambda conv: (("arg", 1), ("arg", 2)))
    with pytest.raises(StreamProofError, match=r"aux id 2 \(tap\) at layer 2 \(\w+DecoderLayer\): recorded max abs"):
        VllmHiddenStatesGenerator(tiny_model(arch, LAYERS), dtype="bfloat16", capture_mode="taps",
                                  **{**ENGINE, "layer_ids": [1]})  # fmt: skip
