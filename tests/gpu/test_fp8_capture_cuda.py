"""FP8 quantization in the GPU capture: bit-identical to the CPU reference quantizer, and what it costs.

* :func:`test_gpu_quantizer_is_bit_identical_to_cpu`: :mod:`speculators_v016.fp8`
  on CUDA and on the CPU give the same codes and scales, bit for bit, for one
  layer of a 448 MiB step (8192 x 7168 bf16) and for the edge cases (fp16 and
  fp32 rows, zero rows, float32 subnormal rows, e4m3 rounding ties, NaN/Inf).
* :func:`test_fp8_kernel_time_per_step`: the quantization of a whole 448 MiB
  step (4 layers) on the device against the device-to-device copy it replaces
  in the staged path (CUDA events, 20 repetitions).
* :func:`test_fp8_capture_at_the_real_cadence`: the stand-in runner of
  ``test_capture_cuda.py`` (a CUDA graph whose outputs are overwritten at every
  replay, a >= 30 ms forward), no synchronization before the capture call, two
  steps in flight, the host copying each reply out of its slot. Every step's
  codes and scales equal the CPU reference quantizer applied to an eager
  recompute; GPU time per step on the compute stream without capture, with
  the bf16 capture and with the FP8 capture (staged and direct paths), and
  host time per capture call. FP8 may add at most 0.5 ms per 448 MiB step.

Figures are printed (``-s``); ``SPECULATORS_GPU_FIGURES`` also writes them as JSON.
Skips without CUDA.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from helpers.capture import worker_setup
from speculators_v016 import fp8
from speculators_v016.shared.slot_ring import SlotRing
from speculators_v016.worker.staging import Fp8Buffers, StagingCopier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from test_capture_cuda import (
        DTYPE,
        GIB,
        HIDDEN,
        LAYERS,
        NUM_INPUTS,
        STEP_BYTES,
        TIMED_STEPS,
        TOKENS,
        WARMUP_ROWS,
        StandInRunner,
        StandInWorker,
        cadence_run,
        calibrate_repeats,
        save_figures,
    )

#: Each run's mode: (storage, staging); "none" captures nothing. Interleaved, so drift spreads over all.
MODES = [
    ("none", None),
    ("auto", "auto"),
    (fp8.NAME, "auto"),
    (fp8.NAME, "off"),
    ("auto", "off"),
    ("none", None),
    (fp8.NAME, "auto"),
    ("auto", "auto"),
]
MAX_ADDED_MS = 0.5


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes; NaNs compare as NaN whatever their payload (CPU and GPU may differ there)."""
    a, b = a.cpu(), b.cpu()
    if a.dtype == fp8.CODE_DTYPE:
        nan_a, nan_b = fp8.code_is_nan(a), fp8.code_is_nan(b)
        return torch.equal(nan_a, nan_b) and torch.equal(a.view(torch.uint8)[~nan_a], b.view(torch.uint8)[~nan_b])
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a.view(torch.int32)[~nan_a], b.view(torch.int32)[~nan_b])


def edge_rows() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(8192, HIDDEN, generator=gen) * torch.exp2(torch.randint(-20, 12, (8192, 1), generator=gen))
    wide[:, 123] *= 500  # a massive-activation channel
    table = torch.arange(256, dtype=torch.uint8).view(fp8.CODE_DTYPE).float()
    grid = table[torch.isfinite(table)].unique()
    ties = torch.zeros(64, 512)
    ties[:, 0] = 448  # scale 1: the rows' values are the codes' inputs
    mids = (grid[1:] + grid[:-1]) / 2  # halfway between two e4m3 values: round half to even
    ties[:, 1 : 1 + len(mids)] = mids
    ties[32:, 1 : 1 + len(mids)] *= -1
    special = torch.randn(8, 512, generator=gen)
    special[0] = 0
    special[1] = 3e-42  # float32 subnormals: amax/448 would underflow
    special[2, 7], special[3, 9], special[4, 1] = float("nan"), float("inf"), -float("inf")
    return {
        "one 448 MiB-step layer, bf16": wide.to(torch.bfloat16),
        "wide, fp16": (wide[:1024] * 1e-3).half(),
        "wide, fp32": wide[:1024],
        "rounding ties": ties,
        "zero, subnormal, NaN, Inf rows": special,
    }


