"""The GPU tier's judgement of captured rows against a reference (transformers in float32, or a prefill capture),
one layer at a time: the median row error, the worst, the share past the row bound (routing flips), and how far
the same rows sit from the reference one position off and one layer off (an off-by-one cannot pass); and a run's
FP8 storage against its bf16 run; two layers alike bit for bit. The bounds are bf16's
(:data:`speculators_v016.checks.fidelity.ROW_BOUNDS`)."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.cli import load_all
from speculators_v016.checks.fidelity import FLIPPED_ROWS, ROW_BOUNDS, row_errors
from speculators_v016.store.sample_format import load_sample
from speculators_v016.worker.stream_proof import DIFFERENT_FACTOR

MEDIAN_BOUND, ROW_BOUND = ROW_BOUNDS["bfloat16"]
SEPARATION = 8  # a row or a layer off sits at least this many median bounds away


def judged(states: list[list[torch.Tensor]], reference: list[list[torch.Tensor]], layer: int) -> dict:
    """One layer's rows against a reference: the median, the worst and the share past the row bound."""
    rows = torch.cat([row_errors(s[layer], ref[layer]) for s, ref in zip(states, reference)])
    return dict(median_row=rows.median().item(), worst_row=rows.max().item(),
                past_row_bound=(rows > ROW_BOUND).float().mean().item())  # fmt: skip


def layer_figures(states: list[list[torch.Tensor]], reference: list[list[torch.Tensor]], layer: int) -> dict:
    """One layer's rows against the reference: median, worst, share past the row bound, and the same rows against
    the reference one position off and one layer off (medians)."""
    rows = torch.cat([row_errors(s[layer], ref[layer]) for s, ref in zip(states, reference)])
    shifted = torch.cat([row_errors(s[layer][1:], ref[layer][:-1]) for s, ref in zip(states, reference)
                         if len(ref[layer]) > 1])  # fmt: skip
    other = layer - 1 if layer else layer + 1
    wrong = torch.cat([row_errors(s[layer], ref[other]) for s, ref in zip(states, reference)])
    return dict(layer=layer, median_row=rows.median().item(), worst_row=rows.max().item(),
                past_row_bound=(rows > ROW_BOUND).float().mean().item(), rows=len(rows),
                row_one_off_median=shifted.median().item(), layer_one_off_median=wrong.median().item())  # fmt: skip


def print_layers(layers: list[dict], flips: str = "") -> None:
    """Each layer's figures on a line (``flips``: what follows the share past the row bound)."""
    for f in layers:
        print(f"  layer {f['layer']}: rows median {f['median_row']:.2e}, worst {f['worst_row']:.2e}, "
              f"{f['past_row_bound']:.1%} past {ROW_BOUND:g}{flips}; one row off {f['row_one_off_median']:.2f}, "
              f"one layer off {f['layer_one_off_median']:.2f}")  # fmt: skip


def assert_layers_within_bounds(layers: list[dict]) -> None:
    """Every layer: the median row within its bound, at most FLIPPED_ROWS past the row bound, and a row or a layer
    off at least SEPARATION median bounds away."""
    for f in layers:
        assert f["median_row"] <= MEDIAN_BOUND, f
        assert f["past_row_bound"] <= FLIPPED_ROWS, f
        assert f["row_one_off_median"] >= SEPARATION * MEDIAN_BOUND, f
        assert f["layer_one_off_median"] >= SEPARATION * MEDIAN_BOUND, f


def layers_note(layers: list[dict]) -> str:
    """The worst layer's figures, for the architecture table: median, worst row, share past the row bound."""
    return (f"median {max(f['median_row'] for f in layers):.1e}, worst {max(f['worst_row'] for f in layers):.1e}, "
            f"{max(f['past_row_bound'] for f in layers):.1%} past {ROW_BOUND:g} (routing flips)")  # fmt: skip


def assert_stream_margins(info: dict) -> None:
    """The start-up stream proof held for every captured consumer, each margin it reports at least
    DIFFERENT_FACTOR."""
    for line in info["stream_margins"].values():
        assert line.startswith(("layer", "final norm")), line
        if "margin" in line:
            assert float(line.rsplit("margin ", 1)[1].rstrip("x")) >= DIFFERENT_FACTOR, line


def fp8_worst_error(out: Path, bf16_out: Path) -> float:
    """The FP8 run in ``out`` against the bf16 run in ``bf16_out``: the worst |dequantized - bf16| of any row over
    that row's largest |value| in the bf16 run."""
    reference, worst = load_all(bf16_out), 0.0
    for entry in sorted(out.glob("data_*.safetensors")):
        index = int(entry.stem.split("_")[1])
        stored = load_sample(entry, dequantize_to=None)["hidden_states"]
        for got, rows in zip(stored, reference[index]["hidden_states"]):
            amax = rows.float().abs().amax(dim=-1, keepdim=True)
            worst = max(worst, ((got.dequantize() - rows.float()).abs() / amax).max().item())
    return worst


def same_bits(a, b) -> bool:
    """Two layers' states equal bit for bit (FP8, :class:`~speculators_v016.fp8.Fp8States`: codes and scales)."""
    if hasattr(a, "codes"):
        return torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) and torch.equal(a.scales, b.scales)
    return torch.equal(a, b)
