"""The logit check's per-position tolerances (bf16 logits' rounding, FP8's e4m3 rounding), without an engine.

vLLM is played by a float64 projection of the unquantized rows, rounded to
bf16 as vLLM's output projection rounds its logits; the logits spread like a
trained model's (std ~8), where a fixed 5e-2 tolerance fails valid rows.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from speculators_v016 import fp8
from speculators_v016.checks.logit_check import LogitChecker

HIDDEN, VOCAB, ROWS = 256, 512, 300


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A checkpoint of a final norm and a head, pre-norm rows, and 'vLLM's' logprobs of them."""
    where = tmp_path_factory.mktemp("head")
    gen = torch.Generator().manual_seed(0)
    norm = 1 + 0.1 * torch.randn(HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    (where / "config.json").write_text(json.dumps({"model_type": "llama", "rms_norm_eps": 1e-6}))
    save_file({"model.norm.weight": norm, "lm_head.weight": head}, str(where / "model.safetensors"))
    rows = (torch.randn(ROWS, HIDDEN, generator=gen) * 3).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    x = rows.double()
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).double() * norm.double()
    logits = (x @ head.double().T).to(torch.bfloat16).float()  # vLLM's logits, in the engine's dtype
    theirs = torch.cat([torch.zeros(1), logits[:-1].log_softmax(-1).gather(1, ids[1:, None])[:, 0]])
    assert logits.std(-1).mean() > 5
    return str(where), rows, ids, theirs[1:]


def judge(where, states, ids, theirs):
    checker = LogitChecker(where, torch.bfloat16, 0)
    delta = checker.add("s", ids, [states], theirs)
    return delta, checker


def test_bf16_rows_pass_within_the_logits_rounding(setup):
    """Valid bf16 rows pass although they differ by more than a fixed 5e-2; one position off fails."""
    where, rows, ids, theirs = setup
    delta, checker = judge(where, rows, ids, theirs)
    assert delta > 5e-2 and checker.last_passed, checker.result.line()
    assert "tolerance 5e-02 + 3 ulps of the logits" in checker.result.line()
    delta, checker = judge(where, torch.roll(rows, 1, 0), ids, theirs)
    assert not checker.last_passed and checker.result.worst_ratio > 10


def test_fp8_rows_pass_within_their_sigma(setup):
    """Quantized rows pass within 8 sigma of their e4m3 rounding; one position off fails by far more."""
    where, rows, ids, theirs = setup
    states = fp8.Fp8States(*fp8.quantize(rows))
    delta, checker = judge(where, states, ids, theirs)
    assert checker.last_passed and checker.result.worst_sigmas < 4, checker.result.line()
    shifted = fp8.Fp8States(torch.roll(states.codes, 1, 0), torch.roll(states.scales, 1, 0))
    _, checker = judge(where, shifted, ids, theirs)
    assert not checker.last_passed and checker.result.worst_sigmas > 30