def nearest_e4m3(values: torch.Tensor) -> torch.Tensor:
    """Nearest finite e4m3fn value (ties to the even code) by search over all codes: no cast involved."""
    table = torch.arange(256, dtype=torch.uint8).view(fp8.CODE_DTYPE).float()
    keep = torch.isfinite(table)
    table, bits = table[keep].double(), torch.arange(256)[keep]
    distance = (values.double().reshape(-1, 1) - table).abs()
    tied = distance == distance.min(1, keepdim=True).values
    even = tied & (bits % 2 == 0)
    return table[torch.where(even.any(1, keepdim=True), even, tied).double().argmax(1)].float().reshape(values.shape)


@pytest.fixture(scope="module")
def cases():
    return edge_rows()


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_gpu_quantizer_is_bit_identical_to_cpu(path, cases, monkeypatch):
    """Codes and scales from the quantizer on CUDA (Triton kernel, or torch operations) equal the CPU's bit for bit."""
    if path == "triton":
        pytest.importorskip("triton")
    monkeypatch.setattr(fp8, "USE_TRITON", path == "triton")
    for name, rows in cases.items():
        codes, scales = fp8.quantize(rows)
        gpu_codes, gpu_scales = fp8.quantize(rows.cuda())
        assert same_bits(gpu_scales, scales), (path, name, "scales")
        assert same_bits(gpu_codes, codes), (path, name, "codes")
        finite = torch.isfinite(scales)
        sample = rows[finite][:8].float() / scales[finite][:8, None]  # the CPU's own cast, against the definition
        assert torch.equal(codes[finite][:8].float(), nearest_e4m3(sample)), (path, name, "definition")
    print(f"\nGPU quantizer ({path}) == CPU reference, bit for bit: {', '.join(cases)}")


def test_fp8_kernel_time_per_step():
    """The quantization of a 448 MiB step on the device, beside the device-to-device copy it replaces."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    aux = [torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(DTYPE) for _ in range(LAYERS)]
    plain = torch.empty((LAYERS, TOKENS, HIDDEN), dtype=DTYPE, device="cuda")
    stage = Fp8Buffers(
        torch.empty((LAYERS, TOKENS, HIDDEN), dtype=fp8.CODE_DTYPE, device="cuda"),
        torch.empty((LAYERS, TOKENS), dtype=fp8.SCALE_DTYPE, device="cuda"),
    )
    timings = {}
    runs = [("bf16 copy", plain, True), ("fp8 quantize, torch ops", stage, False)]
    try:
        import speculators_v016.fp8_triton  # noqa: F401, PLC0415 - Triton, on CUDA machines only

        runs.append(("fp8 quantize, triton", stage, True))
    except ImportError:
        pass
    for label, target, use_triton in runs:
        fp8.USE_TRITON = use_triton
        for _ in range(3):
            StagingCopier.fill(None, target, aux, TOKENS)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for _ in range(20):
            StagingCopier.fill(None, target, aux, TOKENS)
        end.record()
        host = (time.perf_counter() - t0) / 20 * 1000
        end.synchronize()
        timings[label] = {"gpu_ms": start.elapsed_time(end) / 20, "host_ms": host}
    fp8.USE_TRITON = True
    print(
        "\n448 MiB step on the device: "
        + "; ".join(
            f"{k} {v['gpu_ms']:.3f} ms GPU ({STEP_BYTES / GIB / (v['gpu_ms'] / 1000):.0f} GiB/s of bf16 states), "
            f"{v['host_ms']:.3f} ms host to launch"
            for k, v in timings.items()
        )
    )
    save_figures("fp8-kernel", timings)
    fastest = min(v["gpu_ms"] for k, v in timings.items() if k.startswith("fp8"))
    assert fastest <= MAX_ADDED_MS + timings["bf16 copy"]["gpu_ms"]


def cpu_reference(runner, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU reference quantizer on an eager recompute of the stand-in's forward: [layers, tokens, ...]."""
    aux = [layer.cpu() for layer in runner.forward(x)]
    pairs = [fp8.quantize(layer) for layer in aux]
    return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])


