"""Streaming keeps memory bounded: 4N more prompts raise peak RSS by at most 10% over N's."""

import json
import os
import subprocess
import sys

from helpers.reference import NUM_LAYERS

CHILD = (
    """
import json, resource, sys, torch
from speculators_v016.generator import VllmHiddenStatesGenerator

model, n, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def prompts(count, seed):
    return torch.randint(5, 400, (count, length), generator=torch.Generator().manual_seed(seed)).tolist()
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
if __name__ == "__main__":
    gen = VllmHiddenStatesGenerator(model, layer_ids=list(range(%d)), max_model_len=length + 8, dtype="float32",
                                    enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=2048)
    rows = 0
    for item in gen.stream(prompts(n, 1)):  # dropped after use, as the CLI's writer does
        rows += item["hidden_states"][0].shape[0]
    at_n = peak()
    for item in gen.stream(prompts(4 * n, 2)):
        rows += item["hidden_states"][0].shape[0]
    print(json.dumps({"n": at_n, "n4": peak(), "rows": rows}))
    gen.shutdown()
"""
    % NUM_LAYERS
)


def test_peak_rss_after_4n_more_prompts_stays_within_10_percent(tiny_model):
    """Peak RSS after streaming 4N more prompts is <= 1.1x the peak after N (states never pile up)."""
    n, length = 48, 500
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, tiny_model("llama"), str(n), str(length)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert peak["rows"] == 5 * n * length
    streamed_mib = 4 * n * length * NUM_LAYERS * 128 * 4 / 2**20
    print(
        f"peak RSS {peak['n']:,.0f} MiB after {n} prompts, {peak['n4']:,.0f} MiB after {4 * n} more "
        f"({streamed_mib:,.0f} MiB of states streamed through)"
    )
    assert peak["n4"] <= 1.1 * peak["n"]


def test_a_shut_down_moe_engine_lets_go_of_its_kv_cache(tiny_model):
    """A shut-down in-process MoE engine frees its KV cache and model runner while its generator is still held."""
    import gc  # noqa: PLC0415 - this test only
    import weakref  # noqa: PLC0415 - this test only

    from speculators_v016.generator import VllmHiddenStatesGenerator  # noqa: PLC0415 - starts vLLM: this test only

    gen = VllmHiddenStatesGenerator(tiny_model("mixtral", 4), layer_ids=[1, 2], max_model_len=256, dtype="float32",
                                    enforce_eager=True, max_num_seqs=2, max_num_batched_tokens=256)  # fmt: skip
    gen.generate([[5, 6, 7, 8] * 10])
    layers = gen.engine.core.vllm_config.compilation_config.static_forward_context
    caches = [weakref.ref(t) for layer in layers.values() for t in getattr(layer, "kv_cache", []) if t.numel()]
    moe = [weakref.ref(layer) for layer in layers.values() if type(layer).__name__ == "FusedMoE"]
    assert caches and moe
    runner = weakref.ref(gen.engine.executor.driver_worker.worker.model_runner)
    del layers
    gen.shutdown()
    gc.collect()  # the caller still holds the shut-down generator, as a notebook does
    assert [r() is None for r in caches] == [True] * len(caches)
    assert runner() is None
