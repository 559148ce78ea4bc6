"""Prove, on the loaded model, what the residual stream is at every captured layer boundary.

A tap records the residual stream where a consumer receives it: decoder layer
``k`` (vLLM aux id ``k``) or the final norm (id ``n``). How the stream arrives
differs between families, and a parameter's name does not say it: a fused
add-norm layer (Llama) takes ``(hidden_states, residual)`` and the stream is
their sum; a parallel block (Command-R) takes the same two arguments but the
stream is ``hidden_states`` alone (the ``residual`` it gets is the previous
layer's input, passed along and never added); a post-norm layer (OLMo-2) or a
GPT-NeoX block takes the stream whole. So before the first real step the
worker runs the model's own forward on a few tokens and establishes the
convention of each consumer from its behaviour:

1. **Structure** (real forward): every decoder layer runs once, in order, then
   the final norm; each consumer receives exactly the tensors its predecessor
   returned, or the first of them (EXAONE 4's post-norm blocks return the
   stream and an intermediate, and its final norm takes the stream alone);
   nothing changes the stream between layers; the model's output is the final
   norm's output.
2. **Sufficiency** (per consumer, its real call with crafted inputs): the stream
   is what the consumer's outputs depend on. Its ``[tokens, hidden]`` tensor
   arguments (``a``, ``b``) are replaced by random values ``k/64 x 2^p`` (``|k|
   <= 64``) with ONE power of two ``p`` for both, so ``a + b`` (at most 8
   significant bits) is exact in bfloat16, float16 and float32 alike (checked:
   :func:`_exact_sum`); the consumer is run with ``(a, b)``, then with each
   candidate stream ``a + b``, ``a``, ``b`` in the first place and zeros in the
   second. The right candidate hands the consumer the very values it adds
   itself, whatever precision its kernel adds in (vLLM's fused add-norm adds in
   float32; a candidate computed in bfloat16 with each argument on its own scale
   was rounded and missed by 1.6e-3), so it reproduces every output (the final
   norm: its normed output, the only one used) exactly on every kernel we know;
   a wrong one changes them at the scale of the stream (~0.7 relative, since
   ``a`` and ``b`` have one scale). The thresholds come from the consumer's
   output dtype (:func:`thresholds`): the right candidate within
   :data:`SAME_ULPS` units in the last place (relative to the outputs' norm),
   room for a kernel that rounds its last step differently; every wrong one at
   least :data:`DIFFERENT_FACTOR` times that, and never under
   :data:`DIFFERENT_FLOOR`. Exactly one candidate must pass while the others are
   past the second threshold; otherwise the convention is not established and
   the run is refused. The margin each consumer showed (nearest wrong candidate
   over the right one's tolerance) is kept in the convention and reported. A
   consumer with one such argument takes the stream whole.
3. **Recording** (:func:`verify_aux`, after the taps are installed): on a
   second forward, every aux output (ours and vLLM's built-in) equals the
   proven stream of that forward bit for bit.

Under pipeline parallelism each stage proves its own layers (a
:class:`~speculators_v016.worker.pipeline_stage.StageLayers`): its layers run
once, in order (then the final norm, on the last stage); its first layer
receives exactly the intermediate tensors the check forward handed the stage
(a stage after the first); and what a stage before the last sends on is
exactly what its last layer returned. So the stream at a stage boundary,
captured on the next stage, is the stream one stage would have passed on.

Attention (and any other layer holding a KV cache) has no metadata in this
forward: the caller's :class:`CheckForward` makes its output zero, which keeps
every run deterministic; the conventions are a property of the residual
wiring, which does not depend on attention's values. Findings are collected
over the whole check and raised together, after every rank has made the same
calls (tensor-parallel layers communicate inside their forward).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from speculators_v016.worker.pipeline_stage import StageLayers

#: The right candidate reproduces the consumer's outputs within this many units in the last place of
#: their dtype (relative Frobenius distance <= SAME_ULPS x eps): 0 on every kernel met so far, since
#: the crafted sum is exact; the room is for a kernel that rounds its last step differently.
SAME_ULPS = 4
#: Every wrong candidate must change the outputs by at least this many times the right one's tolerance...
DIFFERENT_FACTOR = 8
#: ... and by at least this (relative): with one scale for both arguments a wrong candidate moves the
#: outputs by ~0.7 (a norm of a against a norm of a + b, for b of a's size).
DIFFERENT_FLOOR = 5e-2
#: Token count of the check forward: small, and unlike any model dimension.
CHECK_TOKENS = 13

Location = tuple[str, Any]  # ("arg", index) or ("kw", name)


class UnsupportedModelError(TypeError):
    """The model's decoder stack cannot be found or tapped."""


