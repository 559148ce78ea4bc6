"""The capture on vLLM 0.16's own GPU engine: every dense family in bf16, eager and compiled (CUDA graphs).

Each family runs the bf16 judgement of the CPU tier (``helpers.families``: the stream proof and its
margins, every layer per row against transformers in float32 within the bounds of
``checks/fidelity.py``, the neighbouring layer and rows one position off at least 8x outside, the
logit check, and in eager engines our taps bit for bit against vLLM's own layers read with hooks).
Prompts of 3 to 700 tokens with 256 tokens a step: chunked prefill, two steps in flight. On Llama,
compiled: async scheduling off gives the same states bit for bit, the multiprocess executor (workers
spawned) the same as the uniprocess one, and greedy generation through our loop vLLM's own loop's
tokens (``LLMEngine``), token for token, with the states captured while generating within the bounds
of a prefill of the final sequences. Skipped where vLLM's CUDA platform does not load; figures printed
(``-s``) and kept under ``SPECULATORS_GPU_FIGURES``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.families import DENSE, LAYERS, MEDIAN_BOUND, ROW_BOUND, SEPARATION, judge, run_family
from helpers.gpu import GPU_MEMORY, engine_args, requires_vllm_gpu, save_figures, vllm_loop
from helpers.reference import hf_layer_outputs, random_prompts
from speculators_v016.checks.fidelity import row_errors
from speculators_v016.engine.generation import Generation
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.testing import act_ops, moe_ops

pytestmark = requires_vllm_gpu


@pytest.fixture(scope="module", autouse=True)
def kernel_stand_ins():
    """Torch stand-ins for compiled ops the GPU kit lacks and vLLM looks up (Gemma's gelu_tanh_and_mul, GPT-2-style
    gelu_new, ...: act_ops)."""
    moe_ops.install()
    act_ops.install()


LENGTHS = [40, 200, 3, 90, 700, 17]
PROMPTS = random_prompts(LENGTHS, seed=3)
ENGINE = dict(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4, gpu_memory_utilization=GPU_MEMORY)
MODES = {"eager": True, "compiled": False}
NEW = 24  # tokens generated per prompt


def engine(mode: str, **more) -> dict:
    return dict(ENGINE, enforce_eager=MODES[mode], extra_engine_args=engine_args(), **more)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", DENSE)
def test_dense_family_on_the_gpu(arch, mode, tiny_model, record_architecture):
    """bf16 on vLLM's GPU engine: proof and margins, rows within the bounds of fp32 transformers, logits, taps."""
    model_dir = tiny_model(arch, LAYERS)
    info, results, logit, own, dtype = run_family(model_dir, "bfloat16", PROMPTS, engine(mode), mode == "eager")
    assert dtype == torch.bfloat16 and info["async_scheduling"]
    figures = judge(arch, model_dir, info, results, logit, own, torch.bfloat16, PROMPTS)
    median, worst = max(f[0] for f in figures), max(f[1] for f in figures)
    save_figures(
        f"family-{arch}-{mode}",
        {"median_row": median, "worst_row": worst, "margins": info["stream_margins"], "logit": logit.line()},
    )
    record_architecture(
        arch,
        info["model_class"],
        "built-in" if info["builtin_ids"] else "taps",
        f"H200, {mode}",
        note=f"rows: median {median:.1e}, worst {worst:.1e}",
        dtype="bfloat16",
        device=f"cuda-{mode}",
    )


def capture(model_dir: str, **options) -> tuple[dict, list[list[torch.Tensor]]]:
    """(capture info, every layer's states of PROMPTS) from one engine of ``options``."""
    with VllmHiddenStatesGenerator(
        model_dir, dtype="bfloat16", layer_ids=list(range(LAYERS)), **engine("compiled", **options)
    ) as gen:
        info = gen.engine.capture_info[0]
        return info, [r["hidden_states"] for r in gen.generate(PROMPTS)]


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama", LAYERS)


@pytest.fixture(scope="module")
def uni_async(llama):
    """The reference: Llama compiled, uniprocess executor, async scheduling on."""
    return capture(llama)


