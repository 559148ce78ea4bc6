"""Tensor parallelism 2 through vLLM's multiprocess executor on CPU."""

import os

import pytest
import torch

from helpers.llm_reference import llm_generate
from helpers.reference import CHUNKED_ENGINE, NUM_LAYERS, TOLERANCE, random_prompts
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.engine.generation import Generation
from speculators_v016.generator import VllmHiddenStatesGenerator

LENGTHS = [50, 260, 9, 133]
ENGINE = CHUNKED_ENGINE


@pytest.fixture
def two_cpu_workers(monkeypatch):
    # vLLM's CPU workers each bind OpenMP threads to a NUMA node; on a one-node
    # machine they must be told which cores (notes: without it, an assertion).
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0|0")


def test_tp2_equals_tp1(tiny_model, two_cpu_workers, tmp_path):
    """States under tensor parallel 2 equal TP=1's within 1e-5 (prefill and generating); only the output rank replies;
    greedy generating requests under TP 2 sample exactly LLM.generate's tokens under TP 2."""
    model_dir = tiny_model("llama")
    prompts = random_prompts(LENGTHS, seed=11)
    with VllmHiddenStatesGenerator(model_dir, tensor_parallel_size=2, executor="mp", **ENGINE) as gen:
        assert gen.engine.executor.capture_output_rank == 0
        assert len(gen.engine.capture_info) == 2  # set up on both ranks
        assert [i["ring"] for i in gen.engine.capture_info] == [True, False]  # only the output rank maps it
        assert [i["copy_path"] for i in gen.engine.capture_info] == ["host", "none"]  # CPU: plain host copies
        tp2 = gen.generate(prompts)
        checker = LogitChecker(model_dir, gen.engine.dtype, NUM_LAYERS - 1)  # vLLM's own logits, under TP
        for key, ids, states in gen.engine.stream(enumerate(prompts), prompt_logprobs=lambda _: True):
            checker.add(key, torch.tensor(ids), states, gen.engine.prompt_logprobs.pop(key))
        assert checker.result.ok and checker.result.samples == len(prompts), checker.result.line()
        regenerated_tp2 = regenerate(gen, prompts)
    with VllmHiddenStatesGenerator(model_dir, **ENGINE) as gen:
        tp1 = gen.generate(prompts)
        regenerated_tp1 = regenerate(gen, prompts)
        worker = gen.engine.executor.driver_worker.worker  # uniprocess: the worker lives here
    assert (
        worker._speculators_capture.closed and worker._speculators_capture.ring is None
    )  # engine close released the capture
    worst = max(
        (a - b).abs().max().item() for x, y in zip(tp1, tp2) for a, b in zip(x["hidden_states"], y["hidden_states"])
    )
    assert worst < TOLERANCE
    # generating requests (--regenerate) under TP 2: LLM.generate's greedy tokens under TP 2, TP 1's tokens,
    # and their decode-time states
    theirs = llm_generate_tp2(model_dir, prompts, tmp_path)
    assert [regenerated_tp2[i][0] for i in range(len(prompts))] == theirs
    assert {k: v[0] for k, v in regenerated_tp2.items()} == {k: v[0] for k, v in regenerated_tp1.items()}
    worst = max(
        (a - b).abs().max().item()
        for k in regenerated_tp1
        for a, b in zip(regenerated_tp1[k][1], regenerated_tp2[k][1])
    )
    assert worst < TOLERANCE


def llm_generate_tp2(model_dir, prompts, where) -> list[list[int]]:
    """LLM.generate's greedy tokens under tensor parallel 2 (same engine settings), in a process of its own."""
    engine = {k: v for k, v in ENGINE.items() if k != "layer_ids"}
    engine.update(tensor_parallel_size=2, distributed_executor_backend="mp")
    sampling = {"max_tokens": 24, "temperature": 0.0, "stop_token_ids": [2]}
    return llm_generate({"model": model_dir, "prompts": prompts, "engine": engine, "sampling": sampling}, where)


def regenerate(gen, prompts) -> dict:
    """Greedy generating requests (24 new tokens, EOS stops): {prompt: (generated ids, states)}."""
    generation, out = Generation(24, stop_token_ids=frozenset({2})), {}
    for key, _ids, states in gen.engine.stream((i, p, generation) for i, p in enumerate(prompts)):
        out[key] = (gen.engine.generated.pop(key).token_ids, states)
    return out