class StreamProofError(UnsupportedModelError):
    """The residual stream at a captured layer could not be established on the loaded model."""


@dataclass
class CheckForward:
    """The model's forward on :data:`CHECK_TOKENS` tokens, and the context to call its modules in."""

    run: Callable[[], Any]  # the outer model's forward (inside ``context``)
    context: Callable[[], contextlib.AbstractContextManager]  # for direct calls of its modules
    tokens: int
    #: a pipeline stage after the first: the intermediate tensors ``run`` hands it (their values, in order)
    received: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class StreamConvention:
    """How the residual stream reaches one consumer: the sum of the arguments at ``slots``."""

    consumer: str  # "layer 3" or "final norm"
    class_name: str
    slots: tuple[Location, ...]
    kind: str
    evidence: tuple[tuple[str, float], ...] = ()  # candidate -> relative difference of the outputs
    same: float = 0.0  # the tolerance the right candidate met (from the outputs' dtype)
    different: float = 0.0  # the distance every wrong candidate had to exceed

    @property
    def margin(self) -> float | None:
        """Nearest wrong candidate's distance over the right one's tolerance (None: nothing was compared)."""
        errors = sorted(err for _, err in self.evidence)
        return errors[1] / self.same if len(errors) > 1 and self.same > 0 else None

    def margin_line(self) -> str:
        """One line for the log and ``check``: the right candidate, the nearest wrong one, the thresholds."""
        if self.margin is None:
            return f"{self.consumer}: {self.kind} (one stream-shaped argument: nothing to tell apart)"
        right, wrong = sorted(err for _, err in self.evidence)[:2]
        return (
            f"{self.consumer}: {self.kind.split(' (')[0]}: right {right:.2g} (tolerance {self.same:.2g}), "
            f"nearest wrong {wrong:.2g} (threshold {self.different:.2g}), margin {self.margin:.3g}x"
        )

    def describe(self) -> dict:
        return {
            "consumer": self.consumer,
            "class": self.class_name,
            "kind": self.kind,
            "evidence": {k: float(f"{v:.3g}") for k, v in self.evidence},
            "same": self.same,
            "different": self.different,
        }


@dataclass
class _Call:
    args: tuple
    kwargs: dict
    output: Any = None


@dataclass
class _Recorder:
    """Clones of every call's arguments and outputs, in call order (layers mutate their inputs in place)."""

    modules: dict[nn.Module, str]
    calls: list[tuple[str, _Call]] = field(default_factory=list)
    handles: list = field(default_factory=list)

    def __enter__(self):
        for module, name in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _pre(self, name):
        def hook(module, args, kwargs):
            self.calls.append((name, _Call(_clone(args), _clone(kwargs))))

        return hook

    def _post(self, name):
        def hook(module, args, kwargs, output):
            for called, call in reversed(self.calls):
                if called == name and call.output is None:
                    call.output = _clone(output)
                    break

        return hook

    def of(self, name: str) -> list[_Call]:
        return [call for called, call in self.calls if called == name]


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def _tensors(output) -> list[torch.Tensor | None]:
    """A module's outputs as a flat list (None kept: where a layer hands on no residual)."""
    if isinstance(output, torch.Tensor) or output is None:
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for part in output for t in _tensors(part)]
    return []