def max_difference(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    return max((x.float() - y.float()).abs().max().item() for p, q in zip(a, b) for x, y in zip(p, q))


def test_async_scheduling_off_gives_the_same_states(llama, uni_async):
    """Compiled, one step in flight instead of two: every state bit for bit the same."""
    info, states = capture(llama, async_scheduling=False)
    assert not info["async_scheduling"] and uni_async[0]["async_scheduling"]
    save_figures("llama-sync-vs-async", {"max_abs_difference": max_difference(states, uni_async[1])})
    assert max_difference(states, uni_async[1]) == 0.0


def test_the_multiprocess_executor_gives_the_same_states(llama, uni_async):
    """TP 1 through the mp executor (its worker spawned: forked ones cannot use CUDA): the uniprocess states
    within bf16 rounding (its own process may pick other GEMM kernels: measured 1 ulp at most), every row."""
    info, states = capture(llama, executor="mp")
    assert info["ring"] and info["async_scheduling"]
    rows = torch.cat([row_errors(a, b) for p, q in zip(states, uni_async[1]) for a, b in zip(p, q)])
    save_figures(
        "llama-mp-vs-uni",
        {"max_abs_difference": max_difference(states, uni_async[1]), "worst_row": rows.max().item()},
    )
    assert rows.max().item() <= ROW_BOUND[torch.bfloat16] / SEPARATION


FORK_PROBE = """
import json, os, sys
import torch

from speculators_v016.engine import core
from speculators_v016.generator import VllmHiddenStatesGenerator

if __name__ == "__main__":
    model, choice, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    assert torch.cuda.is_available() and not torch.cuda.is_initialized()  # GPUs counted, CUDA not initialised
    if choice == "vllm":  # before the fix: vLLM chooses the start method alone
        core.set_start_method = lambda device_type, executor_kind: None
    with VllmHiddenStatesGenerator(model, layer_ids=[1, 3], executor="mp", dtype="bfloat16", enforce_eager=True,
                                   max_model_len=256, gpu_memory_utilization=%r, extra_engine_args=extra) as gen:
        [result] = gen.generate([[5, 6, 7, 8, 9]])
    print("method", os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork"))
    print("captured", [tuple(h.shape) for h in result["hidden_states"]])
"""


def test_gpu_workers_are_spawned_where_vllm_would_fork_them(llama, tmp_path):
    """A driving program that counted GPUs (CUDA not initialised): vLLM alone forks the mp worker, ours spawns
    it, and the capture runs through it."""
    script = tmp_path / "fork_probe.py"
    script.write_text(FORK_PROBE % GPU_MEMORY)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_WORKER_MULTIPROC_METHOD"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    outcomes = {}
    for choice in ("vllm", "ours"):
        proc = subprocess.run([sys.executable, str(script), llama, choice, json.dumps(engine_args())],
                              capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
        outcomes[choice] = (proc.returncode, proc.stdout + proc.stderr)
    save_figures("fork-vs-spawn", {k: [v[0], [x for x in v[1].splitlines() if x.startswith(("method", "captured",
                 "RuntimeError"))]] for k, v in outcomes.items()})  # fmt: skip
    assert "method fork" in outcomes["vllm"][1] or "Cannot re-initialize CUDA" in outcomes["vllm"][1]
    assert outcomes["ours"][0] == 0 and "method spawn" in outcomes["ours"][1], outcomes["ours"][1][-3000:]
    assert "captured [(5, 128), (5, 128)]" in outcomes["ours"][1]


def test_greedy_generation_is_vllms_own_loop_token_for_token(llama, tmp_path):
    """Greedy through our loop samples exactly LLMEngine's tokens; decode-time states within prefill's bounds."""
    with VllmHiddenStatesGenerator(llama, dtype="bfloat16", layer_ids=list(range(LAYERS)), **engine("compiled")) as gen:
        engine_ = gen.engine
        feed = ((i, p, Generation(NEW)) for i, p in enumerate(PROMPTS))
        ours = {key: (ids, states, engine_.generated.pop(key)) for key, ids, states in engine_.stream(feed)}
    theirs = vllm_loop(
        tmp_path,
        llama,
        PROMPTS,
        dict(
            dtype="bfloat16",
            max_model_len=ENGINE["max_model_len"],
            max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
            max_num_seqs=ENGINE["max_num_seqs"],
            gpu_memory_utilization=GPU_MEMORY,
            **engine_args(),
        ),
        {"max_tokens": NEW, "temperature": 0.0, "ignore_eos": True},
    )["tokens"]
    for i, tokens in enumerate(theirs):
        assert ours[i][2].token_ids == tokens, f"prompt {i}: ours {ours[i][2].token_ids} vLLM's {tokens}"
    finals = [ours[i][0] for i in range(len(PROMPTS))]
    reference = hf_layer_outputs(llama, finals)
    medians = []
    for layer in range(LAYERS):
        rows = torch.cat([row_errors(ours[i][1][layer], reference[i][layer]) for i in range(len(PROMPTS))])
        medians.append(rows.median().item())
        assert rows.median().item() <= MEDIAN_BOUND[torch.bfloat16], f"layer {layer}"
        assert rows.max().item() <= ROW_BOUND[torch.bfloat16], f"layer {layer}: {rows.max().item():.2e}"
    save_figures("llama-greedy-vs-llmengine", {"prompts": len(PROMPTS), "new_tokens": NEW, "median_rows": medians})
