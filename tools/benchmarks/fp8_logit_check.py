"""How the logit check behaves on FP8 states: the measurement behind its per-position tolerance.

For a tiny random Llama (hidden 256, bf16 engine), once with its random output
head and once with the head scaled so its logits spread like a real model's
(std ~3), the same prompts run through the engine twice: storing bf16 and
storing FP8. Printed side by side, per model:

* the bf16 check's max |delta| (vLLM's prompt logprobs vs the captured last layer);
* FP8: max |delta| of the dequantized last layer, and ``|delta| / sigma``
  (sigma: the e4m3-derived standard deviation of each logprob, see
  speculators_v016.run.logit_check), max and 99.9th percentile;
* the faults the check must catch, on the same FP8 states: rows one position
  off and the adjacent layer (n-2 instead of n-1), as the smallest per-sample
  ``(|delta| - tolerance) / sigma`` (the check fails a sample above FP8_SIGMAS)
  and as max |delta|;
* the states' reconstruction error (dequantized FP8 vs bf16 of the same run),
  relative to each row's amax: max, and the e4m3 bound 2**-4.

Usage (takes a few minutes on 2 cores; run it under the engine lock):
    flock /tmp/vllm-engine.lock python tools/benchmarks/fp8_logit_check.py [--work DIR] [--prompts 24]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import bench_model, child, prompts  # noqa: E402

LAYERS = [2, 4, 6, 7]  # 6 and 7: the wrong-layer fault uses the adjacent layer


def scaled_head(source: Path, where: Path, factor: float) -> Path:
    """A copy of ``source`` whose lm_head is multiplied by ``factor`` (logits spread like a real model's)."""
    import shutil

    from safetensors.torch import load_file, save_file

    if not (where / "config.json").exists():
        shutil.copytree(source, where)
        weights = load_file(str(where / "model.safetensors"))
        weights["lm_head.weight"] = weights["lm_head.weight"] * factor
        save_file(weights, str(where / "model.safetensors"), metadata={"format": "pt"})
    return where


def measure(args: dict) -> dict:
    """(child) Run the prompts storing bf16 and FP8; compare as described above."""
    import torch

    from speculators_v016.fp8 import MAX_RELATIVE_ERROR, Fp8States
    from speculators_v016.generator import VllmHiddenStatesGenerator
    from speculators_v016.run.logit_check import TOLERANCE, FinalHead

    model, batch = args["model"], prompts(args["prompts"], args["length"], vocab=args["vocab"])
    runs = {}
    for storage in ("auto", "fp8_e4m3"):
        with VllmHiddenStatesGenerator(model, layer_ids=LAYERS, dtype="bfloat16", enforce_eager=True,
                                       max_model_len=args["length"] + 1, hidden_states_dtype=storage) as gen:
            engine = gen.engine
            out = {}
            for index, ids, states in engine.stream(enumerate(batch), prompt_logprobs=lambda _: True):
                out[index] = (torch.tensor(ids), states, engine.prompt_logprobs.pop(index).float())
            runs[storage] = out
    head = FinalHead.load(model)
    tol = TOLERANCE[torch.bfloat16]
    res = {"bf16_max": 0.0, "fp8_max": 0.0, "ratios": [], "shift_min": float("inf"), "shift_max_abs": float("inf"),
           "layer_min": float("inf"), "layer_max_abs": float("inf"), "recon_max": 0.0, "logit_std": 0.0}
    res["bf16_ulp_ratio"] = 0.0
    for index in sorted(runs["auto"]):
        ids, ref, theirs = runs["auto"][index]
        ours = head.next_token_logprobs(ref[-1], ids)
        delta = (ours - theirs[: len(ours)]).abs()
        res["bf16_max"] = max(res["bf16_max"], delta.max().item())
        # the logits' own bf16 rounding: one ulp of the target's logit plus the softmax-weighted ulp of all
        raw, final = head._logits(ref[-1][:-1], head.head.to(torch.bfloat16))
        ulp = torch.exp2(torch.floor(torch.log2(raw.abs().clamp_min(2.0**-100))) - 7)
        targets = ids[1:].long()[:, None]
        allowance = ulp.gather(1, targets)[:, 0] + (final.softmax(-1) * ulp).sum(-1)
        res["bf16_ulp_ratio"] = max(res["bf16_ulp_ratio"], (delta / allowance).max().item())
        _, q, theirs_q = runs["fp8_e4m3"][index]
        for layer in range(len(LAYERS)):
            amax = ref[layer].float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
            err = ((q[layer].dequantize() - ref[layer].float()).abs() / amax).max().item()
            res["recon_max"] = max(res["recon_max"], err)

        def judged(states: Fp8States) -> tuple[float, float, torch.Tensor]:
            logp, sigma = head.fp8_logprobs(states, ids, torch.bfloat16)
            delta = (logp - theirs_q[: len(logp)]).abs()
            return delta.max().item(), ((delta - tol).clamp_min(0) / sigma).max().item(), delta / sigma

        top, _, ratio = judged(q[-1])
        res["fp8_max"] = max(res["fp8_max"], top)
        res["ratios"] += ratio.tolist()
        shifted = Fp8States(torch.roll(q[-1].codes, 1, 0), torch.roll(q[-1].scales, 1, 0))
        top, beyond, _ = judged(shifted)
        res["shift_min"], res["shift_max_abs"] = min(res["shift_min"], beyond), min(res["shift_max_abs"], top)
        top, beyond, _ = judged(q[-2])
        res["layer_min"], res["layer_max_abs"] = min(res["layer_min"], beyond), min(res["layer_max_abs"], top)
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
    parser.add_argument("--also", type=Path, action="append", default=[],
                        help="another Llama folder to measure (e.g. the briefly trained target of fp8_training.py)")
    opts = parser.parse_args()
    base = bench_model(opts.work / "llama-256", hidden=256, layers=8)
    models = {"random head": base,
              f"head x{opts.head_scale:g}": scaled_head(base, opts.work / "llama-256-scaled", opts.head_scale)}
    models.update({path.name: path for path in opts.also})
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    rows = {}
    for name, path in models.items():
        rows[name] = child(__file__, {"model": str(path), "prompts": opts.prompts, "length": opts.length,
                                      "vocab": vocab})
    from speculators_v016.run.logit_check import FP8_SIGMAS

    print(f"\nlogit check on FP8 states ({opts.prompts} prompts x {opts.length} tokens, bf16 engine, "
          f"tolerance {FP8_SIGMAS:g} sigma + 5e-2)")
    print(f"{'':<34}" + "".join(f"{n:>16}" for n in rows))
    lines = [("logit std (mean over positions)", "logit_std", "{:.2f}"),
             ("bf16 check: max |delta|", "bf16_max", "{:.1e}"),
             ("bf16: max |delta| / logits' ulp", "bf16_ulp_ratio", "{:.2f}"),
             ("FP8 check: max |delta|", "fp8_max", "{:.1e}"),
             ("FP8: max |delta| / sigma", "sigma_max", "{:.2f}"),
             ("FP8: 99.9th pct |delta| / sigma", "sigma_p999", "{:.2f}"),
             ("shift by one: min (|d|-tol)/sigma", "shift_min", "{:.1f}"),
             ("shift by one: min max |delta|", "shift_max_abs", "{:.2f}"),
             ("layer n-2: min (|d|-tol)/sigma", "layer_min", "{:.1f}"),
             ("layer n-2: min max |delta|", "layer_max_abs", "{:.2f}"),
             ("states: max |err| / row amax", "recon_max", "{:.4f}"),
             ("e4m3 bound", "bound", "{:.4f}")]
    for label, key, fmt in lines:
        print(f"{label:<34}" + "".join(f"{fmt.format(r[key]):>16}" for r in rows.values()))


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        print(json.dumps(measure(json.loads(sys.argv[1]))))
    else:
        main()
