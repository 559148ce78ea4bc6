"""Shared fixtures: tiny real models on disk and transformers' reference states.

Engines are module-scoped in the test modules (start-up is the slow part);
models are built once per session.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU engine
os.environ.setdefault("VLLM_MLA_DISABLE", "1")  # DeepSeek on CPU: plain attention (the CPU backend has no MLA)

import pytest
import torch

from speculators_v016.tiny_models import build_tiny_model

NUM_LAYERS = 8
TOLERANCE = 1e-5  # fp32 max abs error against transformers


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Build (once) and return the folder of a tiny model of the given architecture (and layer count)."""
    built: dict[tuple[str, int], str] = {}

    def get(arch: str, num_layers: int = NUM_LAYERS) -> str:
        if (arch, num_layers) not in built:
            where = tmp_path_factory.mktemp(f"{arch}-{num_layers}")
            built[arch, num_layers] = str(build_tiny_model(where, arch, num_layers=num_layers))
        return built[arch, num_layers]

    return get


def random_prompts(lengths, vocab: int = 400, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


def hf_layer_outputs(model_dir: str, prompts: list[list[int]]) -> list[list[torch.Tensor]]:
    """transformers' output of every decoder layer (before the final norm), per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0]))
    results = []
    with torch.no_grad():
        for ids in prompts:
            seen.clear()
            out = model(torch.tensor([ids]), output_hidden_states=True)
            per_layer = [seen[i].clone() for i in range(len(model.model.layers))]
            # cross-check the hook against transformers' own hidden_states (all but the last, normed one)
            for i in range(len(per_layer) - 1):
                assert torch.equal(per_layer[i], out.hidden_states[i + 1][0])
            results.append(per_layer)
    return results


def max_abs_error(results: list[dict], reference: list[list[torch.Tensor]], layer_ids) -> float:
    worst = 0.0
    for res, ref in zip(results, reference):
        assert len(res["hidden_states"]) == len(layer_ids)
        for state, layer in zip(res["hidden_states"], layer_ids):
            assert state.shape == ref[layer].shape
            worst = max(worst, (state.float() - ref[layer]).abs().max().item())
    return worst


# -- the architecture table: each engine test of a model family records its result ------------
ARCHITECTURE_RESULTS: dict[str, dict] = {}


@pytest.fixture
def record_architecture():
    """record(name, model_class, aux_source, tested, max_abs_error, tolerance, note) for the README table."""
    def record(name, model_class, aux_source, tested, max_abs_error=None, tolerance=None, note=""):
        ARCHITECTURE_RESULTS[name] = dict(name=name, model_class=model_class, aux_source=aux_source, tested=tested,
                                          max_abs_error=max_abs_error, tolerance=tolerance, note=note)
    return record


_SHM_BEFORE: set[str] = set()


def pytest_sessionstart(session):
    from speculators_v016.shm_sweep import stale_segments

    _SHM_BEFORE.update(p.name for p in stale_segments())


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if it left shared memory behind; write the architecture results for the README table."""
    from speculators_v016.shm_sweep import stale_segments

    left = sorted(p.name for p in stale_segments() if p.name not in _SHM_BEFORE)
    if left:
        print(f"\nFAILED: this test run left shared memory in /dev/shm that no process uses: {left}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not ARCHITECTURE_RESULTS:
        return
    import json
    from pathlib import Path

    out = Path(__file__).resolve().parents[1] / "build" / "test-results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "architectures.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**old, **ARCHITECTURE_RESULTS}, indent=2, sort_keys=True) + "\n")
