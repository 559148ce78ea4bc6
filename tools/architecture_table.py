#!/usr/bin/env python3
"""Write the architecture table of docs/architectures.md from what the tests measured.

The engine tests of each model family record their result (conftest's
``record_architecture``) into ``build/test-results/architectures.json`` at the
end of a pytest session; this script renders those rows, plus the families no
test here can run (``NOT_RUN``, with the reason), between the page's markers.

    python -m pytest tests && python tools/architecture_table.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "build" / "test-results" / "architectures.json"
#: The GPU tier's results (tools/gpu/tier_page.py writes it from the runs on a lent GPU): the GPU column.
GPU_RESULTS = ROOT / "docs" / "benchmarks" / "gpu_tier.json"
PAGE = ROOT / "docs" / "architectures.md"
BEGIN, END = "<!-- architectures:begin -->", "<!-- architectures:end -->"
#: The families run under pipeline parallelism (results recorded with ``device`` ``cpu-pp-<layout>``).
PP_BEGIN, PP_END = "<!-- pipeline:begin -->", "<!-- pipeline:end -->"

#: Families no engine here runs, and why (kept by hand: there is no measurement to generate them from).
NOT_RUN = {
    "Kimi-K2.5": (
        "KimiK25ForConditionalGeneration",
        "taps",
        "structure only",
        "no engine: vLLM 0.16 loads its image processor from the checkpoint with "
        "trust_remote_code=True hard-coded (Moonshot's own code, shipped only with the release); "
        "the wrapper -> language_model -> DeepSeek-V3 path is tested without an engine, the "
        "DeepSeek-V3 text model on the engine",
    ),
    "INT4 MoE (Kimi-K2.5 class)": (
        "DeepseekV3ForCausalLM / Qwen3MoeForCausalLM",
        "taps / built-in",
        "refused on x86",
        "vLLM 0.16 runs INT4 MoE on CPU only through an Arm kernel "
        "(dynamic_4bit_int_moe: 'requires AArch64', tested), and that method drops "
        "grouped routing (DeepSeek/Kimi assert); W4A16 pack-quantized MoE needs GPU "
        "kernels. Structure-tested without an engine: taps read the stream exactly "
        "and never touch the INT4 experts",
    ),
    "Qwen3-Next (hybrid)": (
        "Qwen3NextForCausalLM",
        "taps",
        "not run: CPU backend",
        "vLLM 0.16's CPU backend fails at load: 'ValueError: too many values to unpack "
        "(expected 2)' in layers/utils.py dispatch_cpu_unquantized_gemm (the gated delta net's "
        "3-D conv weight), and its linear attention is Triton-only; on GPUs the start-up "
        "stream proof decides. The layer replay of `check` reproduces transformers' layers "
        "exactly (tested on transformers' own states)",
    ),
    "MiniMax-Text-01 (hybrid)": (
        "MiniMaxText01ForCausalLM",
        "taps",
        "not run: CPU backend",
        "vLLM 0.16 cannot load transformers' MiniMax checkpoint (KeyError "
        "'model.layers.1.self_attn.diagonal_decay'); with those buffers dropped it loads, "
        "the start-up stream proof passes (whole stream), and warm-up fails in its "
        "lightning attention: 'RuntimeError: Found no NVIDIA driver on your system' "
        "(Triton). Layer replay tested on transformers' own states",
    ),
    "Llama 4 MoE layers": (
        "Llama4ForCausalLM",
        "built-in",
        "dense layers only",
        "vLLM 0.16's CPU MoE asserts on Llama 4's router (`assert not "
        "apply_router_weight_on_input`, cpu_fused_moe.py); the llama4 row runs the same decoder "
        "layer class with dense MLPs",
    ),
    "MiniMax-M2": (
        "MiniMaxM2ForCausalLM",
        "taps",
        "not run: no reference",
        "transformers 4.57 has no implementation (remote code only), so no tiny model and no "
        "reference here; fused add-norm layers: the start-up stream proof decides",
    ),
}


#: Families run in bfloat16 only, and why not in float32.
NOTES_BF16_ONLY = {
    "gpt_oss": "its attention-sink kernel refuses fp32 on vLLM's CPU backend; real checkpoints are MXFP4 (GPU kernels)",
    "qwen2": "the CLI's default-dtype tests run it end to end",
}


def gpu_cells(results: dict) -> dict[str, str]:
    """Per family, its GPU results (``device`` cuda-MODE), one clause per mode: what the GPU column says."""
    cells: dict[str, list[str]] = {}
    for r in sorted(results.values(), key=lambda r: r.get("device", "")):
        if r.get("device", "cpu").startswith("cuda"):
            cells.setdefault(r["name"], []).append(f"{r['device'].partition('-')[2] or 'run'}: {r['note']}")
    return {name: "; ".join(parts) for name, parts in cells.items()}


def rows(results: dict, gpu: dict | None = None) -> list[str]:
    """One row per family: its float32 result, beside it its bfloat16 result (``name@bfloat16``) and its results on
    a GPU (H200, vLLM's own GPU code: ``name@bfloat16@cuda-MODE``, from the GPU tier's runs). A name run on the GPU
    only (a case of its own, e.g. ``deepseek_v3 (MLA across steps)``) gets a row of its own with the GPU column."""
    lines = [
        "| architecture | vLLM class | aux source | run | max abs error vs transformers (fp32) | tolerance "
        "| bf16: row error vs transformers fp32 | GPU (H200, bf16): row error vs transformers fp32 | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    every = {**(gpu or {}), **results}
    on_gpu = gpu_cells(every)
    gpu_runs = {r["name"]: r for r in every.values() if r.get("device", "cpu").startswith("cuda")}
    results = {k: r for k, r in results.items() if r.get("device", "cpu") == "cpu"}
    bf16 = {r["name"]: r for r in results.values() if r.get("dtype") == "bfloat16"}
    fp32 = {key: r for key, r in results.items() if r.get("dtype", "float32") == "float32"}
    for name in sorted(set(fp32) | set(bf16), key=str.lower):
        r = fp32.get(name)
        low = bf16.get(name)
        low_cell = low["note"] if low else "-"
        gpu_cell = on_gpu.get(name, "-")
        if r is None:  # run in bf16 only
            lines.append(_row(name, f"`{low['model_class']}`", low["aux_source"], low["tested"], "-", "-", low_cell,
                              gpu_cell, NOTES_BF16_ONLY.get(name, "")))  # fmt: skip
            continue
        err = f"{r['max_abs_error']:.1e}" if r["max_abs_error"] is not None else "-"
        tol = f"{r['tolerance']:.0e}" if r["tolerance"] is not None else "-"
        run = r["tested"] + (" and bf16" if low else "")
        lines.append(_row(name, f"`{r['model_class']}`", r["aux_source"], run, err, tol, low_cell, gpu_cell, r["note"]))
    for name in sorted(set(gpu_runs) - set(fp32) - set(bf16), key=str.lower):
        r = gpu_runs[name]
        lines.append(_row(name, f"`{r['model_class']}`", r["aux_source"], "GPU only", "-", "-", "-", on_gpu[name], ""))
    for name, (cls, source, how, why) in sorted(NOT_RUN.items()):
        lines.append(_row(name, f"`{cls}`", source, how, "-", "-", "-", "-", why))
    return lines


def pipeline_rows(results: dict) -> list[str]:
    """One row per family and pipeline layout run (``device`` ``cpu-pp-...``): states against PP 1 of the same data."""
    lines = [
        "| architecture | vLLM class | aux source under PP | layout | max abs difference vs PP 1 (fp32) | note |",
        "|---|---|---|---|---|---|",
    ]
    runs = [r for r in results.values() if r.get("device", "cpu").startswith("cpu-pp")]
    for r in sorted(runs, key=lambda r: (r["name"].lower(), r["device"])):
        err = f"{r['max_abs_error']:.1e}" if r["max_abs_error"] is not None else "-"
        lines.append(_row(r["name"], f"`{r['model_class']}`", r["aux_source"], r["tested"], err, r["note"]))
    return lines


def _replace_block(text: str, begin: str, end: str, lines: list[str]) -> str:
    return text[: text.index(begin)] + "\n".join([begin, *lines, end]) + text[text.index(end) + len(end) :]


def _name(line: str) -> str:
    return line.split("|")[1].strip()


def keep_unmeasured(lines: list[str], page: str) -> list[str]:
    """``lines`` (header, measured rows, then ``NOT_RUN``'s) with the page's rows of families this run did not
    measure kept as they were (a test that runs only on other machines: the AWQ row needs an AVX512 build)."""
    old = page[page.index(BEGIN) + len(BEGIN) : page.index(END)].strip().splitlines()[2:]
    header, body = lines[:2], lines[2:]
    named = {_name(line) for line in body} | set(NOT_RUN)
    kept = [line for line in old if _name(line) not in named]
    measured = [line for line in body if _name(line) not in NOT_RUN] + kept
    return header + sorted(measured, key=lambda line: _name(line).lower()) + body[len(body) - len(NOT_RUN) :]


def _row(*cells: str) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page's table differs (write nothing)")
    args = ap.parse_args()
    if not RESULTS.exists():
        print(f"no test results at {RESULTS}: run the tests first", file=sys.stderr)
        return 2
    gpu = json.loads(GPU_RESULTS.read_text())["architectures"] if GPU_RESULTS.exists() else {}
    text = PAGE.read_text()
    if BEGIN not in text or END not in text:
        print(f"{PAGE} has no {BEGIN} ... {END} markers", file=sys.stderr)
        return 2
    results = json.loads(RESULTS.read_text())
    table = "\n".join([BEGIN, *keep_unmeasured(rows(results, gpu), text), END])
    new = text[: text.index(BEGIN)] + table + text[text.index(END) + len(END) :]
    if PP_BEGIN in new and PP_END in new and len(pipeline_rows(results)) > 2:  # a run with the PP tests in it
        new = _replace_block(new, PP_BEGIN, PP_END, pipeline_rows(results))
    if args.check:
        return 0 if new == text else 1
    PAGE.write_text(new)
    print(f"wrote {len(table.splitlines()) - 2} rows to {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