def _locations(call: _Call, shape: tuple[int, int]) -> list[Location]:
    """The arguments of ``call`` shaped like the stream (``[tokens, hidden]``), in call order."""
    found: list[Location] = [
        ("arg", i) for i, a in enumerate(call.args) if isinstance(a, torch.Tensor) and tuple(a.shape) == shape
    ]
    found += [("kw", k) for k, a in call.kwargs.items() if isinstance(a, torch.Tensor) and tuple(a.shape) == shape]
    return found


def read(args: Sequence, kwargs: dict, where: Location):
    kind, key = where
    if kind == "arg":
        return args[key] if len(args) > key else None
    return kwargs.get(key)


def _replace(call: _Call, values: dict[Location, torch.Tensor]) -> tuple[tuple, dict]:
    args, kwargs = list(_clone(call.args)), _clone(call.kwargs)
    for (kind, key), value in values.items():
        if kind == "arg":
            args[key] = value
        else:
            kwargs[key] = value
    return tuple(args), kwargs


def _relative(got: list, want: list) -> float:
    """Largest relative (Frobenius) difference between two output lists; inf if their structure differs."""
    if len(got) != len(want):
        return float("inf")
    worst = 0.0
    for g, w in zip(got, want):
        if g is None or w is None:
            if (g is None) != (w is None):
                return float("inf")
            continue
        if g.shape != w.shape:
            return float("inf")
        diff = (g.float() - w.float()).norm().item()
        scale = w.float().norm().item()
        if diff != diff:  # NaN
            return float("inf")
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))
    return worst


def thresholds(outputs: Sequence[torch.Tensor | None]) -> tuple[float, float]:
    """(same, different) for a consumer whose outputs are ``outputs``: from the least precise of their dtypes.

    ``same`` = :data:`SAME_ULPS` x eps (bfloat16 3.1e-2, float16 3.9e-3, float32 4.8e-7): a relative
    Frobenius distance that every element off by up to that many units in the last place stays
    within; ``different`` = max(:data:`DIFFERENT_FACTOR` x same, :data:`DIFFERENT_FLOOR`).
    """
    eps = max((torch.finfo(t.dtype).eps for t in outputs if t is not None and t.is_floating_point()), default=0.0)
    if eps == 0.0:
        raise StreamProofError(_message(["the consumer returned no floating-point output to compare"]))
    same = SAME_ULPS * eps
    return same, max(DIFFERENT_FACTOR * same, DIFFERENT_FLOOR)


