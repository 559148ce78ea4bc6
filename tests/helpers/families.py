"""What the bf16/fp16 family tests share, on CPU and on the GPU: the families, the per-row bounds and their
separation, vLLM's own layers read with hooks, and the judgement (see tests/engine/test_model_families_bf16.py)."""

from __future__ import annotations

import torch

from helpers.reference import hf_layer_outputs
from speculators_v016.checks.fidelity import FLIPPED_ROWS, ROW_BOUNDS, row_errors
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.worker import aux_outputs
from speculators_v016.worker.stream_proof import DIFFERENT_FACTOR

LAYERS = 4
MEDIAN_BOUND = {d: ROW_BOUNDS[str(d).removeprefix("torch.")][0] for d in (torch.bfloat16, torch.float16)}
ROW_BOUND = {d: ROW_BOUNDS[str(d).removeprefix("torch.")][1] for d in (torch.bfloat16, torch.float16)}
SEPARATION = 8

MOE = {"qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v2", "qwen2_moe", "glm4_moe", "gpt_oss", "ernie4_5_moe"}
DENSE = ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "olmo2", "cohere", "cohere2", "gpt_neox", "llama4",
         "exaone4"]  # fmt: skip
FAMILIES = DENSE + sorted(MOE)
#: LayerNorm final norms: no logit check (the layer replay of `check` covers them)
NO_LOGIT_CHECK = {"cohere", "cohere2", "gpt_neox"}


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
            seen.setdefault(index, stream[: len(prompt)].cpu().clone())  # CPU, as our states are

        return keep

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        [result] = gen.generate([prompt])
    finally:
        for handle in handles:
            handle.remove()
    return result["hidden_states"], [seen[i] for i in range(len(layers))]


def run_family(model_dir: str, dtype: str, prompts: list[list[int]], engine: dict, independent: bool = True):
    """(capture info, states per prompt, the logit check's result, (ours, vLLM's own layers) or None, dtype)."""
    with VllmHiddenStatesGenerator(model_dir, dtype=dtype, layer_ids=list(range(LAYERS)), **engine) as gen:
        engine = gen.engine
        info = engine.capture_info[0]
        checker = LogitChecker(model_dir, engine.dtype, LAYERS - 1)
        results = [None] * len(prompts)
        for index, ids, states in engine.stream(enumerate(prompts), prompt_logprobs=lambda _: checker.active):
            results[index] = states
            if checker.active:
                checker.add(index, torch.tensor(ids), states, engine.prompt_logprobs.pop(index))
        own = vllm_layer_outputs(gen, prompts[1][:100]) if independent else None
        engine_dtype = engine.dtype
    return info, results, checker.result, own, engine_dtype


def judge(arch, model_dir, info, results, logit, independent, dtype, prompts, reference=None):
    """The assertions shared by bf16 and fp16: proof, margins, bounds, separation, logits, bit-for-bit taps
    (``independent`` None: vLLM's own layers were not read, as in a compiled engine, whose graphs skip hooks).
    ``reference``: transformers' layers of ``prompts`` if already computed. Returns (median row, worst row, share
    past the row bound) per layer."""
    if independent is not None:
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
    reference = reference if reference is not None else hf_layer_outputs(model_dir, prompts)
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