def run_mode(runner, ring, storage, staging, inputs, offset, rows_plan, store):
    """One run of :func:`cadence_run` with ``storage``; the host copies codes (and scales) out of each slot."""
    worker = None
    if storage != "none":
        worker = StandInWorker(runner, budget=64 * GIB)
        worker.speculators_capture_attach(worker_setup(LAYERS, ring.spec, staging, storage))
        path = worker._speculators_capture.copy_info["copy_path"]
        assert path == ("staged" if staging == "auto" else "direct"), worker._speculators_capture.copy_info
    codes, scales = store

    def take(capture):
        total = sum(capture.counts)
        keep = capture.step if storage == fp8.NAME else capture.step % len(codes)
        codes[keep][:, :total].copy_(ring.slot(capture.slot)[:, :total])
        if storage == fp8.NAME:
            scales[capture.step][:, :total].copy_(ring.scales(capture.slot)[:, :total])

    try:
        starts, host, consumed = cadence_run(runner, worker, ring, inputs, offset, rows_plan, take)
    finally:
        if worker is not None:
            worker.speculators_capture_close()
    return starts, host["call"], consumed


def test_fp8_capture_at_the_real_cadence():
    """No sync before the capture, two steps in flight: FP8 codes and scales exact; at most +0.5 ms per step."""
    runner = StandInRunner(calibrate_repeats())
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = [torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).to(DTYPE) for _ in range(NUM_INPUTS)]
    reference = [cpu_reference(runner, x) for x in inputs]
    rows_plan = WARMUP_ROWS + [TOKENS] * (TIMED_STEPS + 1)
    timed = range(len(WARMUP_ROWS), len(WARMUP_ROWS) + TIMED_STEPS)
    codes_store = torch.empty((len(rows_plan), LAYERS, TOKENS, HIDDEN), dtype=fp8.CODE_DTYPE)
    scales_store = torch.empty((len(rows_plan), LAYERS, TOKENS), dtype=fp8.SCALE_DTYPE)
    plain_store = torch.empty((2, LAYERS, TOKENS, HIDDEN), dtype=DTYPE)  # bf16 runs: copied out, not kept
    for store in (codes_store, scales_store, plain_store):
        store.view(torch.uint8).fill_(0xFF)  # NaN everywhere, and every page touched before the timed runs
    rings = {
        storage: SlotRing.create(
            slots=3,
            num_ids=LAYERS,
            max_rows=TOKENS,
            hidden=HIDDEN,
            dtype=DTYPE,
            shared=False,
            hidden_states_dtype=storage,
        )
        for storage in ("auto", fp8.NAME)
    }
    results = []
    try:
        for offset, (storage, staging) in enumerate(MODES):
            ring = rings[fp8.NAME if storage == fp8.NAME else "auto"]
            store = (codes_store, scales_store) if storage == fp8.NAME else (plain_store, None)
            starts, calls, consumed = run_mode(runner, ring, storage, staging, inputs, offset, rows_plan, store)
            window = starts[timed[0]].elapsed_time(starts[timed[-1] + 1])  # ms, on the compute stream
            row = {
                "storage": storage,
                "path": {"auto": "staged", "off": "direct", None: "-"}[staging],
                "gpu_ms_per_step": window / TIMED_STEPS,
            }
            if storage != "none":
                host = sorted(calls[k] * 1000 for k in timed)
                row.update(host_ms_median=statistics.median(host), host_ms_max=host[-1], steps=len(rows_plan))
            if storage == fp8.NAME:
                row["exact"] = sum(
                    consumed.get(k) == rows
                    and torch.equal(
                        codes_store[k][:, :rows].view(torch.uint8),
                        reference[(k + offset) % NUM_INPUTS][0][:, :rows].view(torch.uint8),
                    )
                    and torch.equal(scales_store[k][:, :rows], reference[(k + offset) % NUM_INPUTS][1][:, :rows])
                    for k, rows in enumerate(rows_plan)
                )
            results.append(row)
    finally:
        for ring in rings.values():
            ring.close()
    base = {}
    for r in results:
        base.setdefault((r["storage"] if r["storage"] != fp8.NAME else "fp8", r["path"]), []).append(
            r["gpu_ms_per_step"]
        )
    mean = {k: statistics.mean(v) for k, v in base.items()}
    print(
        f"\nFP8 capture at the real cadence: {runner.repeats} matmuls per layer, {STEP_BYTES / 2**20:.0f} MiB "
        f"steps (bf16 source), {TIMED_STEPS} timed steps per run after {len(WARMUP_ROWS)} mixed ones"
    )
    print(f"{'storage':9} {'path':7} {'GPU ms/step':>11} {'vs none':>8} {'host call ms':>12} {'max':>7} {'exact':>7}")
    for r in results:
        line = (
            f"{r['storage']:9} {r['path']:7} {r['gpu_ms_per_step']:11.3f} "
            f"{r['gpu_ms_per_step'] - mean['none', '-']:+8.3f}"
        )
        if "host_ms_median" in r:
            line += f" {r['host_ms_median']:12.2f} {r['host_ms_max']:7.2f}"
        if "exact" in r:
            line += f" {r['exact']:>3}/{r['steps']}"
        print(line)
    added = {path: mean["fp8", path] - mean["auto", path] for path in ("staged", "direct")}
    print("FP8 minus bf16 capture, GPU ms per step: " + ", ".join(f"{p} {v:+.3f}" for p, v in added.items()))
    save_figures("fp8-cadence", {"repeats": runner.repeats, "runs": results, "added_ms": added})
    for r in results:
        if r["storage"] == fp8.NAME:
            assert r["exact"] == r["steps"], r
    assert mean["none", "-"] >= 30, f"the stand-in forward takes {mean['none', '-']:.1f} ms, not >= 30 ms"
    assert added["staged"] <= MAX_ADDED_MS, added


