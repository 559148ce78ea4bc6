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

from helpers.reference import hf_layer_outputs, random_prompts
from speculators_v016.checks.fidelity import FLIPPED_ROWS, ROW_BOUNDS, row_errors
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.worker import aux_outputs
from speculators_v016.worker.stream_proof import DIFFERENT_FACTOR, StreamProofError

LAYERS = 4
LENGTHS = [40, 200, 3, 90]
ENGINE = dict(layer_ids=list(range(LAYERS)), max_model_len=512, enforce_eager=True, max_num_batched_tokens=128,
              max_num_seqs=3)  # fmt: skip
MEDIAN_BOUND = {d: ROW_BOUNDS[str(d).removeprefix("torch.")][0] for d in (torch.bfloat16, torch.float16)}
ROW_BOUND = {d: ROW_BOUNDS[str(d).removeprefix("torch.")][1] for d in (torch.bfloat16, torch.float16)}
SEPARATION = 8

MOE = {"qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2", "qwen2_moe", "glm4_moe", "gpt_oss", "ernie4_5_moe"}
DENSE = ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "olmo2", "cohere", "cohere2", "gpt_neox", "llama4",
         "exaone4"]  # fmt: skip
FAMILIES = DENSE + sorted(MOE)
#: LayerNorm final norms: no logit check (the layer replay of `check` covers them)
NO_LOGIT_CHECK = {"cohere", "cohere2", "gpt_neox"}
#: float16 where vLLM's CPU backend runs it: a fused add-norm, an MoE, a parallel block, a whole-stream layer
FP16 = ["llama", "mixtral", "cohere", "olmo2"]


def vllm_layer_outputs(gen, prompt: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Our states of one prompt, and vLLM's own stream after each decoder layer read with hooks (uniprocess)."""
    model = gen.engine.executor.driver_worker.worker.model_runner.get_model()
    layers = aux_outputs.find_decoder_stack(model).decoder.layers
    seen: dict[int, torch.Tensor] = {}
    # Command-R hands its input on as `residual`, EXAONE 4 a mid-layer stream: the stream is hidden_states alone
    parallel = type(layers[0]).__name__.startswith(("Cohere", "Exaone4"))

    def hook(index):
        def keep(module, args, out):
            hidden, residual = out if isinstance(out, tuple) else (out, None)
            stream = hidden if residual is None or parallel else hidden + residual
            seen.setdefault(index, stream[: len(prompt)].clone())

        return keep

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        [result] = gen.generate([prompt])
    finally:
        for handle in handles:
            handle.remove()
    return result["hidden_states"], [seen[i] for i in range(len(layers))]


def run_family(model_dir: str, dtype: str, arch: str):
    prompts = random_prompts(LENGTHS, seed=3)
    with VllmHiddenStatesGenerator(model_dir, dtype=dtype, **ENGINE) as gen:
        engine = gen.engine
        info = engine.capture_info[0]
        checker = LogitChecker(model_dir, engine.dtype, LAYERS - 1)
        results = [None] * len(prompts)
        for index, ids, states in engine.stream(enumerate(prompts), prompt_logprobs=lambda _: checker.active):
            results[index] = states
            if checker.active:
                checker.add(index, torch.tensor(ids), states, engine.prompt_logprobs.pop(index))
        ours, theirs = vllm_layer_outputs(gen, prompts[1][:100])
        engine_dtype = engine.dtype
    return info, results, checker.result, (ours, theirs), engine_dtype


def judge(arch, model_dir, info, results, logit, independent, dtype):
    """The assertions shared by bf16 and fp16: proof, margins, bounds, separation, logits, bit-for-bit taps."""
    ours, theirs = independent
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), f"{arch}: taps differ from vLLM's own layers"
    assert all(s.dtype == dtype for states in results for s in states)
    for line in info["stream_margins"].values():  # reported, and the proof's separation held
        assert line.startswith(("layer", "final norm")), line
        if "margin" in line:
            assert float(line.rsplit("margin ", 1)[1].rstrip("x")) >= DIFFERENT_FACTOR, line
    if arch in NO_LOGIT_CHECK:
        assert logit.unavailable and not logit.samples
    else:
        assert logit.ok and logit.samples > 0, logit.line()
    reference = hf_layer_outputs(model_dir, [list(r) for r in random_prompts(LENGTHS, seed=3)])
    figures = []
    for layer in range(LAYERS):
        rows = torch.cat([row_errors(s[layer], ref[layer]) for s, ref in zip(results, reference)])
        shifted = torch.cat([row_errors(s[layer][1:], ref[layer][:-1]) for s, ref in zip(results, reference)
                             if len(ref[layer]) > 1])  # fmt: skip
        other = layer - 1 if layer else layer + 1
        wrong = torch.cat([row_errors(s[layer], ref[other]) for s, ref in zip(results, reference)])
        median, flipped = rows.median().item(), (rows > ROW_BOUND[dtype]).float().mean().item()
        figures.append((median, rows.max().item(), flipped))
        assert median <= MEDIAN_BOUND[dtype], f"{arch} layer {layer}: median row error {median:.2e}"
        if arch in MOE:
            assert flipped <= FLIPPED_ROWS, f"{arch} layer {layer}: {flipped:.1%} rows beyond {ROW_BOUND[dtype]}"
        else:
            assert rows.max().item() <= ROW_BOUND[dtype], f"{arch} layer {layer}: row error {rows.max():.2e}"
        for what, err in (("rows one position off", shifted), ("the neighbouring layer", wrong)):
            assert err.median().item() >= SEPARATION * MEDIAN_BOUND[dtype], f"{arch} layer {layer}: {what}"
    return figures


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_in_bf16(arch, tiny_model, record_architecture):
    """bf16: the proof passes with its margin, states within the bf16 bounds of fp32 transformers, taps exact."""
    model_dir = tiny_model(arch, LAYERS)
    info, results, logit, independent, engine_dtype = run_family(model_dir, "bfloat16", arch)
    assert engine_dtype == torch.bfloat16
    figures = judge(arch, model_dir, info, results, logit, independent, torch.bfloat16)
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
    info, results, logit, independent, engine_dtype = run_family(model_dir, "float16", arch)
    assert engine_dtype == torch.float16
    judge(arch, model_dir, info, results, logit, independent, torch.float16)


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