def _crafted(likes: Sequence[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """Random values k/64 (|k| <= 64) times ONE power of two near the largest of ``likes``' scales.

    One power for all arguments: a sum of two is then (k1 + k2)/64 x 2^p with |k1 + k2| <= 128, at most
    8 significant bits, exact in bfloat16 (8), float16 (11) and float32 (24). The power stays within
    [2^-8, 2^12], where float16 neither underflows nor overflows.
    """
    scale = max(like.float().pow(2).mean().sqrt().item() for like in likes)
    power = 2.0 ** min(max(round(math.log2(max(scale, 2.0**-8))), -8), 12)
    out = []
    for like in likes:
        grid = torch.randint(-64, 65, tuple(like.shape), generator=generator).to(torch.float64) / 64
        out.append((grid * power).to(device=like.device, dtype=like.dtype))
    return out


def _exact_sum(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Is ``a + b`` computed in their dtype the exact sum (what a kernel adding in float32 gets)?"""
    return bool(torch.equal((a + b).double(), a.double() + b.double()))


def _outputs(module: nn.Module, call: _Call, slots: list[Location], keep: slice, first, second) -> list:
    """The consumer's outputs (those at ``keep``) with ``first``/``second`` in place of its two stream arguments."""
    args, kwargs = _replace(call, {slots[0]: first.clone(), slots[1]: second.clone()})
    return [_clone(t) for t in _tensors(module.forward(*args, **kwargs))[keep]]


CANDIDATES = {"a + b": lambda a, b: a + b, "a": lambda a, b: a, "b": lambda a, b: b}


def _kind(candidate: str, names: tuple[str, str]) -> str:
    a, b = names
    return {
        "a + b": f"sum: {a} + {b} (fused add-norm)",
        "a": f"{a} alone ({b} passed along, not added)",
        "b": f"{b} alone ({a} not part of the stream)",
    }[candidate]


def _name(where: Location) -> str:
    kind, key = where
    return str(key) if kind == "kw" else f"argument {key}"


def _param_name(module: nn.Module, where: Location) -> str:
    """The parameter name at ``where`` (for messages only: conventions never depend on it)."""
    kind, key = where
    if kind == "kw":
        return str(key)
    forward = type(module).forward
    try:
        params = list(inspect.signature(forward).parameters)[1:]
        if params and params[0] == "args":  # vLLM CustomOp dispatch
            params = list(inspect.signature(getattr(type(module), "forward_native", forward)).parameters)[1:]
    except (TypeError, ValueError):
        return _name(where)
    return params[key] if key < len(params) else _name(where)


class _Findings(list):
    def add(self, consumer: str, module: nn.Module, message: str) -> None:
        self.append(f"{consumer} ({type(module).__name__}): {message}")


def prove_streams(
    layers: Sequence[nn.Module],
    norm: nn.Module,
    consumer_ids: Sequence[int],
    check: CheckForward,
    stage: StageLayers | None = None,
) -> dict[int, StreamConvention]:
    """The proven stream convention of each consumer (vLLM aux id -> convention); raises if any is not established.

    ``consumer_ids`` are vLLM aux ids: ``k < n`` is decoder layer ``k``, ``n`` the final norm. ``stage``:
    the pipeline stage this process holds (None: every layer), whose ids ``consumer_ids`` must be.
    """
    n = len(layers)
    stage = stage or StageLayers.whole(n)
    outside = [k for k in consumer_ids if not stage.owns(k)]
    if outside:
        raise StreamProofError(_message([f"ids {outside} are not captured on {stage.describe()}"]))
    names = {layers[i]: f"layer {i}" for i in range(stage.start, stage.end)}
    if stage.is_last:
        names[norm] = "final norm"
    findings = _Findings()
    try:
        with _Recorder(names) as rec, check.context():
            output = check.run()
    except Exception as exc:  # noqa: BLE001 - any failure of the model's forward: named, refused
        raise StreamProofError(
            _message([f"the model's forward on {check.tokens} check tokens failed: {type(exc).__name__}: {exc}"])
        ) from exc
    # 1. structure
    order = [name for name, _ in rec.calls]
    want = [f"layer {i}" for i in range(stage.start, stage.end)] + (["final norm"] if stage.is_last else [])
    if order != want:
        counts = {name: order.count(name) for name in want if order.count(name) != 1}
        findings.append(
            f"the decoder does not run each layer once, in order, then the final norm: "
            f"calls {_short(order)}" + (f" (called {counts} times)" if counts else "")
        )
        raise StreamProofError(_message(findings))
    shape = _stage_output(rec, output, norm, check, stage, findings)
    consumers = list(range(max(stage.start, 1), stage.end)) + ([n] if stage.is_last else [])
    for k in consumers:
        consumer, module = (f"layer {k}", layers[k]) if k < n else ("final norm", norm)
        [call] = rec.of(consumer)
        if k == stage.start:  # a later stage's first layer: what arrived from the stage before
            source, given = "the previous pipeline stage", list(check.received or ())
        else:
            [before] = rec.of(f"layer {k - 1}")
            source, given = f"layer {k - 1}", _tensors(before.output)
        handed = [t for t in given if t is None or tuple(t.shape) == shape]
        got = [read(call.args, call.kwargs, w) for w in _locations(call, shape)]
        handed_tensors = [t for t in handed if t is not None]
        # all of them, or (a post-norm block's last layer, EXAONE 4) the first ones: never another tensor
        if not got or len(got) > len(handed_tensors) or not all(torch.equal(a, b) for a, b in zip(got, handed_tensors)):
            findings.add(
                consumer,
                module,
                f"does not receive what {source} returned: {source} "
                f"returned {_describe(given)}, it got {len(got)} [tokens, hidden] "
                "argument(s) that differ (the model changes the stream between layers)",
            )
    # 2. sufficiency, per consumer; every experiment runs on every rank whatever the findings
    conventions: dict[int, StreamConvention] = {}
    generator = torch.Generator().manual_seed(1234)
    with check.context(), torch.inference_mode():
        for k in consumer_ids:
            consumer, module = (f"layer {k}", layers[k]) if k < n else ("final norm", norm)
            [call] = rec.of(consumer)
            slots = _locations(call, shape)
            if len(slots) == 1:
                conventions[k] = StreamConvention(
                    consumer, type(module).__name__, tuple(slots), f"whole: {_param_name(module, slots[0])}"
                )
                continue
            if len(slots) != 2:
                findings.add(
                    consumer,
                    module,
                    f"has {len(slots)} arguments shaped like the stream "
                    f"[{shape[0]}, {shape[1]}] (expected 1 or 2): {_describe(call.args)}",
                )
                continue
            a, b = _crafted([read(call.args, call.kwargs, w) for w in slots], generator)
            if not _exact_sum(a, b):  # cannot happen on the grid above; refuse rather than judge on rounding
                findings.add(consumer, module, f"the crafted stream a + b is not exact in {a.dtype}")
                continue
            keep = slice(0, 1) if k == n else slice(None)  # the final norm: only its normed output is used

            reference = _outputs(module, call, slots, keep, a, b)
            same_at, different_at = thresholds(reference)
            evidence = tuple(
                (cand, _relative(_outputs(module, call, slots, keep, fn(a, b), torch.zeros_like(a)), reference))
                for cand, fn in CANDIDATES.items()
            )
            arg_names = (_param_name(module, slots[0]), _param_name(module, slots[1]))
            same = [c for c, err in evidence if err <= same_at]
            unclear = [c for c, err in evidence if same_at < err < different_at]
            seen = ", ".join(f"{_kind(c, arg_names).split(' (')[0]}: {err:.2g}" for c, err in evidence)
            bounds = f" (right within {same_at:.2g}, wrong beyond {different_at:.2g}, outputs {reference[0].dtype})"
            if len(same) == 1 and not unclear:
                kept = tuple(slots) if same[0] == "a + b" else ((slots[0],) if same[0] == "a" else (slots[1],))
                conventions[k] = StreamConvention(
                    consumer,
                    type(module).__name__,
                    kept,
                    _kind(same[0], arg_names),
                    evidence,
                    same_at,
                    different_at,
                )
            elif not same:
                findings.add(
                    consumer,
                    module,
                    f"no known combination of its arguments {list(arg_names)} "
                    f"reproduces its outputs; relative change of its outputs when the stream is taken "
                    f"as {seen}{bounds}",
                )
            else:
                findings.add(
                    consumer,
                    module,
                    f"the stream cannot be told apart on the check input: relative change of its outputs when "
                    f"taken as {seen}{bounds}",
                )
    if findings:
        raise StreamProofError(_message(findings))
    return conventions


def _stage_output(rec: _Recorder, output, norm: nn.Module, check: CheckForward, stage: StageLayers, findings) -> tuple:
    """The stream's shape ``(tokens, hidden)``, after checking what the stage hands on: the last stage's output
    is its final norm's; a stage before the last sends on exactly what its last layer returned."""
    if not stage.is_last:
        [last] = rec.of(f"layer {stage.end - 1}")
        returned = [t for t in _tensors(last.output) if t is not None]
        if not returned or returned[0].dim() != 2 or returned[0].shape[0] != check.tokens:
            raise StreamProofError(_message([f"layer {stage.end - 1} returned {_describe(last.output)}"]))
        shape = tuple(returned[0].shape)
        sent = list(getattr(output, "tensors", {}).values())
        returned = [t for t in returned if tuple(t.shape) == shape]
        if len(sent) != len(returned) or not all(torch.equal(a, b) for a, b in zip(sent, returned)):
            findings.append(
                f"{stage.describe()} does not send on what its last layer {stage.end - 1} returned: it returned "
                f"{_describe(last.output)}, the stage sent {_describe(sent)} (intermediate tensors)"
            )
        return shape
    [norm_call] = rec.of("final norm")
    normed = _tensors(norm_call.output)[0]
    if normed is None or normed.dim() != 2 or normed.shape[0] != check.tokens:
        raise StreamProofError(
            _message(
                [
                    f"final norm ({type(norm).__name__}) returned "
                    f"{_describe(norm_call.output)}, not [{check.tokens}, hidden]"
                ]
            )
        )
    model_out = _tensors(output[0] if isinstance(output, tuple) else output)[0]
    if model_out is None or not torch.equal(model_out, normed):
        findings.append(
            f"the model's output is not its final norm's output ({type(norm).__name__}): "
            "the module taken for the final norm is not the last step"
        )
    return (check.tokens, normed.shape[1])


def verify_aux(
    layers: Sequence[nn.Module],
    norm: nn.Module,
    conventions: dict[int, StreamConvention],
    check: CheckForward,
    sources: dict[int, str],
) -> None:
    """Run the installed model once more: every aux output must equal the proven stream, bit for bit."""
    n = len(layers)
    expected: dict[int, torch.Tensor] = {}
    handles = []
    for k, conv in conventions.items():
        module = layers[k] if k < n else norm

        def keep(mod, args, kwargs, k=k, conv=conv):
            parts = [read(args, kwargs, w) for w in conv.slots]
            expected[k] = (parts[0] + parts[1] if len(parts) == 2 else parts[0]).clone()

        handles.append(module.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with check.context(), torch.inference_mode():
            output = check.run()
    finally:
        for handle in handles:
            handle.remove()
    ids = sorted(conventions)
    if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], (list, tuple))):
        raise StreamProofError(f"the installed model returned {_describe(output)}, not (hidden, aux list)")
    aux = list(output[1])
    if len(aux) != len(ids):
        raise StreamProofError(f"the installed model returned {len(aux)} aux states for ids {ids}")
    wrong = []
    for k, got in zip(ids, aux):
        want = expected[k]
        if got is None or got.shape != want.shape or not torch.equal(got, want):
            conv = conventions[k]
            diff = (
                "shape " + str(tuple(got.shape))
                if got is not None and got.shape != want.shape
                else f"max abs difference {(got.float() - want.float()).abs().max().item():.3g}"
                if got is not None
                else "nothing"
            )
            wrong.append(
                f"aux id {k} ({sources[k]}) at {conv.consumer} ({conv.class_name}): recorded "
                f"{diff} from the proven stream ({conv.kind})"
            )
    if wrong:
        raise StreamProofError(_message(wrong))


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}"
    if value is None:
        return "None"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__


def _short(order: list[str]) -> str:
    return ", ".join(order[:12]) + (f", ... ({len(order)} calls)" if len(order) > 12 else "")


def _message(findings: Sequence[str]) -> str:
    return (
        "the residual stream could not be established on the loaded model, so the capture is refused "
        "(it would record something else): " + "; ".join(findings)
    )
