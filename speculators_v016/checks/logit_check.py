"""A fidelity check that scales to the real target: the last captured layer against vLLM's own logits.

Comparing with transformers needs the whole model in memory, which no user of
a 1T-parameter target has. This check needs two tensors of the checkpoint:
the final norm and the output projection. The captured last layer (layer
``n-1`` before the final norm) is normed and projected as vLLM does it (norm in
fp32, the projection in the engine's dtype, log-softmax in fp32), and the
log-probability of each next prompt token must equal the prompt logprobs vLLM
itself computed in the same run, within a dtype-aware tolerance. A wrong layer,
a row given to the wrong request or position, or a torn copy shows at once;
tensor parallelism changes nothing (vLLM gathers its logprobs).

With FP8 storage the check runs on what is stored: the dequantized last
layer. Its logprobs then differ from vLLM's by the e4m3 rounding of the rows,
so each position gets its own tolerance, derived from the codes: the first-
order change of that logprob when every element moves within half an e4m3
step (independent, uniform) has a standard deviation ``sigma`` computed
exactly from the final norm, the head and the softmax; a position passes when
``|delta| <= FP8_SIGMAS * sigma + the engine dtype's tolerance``. A wrong
layer or rows one position off move the logprobs by far more than that
(measured: docs/benchmarks/fp8_logit_check.md), and the sigma scales with the target's own
logits, so the tolerance carries over from tiny models to real ones.

In bf16 or fp16, vLLM's logits are rounded to the engine's dtype, and ours
come from another summation order: a logit of size ``z`` may round apart by
about ``2**-8 |z|`` in bf16, so every position also gets
``LOGIT_ULPS`` units in the last place of its logits (:func:`logit_rounding`)
beyond the fixed tolerance. Measured: up to 1.3 of them, where a fixed 5e-2
alone failed a briefly trained tiny target (7e-2) and a head with a real
model's logit spread (0.31); float32 keeps its fixed 1e-4.

Covered: final RMSNorm (Llama, Qwen, Mistral/Mixtral, DeepSeek-V2/V3 and
Kimi-K2, GLM, Phi-3, GPT-OSS ...) and Gemma's ``(1 + w)`` RMSNorm with final
logit soft-capping. Not covered, said so by :class:`CheckUnavailable`: a
quantized output head, other final norms (LayerNorm), logit scaling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from speculators_v016.fp8 import Fp8States

# |delta logprob|; measured on tiny models: fp32 <= 5e-7, bf16 <= 8e-3; a wrong layer or row: > 1
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-2, torch.bfloat16: 5e-2}
#: FP8 storage: a position passes within this many standard deviations of its e4m3 rounding (plus TOLERANCE).
FP8_SIGMAS = 8.0
#: bf16/fp16 engines: a position may also differ by this many units in the last place of its logits
#: (:func:`logit_rounding`; measured up to 1.3 of them).
LOGIT_ULPS = 3.0
_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
_PREFIXES = ("", "language_model.", "model.language_model.")


class CheckUnavailable(RuntimeError):
    """The logit check cannot run for this model; the message says why."""


@dataclass
class LogitCheckResult:
    samples: int = 0
    positions: int = 0
    max_abs: float = 0.0
    tolerance: float = 0.0
    failures: list = field(default_factory=list)  # (key, max abs delta)
    unavailable: str = ""
    fp8: bool = False  # checked on dequantized FP8 states, with a per-position tolerance
    worst_sigmas: float = 0.0  # FP8: the largest (|delta| - tolerance) / sigma seen
    logit_ulps: float = 0.0  # bf16/fp16: the tolerance adds this many ulps of each position's logits
    worst_ratio: float = 0.0  # not FP8: the largest |delta| / tolerance seen

    def describe_tolerance(self) -> str:
        """The tolerance in words."""
        text = f"{self.tolerance:.0e}" + (f" + {self.logit_ulps:g} ulps of the logits" if self.logit_ulps else "")
        return f"{FP8_SIGMAS:g} sigma of the e4m3 rounding + {text}" if self.fp8 else text

    @property
    def ok(self) -> bool:
        return not self.failures and not self.unavailable and self.samples > 0

    def line(self) -> str:
        if self.unavailable:
            return f"skipped ({self.unavailable})"
        if not self.samples:
            return "skipped (no sample was checked)"
        state = "ok" if self.ok else f"FAILED for {len(self.failures)} sample(s), first {self.failures[0]}"
        if self.fp8:
            return (
                f"{state} ({self.samples} samples, {self.positions} positions: stored FP8 last layer, "
                f"dequantized -> norm -> lm_head vs vLLM's prompt logprobs, max |delta| {self.max_abs:.1e}, "
                f"at most {self.worst_sigmas:.1f} sigma beyond the rest; tolerance {self.describe_tolerance()})"
            )
        worst = f", at most {self.worst_ratio:.2f} of it" if self.logit_ulps else ""
        return (
            f"{state} ({self.samples} samples, {self.positions} positions: captured last layer -> norm -> "
            f"lm_head vs vLLM's prompt logprobs, max |delta| {self.max_abs:.1e}, tolerance "
            f"{self.describe_tolerance()}{worst})"
        )


def _text_config(model_path: str) -> dict:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return {**config, **config.get("text_config", {})} if "text_config" in config else config


def _weight_files(model_path: str) -> dict[str, Path]:
    """Tensor name -> safetensors file of the checkpoint."""
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        return {k: root / v for k, v in json.loads(index.read_text())["weight_map"].items()}

    files = sorted(root.glob("*.safetensors"))
    out = {}
    for path in files:
        with safe_open(str(path), "pt") as fh:
            out.update({k: path for k in fh.keys()})
    return out


def _read(files: dict[str, Path], names: list[str]) -> torch.Tensor | None:
    for name in names:
        if name in files:
            with safe_open(str(files[name]), "pt") as fh:
                return fh.get_tensor(name)
    return None


class FinalHead:
    """The target's final norm and output projection, read from its checkpoint (nothing else)."""

    def __init__(self, norm: torch.Tensor, head: torch.Tensor, eps: float, gemma: bool, softcap: float | None):
        self.norm, self.head, self.eps, self.gemma, self.softcap = norm, head, eps, gemma, softcap

    @classmethod
    def load(cls, model_path: str) -> FinalHead:
        config = _text_config(model_path)
        if "rms_norm_eps" not in config:
            raise CheckUnavailable("the final norm is not an RMSNorm; use `check` with transformers")
        if config.get("logit_scale") or config.get("logits_scaling"):
            raise CheckUnavailable("the model scales its logits; use `check` with transformers")
        files = _weight_files(model_path)
        norm = _read(files, [f"{p}model.norm.weight" for p in _PREFIXES])
        head = _read(files, [f"{p}lm_head.weight" for p in _PREFIXES])
        if head is None and any(n.startswith(tuple(f"{p}lm_head." for p in _PREFIXES)) for n in files):
            raise CheckUnavailable("the output head is quantized")
        if head is None:  # tied embeddings
            head = _read(files, [f"{p}model.embed_tokens.weight" for p in _PREFIXES])
        if norm is None or head is None:
            raise CheckUnavailable("final norm or output head not found in the checkpoint")
        gemma = str(config.get("model_type", "")).startswith("gemma")
        return cls(norm, head, float(config["rms_norm_eps"]), gemma, config.get("final_logit_softcapping"))

    def next_token_logprobs(self, last_layer: torch.Tensor, input_ids: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """log p(input_ids[t+1] | ..t) from the pre-norm last-layer states, as vLLM computes it: ``[T-1]``."""
        return self.judge(last_layer, input_ids, last_layer.dtype, chunk)[0]

    def fp8_logprobs(
        self, states: Fp8States, input_ids: torch.Tensor, dtype: torch.dtype, chunk: int = 256
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs, sigma)``, both ``[T-1]``: :meth:`next_token_logprobs` of the dequantized rows (in
        ``dtype``), and the standard deviation the e4m3 rounding gives each of them (see :meth:`_sigma`)."""
        logprobs, _, sigma = self.judge(states, input_ids, dtype, chunk)
        return logprobs, sigma

    def judge(
        self, last: torch.Tensor | Fp8States, input_ids: torch.Tensor, dtype: torch.dtype, chunk: int = 256
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(logprobs, rounding, sigma)``, each ``[T-1]``: the next-token logprobs of the last layer (FP8:
        dequantized to ``dtype``); what rounding vLLM's logits to ``dtype`` may move them by
        (:func:`logit_rounding`; None in float32); the e4m3 rounding's standard deviation (None unless FP8)."""
        head = self.head.to(dtype)
        fp8 = isinstance(last, Fp8States)
        rows = (last.codes if fp8 else last).shape[0] - 1
        logprobs, rounding, sigmas = [], [], []
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            targets = input_ids[start + 1 : stop + 1].long()
            if fp8:
                codes, scales = last.codes[start:stop], last.scales[start:stop].float()
                h = Fp8States(codes, scales).dequantize(dtype)
            else:
                h = last[start:stop]
            raw, logits = self._logits(h, head)
            logp = logits.log_softmax(-1)
            logprobs.append(logp.gather(1, targets[:, None])[:, 0])
            allowance = logit_rounding(raw, logp, targets, dtype)
            if allowance is not None:
                rounding.append(allowance)
            if fp8:
                sigmas.append(self._sigma(h, codes, scales, raw, logp, targets, head))
        if not logprobs:
            empty = torch.empty(0)
            return empty, (empty if dtype in _MANTISSA_BITS else None), (empty if fp8 else None)
        return (torch.cat(logprobs), torch.cat(rounding) if rounding else None, torch.cat(sigmas) if fp8 else None)

    def _logits(self, h: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits before soft-capping, final logits), float32, of pre-norm rows ``h`` (in the engine's dtype)."""
        dtype = h.dtype
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            x = (x * (1.0 + self.norm.float())).to(dtype)
        else:
            x = x.to(dtype) * self.norm.to(dtype)
        raw = (x @ head.T).float()
        return raw, (torch.tanh(raw / self.softcap) * self.softcap if self.softcap else raw)

    def _sigma(
        self,
        h: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        raw: torch.Tensor,
        logp: torch.Tensor,
        targets: torch.Tensor,
        head: torch.Tensor,
    ) -> torch.Tensor:
        """The standard deviation the e4m3 rounding of rows ``h`` gives each next-token logprob.

        To first order, ``delta logp_t = sum_k c_k e_k`` with ``e_k`` the rounding
        error of element ``k`` (uniform within half an e4m3 step ``u_k``, independent)
        and ``c_k = gw_k/rms (d_t W_tk - sum_v q_v W_vk) - (d_t z_t - sum_v q_v z_v) h_k/(H rms^2)``,
        where ``gw`` is the final norm's weight, ``z`` the logits, ``q = softmax * d``
        and ``d`` the soft-capping slope (1 without). So ``sigma^2 = sum_k c_k^2 u_k^2 / 3``.
        """
        weight = (1.0 + self.norm.float()) if self.gemma else self.norm.float()
        slope = 1 - torch.tanh(raw / self.softcap) ** 2 if self.softcap else torch.ones_like(raw)
        q = logp.exp() * slope
        x = h.float()
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        d_t = slope.gather(1, targets[:, None])
        z_t = raw.gather(1, targets[:, None])
        pulled = d_t * head[targets].float() - (q.to(head.dtype) @ head).float()  # [rows, H]
        z_term = d_t * z_t - (q * raw).sum(-1, keepdim=True)
        coeff = weight * pulled / rms - z_term * x / (x.shape[-1] * rms.pow(2))
        magnitude = codes.float().abs().clamp_min(2.0**-6)  # e4m3: 3 mantissa bits, subnormals below 2**-6
        half_step = torch.exp2(torch.floor(torch.log2(magnitude)) - 4) * scales[:, None]
        return ((coeff * half_step).pow(2).sum(-1) / 3).sqrt()


def logit_rounding(
    raw: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """How far rounding the logits to ``dtype`` may move each next-token logprob: one unit in the last
    place of the target's logit plus the softmax-weighted mean unit of all logits (None for float32).

    vLLM's output projection writes its logits in the engine's dtype, and ours is
    another GEMM (another summation order), so the two may round a logit of size
    ``z`` apart by about ``2**-8 |z|`` in bf16: 0.06 at |z| = 16, beyond any fixed
    tolerance once logits spread like a trained model's (measured: docs/benchmarks/fp8_logit_check.md).
    """
    bits = _MANTISSA_BITS.get(dtype)
    if bits is None:
        return None
    ulp = torch.exp2(torch.floor(torch.log2(raw.abs().clamp_min(2.0**-24))) - bits)
    return ulp.gather(1, targets[:, None])[:, 0] + (logp.exp() * ulp).sum(-1)


class LogitChecker:
    """Accumulates the check over samples of one run."""

    def __init__(self, model_path: str, dtype: torch.dtype, last_layer_index: int | None):
        self.result = LogitCheckResult(tolerance=TOLERANCE.get(dtype, 1e-1))
        self.dtype = dtype
        self.last = last_layer_index
        self.last_passed = True
        self.head = None
        if last_layer_index is None:
            self.result.unavailable = "the last layer is not among the captured ones"
            return
        try:
            self.head = FinalHead.load(model_path)
        except CheckUnavailable as exc:
            self.result.unavailable = str(exc)

    @property
    def active(self) -> bool:
        return self.head is not None

    def release(self) -> None:
        """Drop the output head (GBs for a large vocabulary) once the checked samples are done."""
        self.head = None

    def add(self, key, input_ids: torch.Tensor, states: list, vllm_logprobs: torch.Tensor) -> float:
        """Compare one sample (its last layer a tensor, or FP8 states); return its max |delta|.

        Whether it passed is :attr:`last_passed` (with FP8 the tolerance is per position).
        """
        last = states[self.last]
        if isinstance(last, Fp8States):
            self.result.fp8 = True
            ours, rounding, sigma = self.head.judge(last, input_ids, self.dtype)
        else:
            ours, rounding, sigma = self.head.judge(last, input_ids, last.dtype)
        theirs = vllm_logprobs.float().reshape(-1)[: ours.shape[0]]
        error = (ours - theirs).abs()
        delta = error.max().item() if ours.numel() else 0.0
        self.result.samples += 1
        self.result.positions += int(ours.numel())
        self.result.max_abs = max(self.result.max_abs, delta)
        tolerance = torch.full_like(error, self.result.tolerance)
        if rounding is not None:
            self.result.logit_ulps = LOGIT_ULPS
            tolerance = tolerance + LOGIT_ULPS * rounding
        if sigma is None:
            worst = (error / tolerance).max().item() if ours.numel() else 0.0
            self.result.worst_ratio = max(self.result.worst_ratio, worst)
            passed = worst <= 1.0  # NaN fails too
        else:
            beyond = ((error - tolerance).clamp_min(0) / sigma).max().item() if ours.numel() else 0.0
            self.result.worst_sigmas = max(self.result.worst_sigmas, beyond)
            passed = beyond <= FP8_SIGMAS
        if not passed:
            self.result.failures.append((key, float(f"{delta:.3g}")))
        self.last_passed = passed
        return delta

    def describe_tolerance(self) -> str:
        """The tolerance in words (for messages)."""
        return self.result.describe_tolerance()