def compiled_variants(kernel) -> int:
    """How many variants of a Triton kernel are compiled (its per-device caches; Triton 3's layout)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(entry) for entry in kernel.cache.values())


def test_warm_up_compiles_the_variant_a_step_uses():
    """fp8.warm_up (the engine's start) compiles the very kernel variant a step's rows then use: none in the run."""
    pytest.importorskip("triton")
    from speculators_v016 import fp8_triton  # noqa: PLC0415 - Triton on CUDA only

    hidden = 12304  # its block (16,384 columns) no other width here uses: a variant of its own, new to this process
    before = compiled_variants(fp8_triton._quantize_rows)
    fp8.warm_up(hidden, DTYPE, torch.device("cuda"))
    warmed = compiled_variants(fp8_triton._quantize_rows)
    assert warmed == before + 1
    stage = Fp8Buffers(torch.empty((2, 8192, hidden), dtype=fp8.CODE_DTYPE, device="cuda"),
                       torch.empty((2, 8192), dtype=fp8.SCALE_DTYPE, device="cuda"))  # fmt: skip
    rows = torch.randn(3000, hidden, device="cuda").to(DTYPE)
    fp8.quantize_into(rows, stage.codes[1, :3000], stage.scales[1, :3000])
    torch.cuda.synchronize()
    assert compiled_variants(fp8_triton._quantize_rows) == warmed
    codes, scales = fp8.quantize(rows.cpu())
    assert same_bits(stage.scales[1, :3000].cpu(), scales) and same_bits(stage.codes[1, :3000].cpu(), codes)
