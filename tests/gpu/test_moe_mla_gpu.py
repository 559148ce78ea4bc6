"""DeepSeek-V3 with MLA on, Mixtral and Qwen3-MoE on vLLM 0.16's own GPU path (GPU kit), bf16, eager and compiled.

Runs with ``../shared/gpu-vllm`` (vLLM's Python code without its compiled libraries): the
compiled kernels of the fused-MoE and MLA paths are stood in for by torch
(:mod:`speculators_v016.testing.moe_ops`, :mod:`speculators_v016.testing.mla_ops`,
:mod:`speculators_v016.testing.act_ops`, each checked against loops in ``tests/engine``), installed in this process
before any engine starts (the uniprocess executor: the worker is this process). Around
them everything is vLLM's: its routers (DeepSeek's grouped ``noaux_tc`` routing compiled
by torch.compile), its Triton fused-MoE GEMMs, MLA with ``TRITON_MLA`` (absorbed decode
kernel, CUDA graphs in the compiled mode), Triton attention for the others.

Per (family, mode), one engine (module-scoped, shut down before the next):

* every captured layer, the last one included (the final norm's input), against
  transformers in float32 on the same weights, per row, within the bf16 bounds of
  :mod:`speculators_v016.checks.fidelity` (the median row; at most ``FLIPPED_ROWS`` of
  the rows past the row bound: routing flips under bf16 rounding, reported per layer);
* the same rows against the neighbouring layer and one position off sit at least
  ``SEPARATION`` times the median bound away (an off-by-one cannot pass);
* the start-up stream proof's margins, the logit check (vLLM's own prompt logprobs),
  and in eager mode our taps against vLLM's own decoder-layer outputs, bit for bit.

Then, compiled (MLA's decode kernel and CUDA graphs): greedy generation through our loop
samples vLLM's own loop's tokens (``LLMEngine``, its core in a process of its own with the
same stand-ins), and the states captured while decoding sit within the bounds of a prefill
capture of the final sequences and of transformers; and eager, a DeepSeek tap planted one
layer off (L+1 for L, the last one on the final norm's input) lands far outside the bounds.

Engine arguments: ``SPECULATORS_GPU_ENGINE_ARGS`` (JSON, set by the kit's install.sh)
merged into the engine's ``extra_engine_args``; DeepSeek's attention backend becomes
``TRITON_MLA`` (MLA needs the latent size 576: ``deepseek_v3_mla``). Every prompt here fits
in one engine step; prompts spanning several steps (MLA's prefill with earlier context: the
gather and merge stand-ins) run in ``tests/gpu/test_mla_chunked_gpu.py``.
Figures are printed (``-s``) and, with ``SPECULATORS_GPU_FIGURES`` set, written there
as JSON. Skips without CUDA or where vLLM's CUDA platform does not load.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import layer_rows
from helpers.families import vllm_layer_outputs
from helpers.gpu import engine_args, save_figures, vllm_loop, vllm_on_cuda
from helpers.layer_rows import MEDIAN_BOUND, ROW_BOUND, SEPARATION
from helpers.reference import hf_layer_outputs, random_prompts
from speculators_v016.checks.fidelity import FLIPPED_ROWS, row_errors
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.engine import core as engine_core
from speculators_v016.engine.generation import Generation
from speculators_v016.engine.stages import StagePlanError
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.testing import act_ops, mla_ops, moe_ops
from speculators_v016.worker import capture as worker_capture

SKIP = vllm_on_cuda()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
if SKIP is None:
    # MLA on: tests/conftest.py sets VLLM_MLA_DISABLE=1 for the CPU tiers, and vLLM freezes its environment
    # at the first engine start in a process, so this must hold before any engine (GPU only: the CPU suite
    # runs in one process with DeepSeek on plain attention).
    os.environ["VLLM_MLA_DISABLE"] = "0"

LAYERS = 4
LENGTHS = [40, 200, 3, 90]  # 333 tokens: one step (max_num_batched_tokens below); across steps: test_mla_chunked_gpu
ENGINE = dict(layer_ids=list(range(LAYERS)), max_model_len=512, dtype="bfloat16", max_num_batched_tokens=512,
              max_num_seqs=4, gpu_memory_utilization=0.25)  # fmt: skip
#: family -> (tiny architecture, attention backend)
FAMILIES = {"deepseek_v3_mla": ("deepseek_v3_mla", "TRITON_MLA"), "mixtral": ("mixtral", None),
            "qwen3_moe": ("qwen3_moe", None)}  # fmt: skip
MODES = {"eager": True, "compiled": False}  # enforce_eager
NEW = 24  # tokens generated per prompt: 333 + 4 x 24 tokens, the final sequences' prefill still one step
GREEDY = ["deepseek_v3_mla", "mixtral"]
CASES = [(family, mode) for family in FAMILIES for mode in MODES]


def family_engine_args(backend: str | None) -> dict:
    """The kit's engine arguments, with the family's attention backend where it needs its own."""
    args = engine_args()
    if backend is not None:
        args["attention_config"] = {**args.get("attention_config", {}), "backend": backend}
    return args


@pytest.fixture(scope="module")
def stand_ins():
    """The torch stand-ins registered in this process before any engine starts."""
    report = {"moe": moe_ops.install(), "act": act_ops.install(), "mla": mla_ops.install()}
    print(f"\nstand-ins: {report}")
    return report


@pytest.fixture(scope="module")
def tiny_models(tiny_model):
    return {family: tiny_model(arch, LAYERS) for family, (arch, _) in FAMILIES.items()}


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{m}" for f, m in CASES])
def run(request, stand_ins, tiny_models):
    """One engine per (family, mode): its states, capture info, logit check and (eager) independent reading."""
    family, mode = request.param
    model_dir = tiny_models[family]
    prompts = random_prompts(LENGTHS, seed=3)
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    with VllmHiddenStatesGenerator(model_dir, enforce_eager=MODES[mode],
                                   extra_engine_args=family_engine_args(FAMILIES[family][1]), **ENGINE) as gen:  # fmt: skip
        engine = gen.engine
        info = engine.capture_info[0]
        checker = LogitChecker(model_dir, engine.dtype, LAYERS - 1)
        results = [None] * len(prompts)
        for index, ids, states in engine.stream(enumerate(prompts), prompt_logprobs=lambda _: checker.active):
            results[index] = [s.cpu() for s in states]
            if checker.active:
                checker.add(index, torch.tensor(ids), states, engine.prompt_logprobs.pop(index))
        independent = vllm_layer_outputs(gen, prompts[1][:100]) if MODES[mode] else None
        groups = gen.engine.executor.driver_worker.worker.model_runner.attn_groups
        backend = ",".join(sorted({g.backend.get_name() for by_spec in groups for g in by_spec}))
        del groups
        dtype = engine.dtype
    torch.cuda.empty_cache()
    held_after = free_before - torch.cuda.mem_get_info()[0]
    return dict(held_after=held_after, family=family, mode=mode, model_dir=model_dir, prompts=prompts, info=info, results=results,
                logit=checker.result, independent=independent, backend=backend, dtype=dtype)  # fmt: skip


@pytest.fixture(scope="module")
def references(tiny_models):
    """transformers in float32 (CPU), every decoder layer, per family."""
    prompts = random_prompts(LENGTHS, seed=3)
    return {family: hf_layer_outputs(model_dir, prompts) for family, model_dir in tiny_models.items()}


def test_kernels_behind_the_stand_ins_match_torch(stand_ins):
    """vLLM's fused_experts (Triton GEMMs + stand-ins) and its FA2 wrapper (stand-in) against torch, on the GPU."""
    from vllm.config import VllmConfig, set_current_vllm_config  # noqa: PLC0415 - vLLM: GPU host only
    from vllm.model_executor.layers.fused_moe import fused_experts  # noqa: PLC0415 - vLLM: GPU host only
    from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: PLC0415 - vLLM: GPU host only

    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, inter, experts, topk = 77, 256, 128, 16, 4
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w1 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device="cuda", generator=g)[:topk] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, topk, device="cuda", generator=g)
    with set_current_vllm_config(VllmConfig()):
        got = fused_experts(x, w1, w2, weights, ids)
    want = torch.zeros(tokens, hidden, device="cuda")
    for k in range(topk):
        h = torch.einsum("th,tnh->tn", x.float(), w1[ids[:, k].long()].float())
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        want += weights[:, k : k + 1] * torch.einsum("tn,thn->th", act, w2[ids[:, k].long()].float())
    moe_rows = row_errors(got, want)
    lengths = [5, 100, 1, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(int(cu[-1]), 8, 192, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    out = flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=100,
                                 max_seqlen_k=100, softmax_scale=0.07, causal=True)  # fmt: skip
    ref, _ = mla_ops.varlen_attention(q.float(), k.float(), v.float(), cu, cu, 0.07, True)
    attn_rows = row_errors(out.flatten(1), ref.flatten(1))
    print(f"\nfused_experts vs torch: rows median {moe_rows.median():.2e}, max {moe_rows.max():.2e}; "
          f"FA2 stand-in via vLLM's wrapper: rows max {attn_rows.max():.2e}")  # fmt: skip
    assert moe_rows.median() <= MEDIAN_BOUND and moe_rows.max() <= ROW_BOUND
    assert attn_rows.max() <= 1e-2


def test_states_match_transformers_per_row(run, references, record_architecture):
    """Every layer (the last included) within the bf16 bounds of fp32 transformers; flips counted; proof, logits."""
    family, mode, info = run["family"], run["mode"], run["info"]
    reference = references[family]
    wanted = FAMILIES[family][1] or engine_args().get("attention_config", {}).get("backend")
    if wanted:  # the backend vLLM chose is the one asked for (MLA on for DeepSeek)
        assert run["backend"] == wanted, run["backend"]
    figures = {"family": family, "mode": mode, "backend": run["backend"], "model_class": info["model_class"],
               "aux_source": "built-in" if info["builtin_ids"] else "taps", "layers": []}  # fmt: skip
    layer_rows.assert_stream_margins(info)  # the proof held, with the margin it reports
    figures["stream_margins"] = info["stream_margins"]
    figures["layers"] = [layer_rows.layer_figures(run["results"], reference, layer) for layer in range(LAYERS)]
    figures["logit_check"] = run["logit"].line()
    print(f"\n{family} ({mode}, {run['backend']}): logit check {figures['logit_check']}")
    layer_rows.print_layers(figures["layers"], " (routing flips)")
    save_figures(f"moe-mla-{family}-{mode}", figures)
    assert run["logit"].ok and run["logit"].samples > 0, run["logit"].line()
    layer_rows.assert_layers_within_bounds(figures["layers"])
    layers = figures["layers"]
    mla = ", MLA on (TRITON_MLA)" if run["backend"] == "TRITON_MLA" else ""
    record_architecture(
        family.removesuffix("_mla"),
        info["model_class"],
        figures["aux_source"],
        f"H200, {mode}",
        note=f"rows: {layer_rows.layers_note(layers)}{mla}",
        dtype="bfloat16",
        device=f"cuda-{mode}",
    )


def test_taps_equal_vllms_own_layers(run):
    """Eager: our taps equal vLLM's own decoder-layer outputs bit for bit (hooks; compiled graphs skip hooks)."""
    if run["independent"] is None:
        pytest.skip("compiled mode: hooks added after compilation do not run inside vLLM's graphs")
    ours, theirs = run["independent"]
    assert len(ours) == len(theirs) == LAYERS
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), run["family"]


