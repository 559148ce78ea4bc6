"""How the logit check behaves in bf16 and on FP8 states: the measurement behind its per-position tolerances.

For a tiny random Llama (hidden 256, bf16 engine), once with its random output
head and once with the head scaled so its logits spread like a trained model's
(``--head-scale``), and for any model given with ``--also`` (e.g. the briefly
trained target of fp8_training.py), the same prompts run through the engine
twice: storing bf16 and storing FP8. Each sample is judged as the run's check
judges it (:class:`~speculators_v016.checks.logit_check.LogitChecker`), and
printed side by side, per model:

* bf16: max |delta| (vLLM's prompt logprobs vs the captured last layer) and the
  largest |delta| / tolerance (5e-2 + LOGIT_ULPS ulps of the logits; > 1 fails);
* FP8: max |delta| of the dequantized last layer, ``|delta| / sigma`` (sigma:
  the e4m3-derived standard deviation of each logprob), max and 99.9th
  percentile, and the largest sigmas beyond the rest of the tolerance (the
  check fails a sample above FP8_SIGMAS);
* the faults the check must catch, in both: rows one position off and the
  adjacent layer (n-2 instead of n-1), as the smallest per-sample margin;
* the states' reconstruction error (dequantized FP8 vs bf16 of the same run),
  relative to each row's amax: max, and the e4m3 bound 2**-4.

Usage (takes a few minutes on 2 cores; run it under the engine lock):
    flock /tmp/vllm-engine.lock python tools/benchmarks/fp8_logit_check.py [--work DIR] [--prompts 24]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from speculators_v016.checks.logit_check import FP8_SIGMAS, LOGIT_ULPS, TOLERANCE, LogitChecker, LogitCheckResult
from speculators_v016.fp8 import MAX_RELATIVE_ERROR, Fp8States
from speculators_v016.generator import VllmHiddenStatesGenerator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import bench_model, child, prompts  # noqa: E402
from report import recording  # noqa: E402

LAYERS = [2, 4, 6, 7]  # 6 and 7: the wrong-layer fault uses the adjacent layer


def scaled_head(source: Path, where: Path, factor: float) -> Path:
    """A copy of ``source`` whose lm_head is multiplied by ``factor`` (logits spread like a real model's)."""
    if not (where / "config.json").exists():
        shutil.copytree(source, where)
        weights = load_file(str(where / "model.safetensors"))
        weights["lm_head.weight"] = weights["lm_head.weight"] * factor
        save_file(weights, str(where / "model.safetensors"), metadata={"format": "pt"})
    return where


def measure(args: dict) -> dict:
    """(child) Run the prompts storing bf16 and FP8; compare as described above."""
    model, batch = args["model"], prompts(args["prompts"], args["length"], vocab=args["vocab"])
    runs = {}
    for storage in ("auto", "fp8_e4m3"):
        with VllmHiddenStatesGenerator(
            model,
            layer_ids=LAYERS,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=args["length"] + 1,
            hidden_states_dtype=storage,
        ) as gen:
            engine = gen.engine
            out = {}
            for index, ids, states in engine.stream(enumerate(batch), prompt_logprobs=lambda _: True):
                out[index] = (torch.tensor(ids), states, engine.prompt_logprobs.pop(index).float())
            runs[storage] = out
    checker = LogitChecker(model, torch.bfloat16, len(LAYERS) - 1)
    head = checker.head

    def verdict(last, ids, theirs) -> tuple[float, float, bool]:
        """One sample as the run's check judges it: (max |delta|, how far: |delta|/tolerance, or for FP8 the
        sigmas beyond the tolerance, whether it passed)."""
        checker.result = LogitCheckResult(tolerance=TOLERANCE[torch.bfloat16])
        top = checker.add(0, ids, [last], theirs)
        return (
            top,
            checker.result.worst_sigmas if checker.result.fp8 else checker.result.worst_ratio,
            checker.last_passed,
        )

    checker.last = 0
    res = {
        "bf16_max": 0.0,
        "bf16_worst": 0.0,
        "fp8_max": 0.0,
        "fp8_worst": 0.0,
        "ratios": [],
        "passed": True,
        "bf16_shift": float("inf"),
        "bf16_layer": float("inf"),
        "fp8_shift": float("inf"),
        "fp8_layer": float("inf"),
        "faults_caught": True,
        "recon_max": 0.0,
        "logit_std": 0.0,
    }
    for index in sorted(runs["auto"]):
        ids, ref, theirs = runs["auto"][index]
        _, q, theirs_q = runs["fp8_e4m3"][index]
        for key, last, their in (("bf16", ref, theirs), ("fp8", q, theirs_q)):
            top, worst, passed = verdict(last[-1], ids, their)
            res[f"{key}_max"], res[f"{key}_worst"] = max(res[f"{key}_max"], top), max(res[f"{key}_worst"], worst)
            res["passed"] &= passed
            shifted = (
                Fp8States(torch.roll(last[-1].codes, 1, 0), torch.roll(last[-1].scales, 1, 0))
                if key == "fp8"
                else torch.roll(last[-1], 1, 0)
            )
            for fault, states in (("shift", shifted), ("layer", last[-2])):
                _, worst, passed = verdict(states, ids, their)
                res[f"{key}_{fault}"] = min(res[f"{key}_{fault}"], worst)
                res["faults_caught"] &= not passed
        logp, _, sigma = head.judge(q[-1], ids, torch.bfloat16)
        res["ratios"] += ((logp - theirs_q[: len(logp)]).abs() / sigma).tolist()
        for layer in range(len(LAYERS)):
            amax = ref[layer].float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
            err = ((q[layer].dequantize() - ref[layer].float()).abs() / amax).max().item()
            res["recon_max"] = max(res["recon_max"], err)
        raw, _ = head._logits(ref[-1], head.head.to(torch.bfloat16))
        res["logit_std"] = max(res["logit_std"], raw.std(-1).mean().item())
    ratios = sorted(res.pop("ratios"))
    res["sigma_max"] = ratios[-1]
    res["sigma_p999"] = ratios[int(0.999 * (len(ratios) - 1))]
    res["positions"] = len(ratios)
    res["bound"] = MAX_RELATIVE_ERROR
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/speculators-fp8-logit-check"))
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--length", type=int, default=200)
    parser.add_argument("--head-scale", type=float, default=10.0)
    parser.add_argument(
        "--also",
        type=Path,
        action="append",
        default=[],
        help="another Llama folder to measure (e.g. the briefly trained target of fp8_training.py)",
    )
    opts = parser.parse_args()
    base = bench_model(opts.work / "llama-256", hidden=256, layers=8)
    models = {
        "random head": base,
        f"head x{opts.head_scale:g}": scaled_head(base, opts.work / "llama-256-scaled", opts.head_scale),
    }
    models.update({path.name: path for path in opts.also})
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    rows = {}
    for name, path in models.items():
        rows[name] = child(
            __file__, {"model": str(path), "prompts": opts.prompts, "length": opts.length, "vocab": vocab}
        )

    with recording(__file__):
        print(
            f"\nlogit check, bf16 engine, {opts.prompts} prompts x {opts.length} tokens: tolerance 5e-2 + "
            f"{LOGIT_ULPS:g} ulps of the logits per position; FP8 also {FP8_SIGMAS:g} sigma of the e4m3 rounding"
        )
        print(f"{'':<34}" + "".join(f"{n:>16}" for n in rows))
        lines = [
            ("logit std (mean over positions)", "logit_std", "{:.2f}"),
            ("bf16: max |delta|", "bf16_max", "{:.1e}"),
            ("bf16: max |delta| / tolerance", "bf16_worst", "{:.2f}"),
            ("bf16 shift: min |d|/tolerance", "bf16_shift", "{:.1f}"),
            ("bf16 layer n-2: min |d|/tolerance", "bf16_layer", "{:.1f}"),
            ("FP8: max |delta|", "fp8_max", "{:.1e}"),
            ("FP8: max |delta| / sigma", "sigma_max", "{:.2f}"),
            ("FP8: 99.9th pct |delta| / sigma", "sigma_p999", "{:.2f}"),
            ("FP8: max sigmas beyond the rest", "fp8_worst", "{:.2f}"),
            ("FP8 shift: min sigmas beyond", "fp8_shift", "{:.1f}"),
            ("FP8 layer n-2: min sigmas beyond", "fp8_layer", "{:.1f}"),
            ("every valid sample passed", "passed", "{}"),
            ("every fault failed", "faults_caught", "{}"),
            ("states: max |err| / row amax", "recon_max", "{:.4f}"),
            ("e4m3 bound", "bound", "{:.4f}"),
        ]
        for label, key, fmt in lines:
            print(f"{label:<34}" + "".join(f"{fmt.format(r[key]):>16}" for r in rows.values()))


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(measure(json.loads(sys.argv[1]))))
    else:
        main()