def test_a_shut_down_engine_gives_its_gpu_memory_back(run):
    """After shutdown the process holds at most 1 GiB more GPU memory than before (KV cache: 35 GiB an engine)."""
    print(f"\n{run['family']} ({run['mode']}): {run['held_after'] / 2**20:,.0f} MiB still held after shutdown")
    assert run["held_after"] <= 2**30


def test_bf16_states_and_cases(run):
    """States come back in bf16, one per prompt and layer, of the prompt's length."""
    assert run["dtype"] == torch.bfloat16
    for states, ids in zip(run["results"], run["prompts"]):
        assert len(states) == LAYERS and all(s.dtype == torch.bfloat16 and s.shape[0] == len(ids) for s in states)


@pytest.mark.parametrize("family", GREEDY)
def test_greedy_is_vllms_loop_and_decode_states_equal_a_prefill(family, stand_ins, tiny_models, tmp_path):
    """Compiled: greedy tokens are LLMEngine's; states captured while decoding within the bounds of a prefill."""
    model_dir, args = tiny_models[family], family_engine_args(FAMILIES[family][1])
    prompts = random_prompts(LENGTHS, seed=3)
    with VllmHiddenStatesGenerator(model_dir, enforce_eager=False, extra_engine_args=args, **ENGINE) as gen:
        engine = gen.engine
        feed = ((i, p, Generation(NEW)) for i, p in enumerate(prompts))
        ours = {key: (list(ids), [s.cpu() for s in states], engine.generated.pop(key))
                for key, ids, states in engine.stream(feed)}  # fmt: skip
        finals = [ours[i][0] for i in range(len(prompts))]
        prefill = [[s.cpu() for s in r["hidden_states"]] for r in gen.generate(finals)]
    loop_engine = dict(dtype="bfloat16", max_model_len=ENGINE["max_model_len"], enforce_eager=False,
                       max_num_batched_tokens=ENGINE["max_num_batched_tokens"], max_num_seqs=ENGINE["max_num_seqs"],
                       gpu_memory_utilization=ENGINE["gpu_memory_utilization"], **args)  # fmt: skip
    sampling = {"max_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
    theirs = vllm_loop(tmp_path, model_dir, prompts, loop_engine, sampling, stand_ins=True)["tokens"]
    decoded = [ours[i][1] for i in range(len(prompts))]
    reference = hf_layer_outputs(model_dir, finals)
    figures = {"family": family, "prompts": len(prompts), "new_tokens": NEW, "layers": []}
    for layer in range(LAYERS):
        vs_prefill, vs_hf = layer_rows.judged(decoded, prefill, layer), layer_rows.judged(decoded, reference, layer)
        figures["layers"].append({"layer": layer, "vs_prefill": vs_prefill, "vs_transformers": vs_hf})
    figures["tokens_equal"] = [ours[i][2].token_ids == tokens for i, tokens in enumerate(theirs)]
    save_figures(f"moe-mla-greedy-{family}", figures)
    for i, tokens in enumerate(theirs):
        assert ours[i][2].token_ids == tokens, f"prompt {i}: ours {ours[i][2].token_ids} vLLM's {tokens}"
    for f in figures["layers"]:
        for judgement in (f["vs_prefill"], f["vs_transformers"]):
            assert judgement["median_row"] <= MEDIAN_BOUND and judgement["past_row_bound"] <= FLIPPED_ROWS, f


def test_a_deepseek_tap_planted_one_layer_off_lands_outside_the_bounds(stand_ins, tiny_models, references, monkeypatch):
    """Planted fault, eager: each tap one layer late (the last on the final norm's input) is refused at start-up by
    the layer plan's check (the workers report ids 2..4 for 1..3); past that check, it fails the row judgement."""
    real = worker_capture.install_aux_outputs

    def one_layer_late(model, vllm_ids, mode="auto", *, check, stage=None):
        return real(model, [k + 1 for k in vllm_ids], mode, check=check, stage=stage)

    monkeypatch.setattr(worker_capture, "install_aux_outputs", one_layer_late)
    planted = [0, 1, 2]  # vLLM aux ids 1..3 become 2..4: layer L+1's input for L, the last the final norm's
    engine = dict(ENGINE, layer_ids=planted)
    args = family_engine_args(FAMILIES["deepseek_v3_mla"][1])
    with pytest.raises(StagePlanError, match=r"capture vLLM aux ids \[2, 3, 4\], the layer plan asks for \[1, 2, 3\]"):
        VllmHiddenStatesGenerator(tiny_models["deepseek_v3_mla"], enforce_eager=True, extra_engine_args=args, **engine)
    monkeypatch.setattr(engine_core, "check_stage_plan", lambda *args: [])  # the start-up check bypassed
    with VllmHiddenStatesGenerator(tiny_models["deepseek_v3_mla"], enforce_eager=True, extra_engine_args=args,
                                   **engine) as gen:  # fmt: skip
        assert gen.engine.capture_info[0]["tap_ids"] == [2, 3, 4]  # the fault is in place
        states = [[s.cpu() for s in r["hidden_states"]] for r in gen.generate(random_prompts(LENGTHS, seed=3))]
    figures = [layer_rows.judged(states, references["deepseek_v3_mla"], layer) for layer in planted]
    save_figures("moe-mla-planted-tap-one-layer-late", {"layers": figures})
    for f in figures:
        assert f["median_row"] >= SEPARATION * MEDIAN_BOUND, f
