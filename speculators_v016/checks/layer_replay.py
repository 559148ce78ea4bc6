"""Replay single decoder layers in transformers from the captured stream: catches a wrong intermediate layer.

The logit check sees only the last layer. For a captured layer ``L`` whose
input (our layer ``L - 1``) is captured too, transformers' decoder layer ``L``
is run on the captured input and its output compared with the captured
output: a tap that reads the wrong layer, or the wrong combination of a
layer's arguments, shows up as an error at the scale of the stream. Only that
layer's weights are read from the checkpoint (safetensors, by name), so it
works for targets of any size: the model's skeleton is built without
parameters (``init_empty_weights``; buffers such as rotary frequencies are
real), its decoder-layer list is cut down to the one layer, and the model's
own forward runs (it computes rotary embeddings and masks as the family needs)
with that layer's input replaced by the captured stream; it stops right after
the layer. In fp32, whatever the engine's dtype.

Where transformers has no implementation of the model (or its checkpoint is
quantized, which transformers' layer cannot take as such), the replay says so
and is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.accelerate import init_empty_weights

from speculators_v016.checks.fidelity import FLIPPED_ROWS, row_errors


@dataclass
class ReplayError:
    layer: int  # the replayed decoder layer (our id: its output)
    source: int  # the captured layer it starts from (its input)
    max_abs: float
    relative: float
    tolerance: float
    median_row: float = 0.0  # median over rows of ||replayed - captured|| / ||captured||
    rows_past: float = 0.0  # fraction of rows past the row bound
    row_bounds: tuple[float, float] | None = None  # bf16/fp16 engines: judged per row (checks/fidelity.py)

    @property
    def ok(self) -> bool:
        if self.row_bounds is None:
            return self.relative <= self.tolerance
        return self.median_row <= self.row_bounds[0] and self.rows_past <= FLIPPED_ROWS


@dataclass
class ReplayReport:
    rows: list[ReplayError]
    skipped: str = ""  # why nothing was replayed (transformers has no implementation, ...)
    not_replayed: tuple[int, ...] = ()  # requested layers without a captured input (layer 0)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def lines(self) -> list[str]:
        if self.skipped:
            return [f"layer replay: skipped ({self.skipped})"]
        out = [
            "layer replay: transformers' decoder layer L (fp32, its weights only) on our captured input "
            "(layer L-1) against our captured layer L",
            f"{'':>7}{'layer':>6} {'from':>5} {'max abs':>12} {'relative':>10} {'median row':>10} {'rows past':>9} "
            f"{'tolerance':>16}  result",
        ]
        for r in self.rows:
            bound = f"{r.row_bounds[0]:.1e}/{r.row_bounds[1]:.0e}" if r.row_bounds else f"{r.tolerance:.1e}"
            out.append(
                f"replay {r.layer:>6} {r.source:>5} {r.max_abs:>12.3e} {r.relative:>10.3e} {r.median_row:>10.2e} "
                f"{r.rows_past:>9.1%} {bound:>16}  {'pass' if r.ok else 'FAIL'}"
            )
        if self.not_replayed:
            out.append(
                f"layer replay: layers {list(self.not_replayed)} not replayed (no captured input: "
                "the embeddings are not captured)"
            )
        return out


class ReplayUnavailable(RuntimeError):
    """transformers cannot replay this model's layers (says why)."""


def replay_inputs(layer_ids: Sequence[int]) -> list[int]:
    """The extra layers to capture so that every requested layer ``L >= 1`` has its input ``L - 1`` captured."""
    have = set(layer_ids)
    return sorted({i - 1 for i in layer_ids if i >= 1} - have)


class LayerReplayer:
    """transformers' decoder layers of one checkpoint, built and loaded one at a time."""

    def __init__(self, model_path: str, trust_remote_code: bool = False):
        self.path = Path(model_path)
        try:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except (ValueError, KeyError, OSError) as exc:
            raise ReplayUnavailable(f"transformers cannot read this model's config: {exc}") from None
        if getattr(config, "quantization_config", None) is not None:
            raise ReplayUnavailable("quantized checkpoint: transformers' layer cannot take its weights as stored")
        config = getattr(config, "get_text_config", lambda: config)()
        try:
            with init_empty_weights(include_buffers=False):
                self.model = AutoModelForCausalLM.from_config(
                    config, dtype=torch.float32, trust_remote_code=trust_remote_code
                ).eval()
        except ValueError as exc:
            raise ReplayUnavailable(
                f"transformers has no causal-LM implementation of "
                f"{getattr(config, 'model_type', '?')}: {str(exc).splitlines()[0]}"
            ) from None
        self.owner, self.attr, self.layers = _layer_list(self.model)
        self.prefix = next(name for name, m in self.model.named_modules() if m is self.layers)
        self.weight_map = _weight_map(self.path)

    def replay(self, layer: int, layer_input: torch.Tensor) -> torch.Tensor:
        """transformers' decoder layer ``layer`` on ``layer_input`` ([tokens, hidden], positions 0..T-1), fp32."""
        module = self.layers[layer]
        self._load(layer, module)
        captured: dict[str, torch.Tensor] = {}

        class _Stop(Exception):
            pass

        def swap_input(mod, args, kwargs):
            stream = layer_input.float()[None]
            if args:
                return (stream, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": stream}

        def keep_output(mod, args, kwargs, output):
            captured["out"] = output[0] if isinstance(output, tuple) else output
            raise _Stop

        handles = [
            module.register_forward_pre_hook(swap_input, with_kwargs=True),
            module.register_forward_hook(keep_output, with_kwargs=True),
        ]
        original = getattr(self.owner, self.attr)
        setattr(self.owner, self.attr, nn.ModuleList([module]))
        # Models that pick each layer's mask by its index in config.layer_types (EXAONE 4: sliding or
        # global) would give the one-layer list layer 0's type: give it layer `layer`'s for the replay.
        config = self.model.config
        layer_types = getattr(config, "layer_types", None)
        if isinstance(layer_types, list) and len(layer_types) == len(original):
            config.layer_types = [layer_types[layer]]
        try:
            tokens = layer_input.shape[0]
            hidden = self.model.get_input_embeddings().embedding_dim
            with torch.no_grad():
                self.model(
                    inputs_embeds=torch.zeros(1, tokens, hidden),
                    use_cache=False,
                    position_ids=torch.arange(tokens)[None],
                )
        except _Stop:
            pass
        finally:
            setattr(self.owner, self.attr, original)
            if isinstance(layer_types, list) and len(layer_types) == len(original):
                config.layer_types = layer_types
            for handle in handles:
                handle.remove()
            _unload(module)
        if "out" not in captured:
            raise ReplayUnavailable(f"transformers' model never ran its decoder layer {layer}")
        return captured["out"][0]

    def _load(self, layer: int, module: nn.Module) -> None:
        wanted = {name: f"{self.prefix}.{layer}.{name}" for name, _ in module.named_parameters()}
        wanted |= {
            name: f"{self.prefix}.{layer}.{name}"
            for name, b in module.named_buffers()
            if name.split(".")[-1] not in module_non_persistent(module, name)
        }
        for name, key in list(wanted.items()):
            if key not in self.weight_map:  # the text model under another prefix (e.g. a multimodal checkpoint)
                found = [k for k in self.weight_map if k.endswith(f".{self.attr}.{layer}.{name}")]
                if len(found) != 1:
                    raise ReplayUnavailable(
                        f"the checkpoint has no tensor {key} (layer {layer}'s weights are "
                        "not stored under transformers' names)"
                    )
                wanted[name] = found[0]
        by_file: dict[str, list[tuple[str, str]]] = {}
        for name, key in wanted.items():
            by_file.setdefault(self.weight_map[key], []).append((name, key))
        state = {}
        for file, items in by_file.items():
            with safe_open(str(self.path / file), framework="pt") as f:
                for name, key in items:
                    state[name] = f.get_tensor(key).float()
        module.load_state_dict(state, strict=False, assign=True)
        left = [n for n, p in module.named_parameters() if p.is_meta]
        if left:
            raise ReplayUnavailable(f"layer {layer}: no checkpoint tensors for {left[:3]}")


def module_non_persistent(module: nn.Module, name: str) -> set[str]:
    owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
    return set(getattr(owner, "_non_persistent_buffers_set", ()))


def _unload(module: nn.Module) -> None:
    """Back to parameters without storage (a 1T target's layers are loaded one at a time)."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and not param.is_meta:
                sub._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)


def _layer_list(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    decoders = [model.get_decoder(), model.base_model, getattr(model, "model", None)]
    for decoder in decoders:
        for name in ("layers", "h", "blocks"):
            if isinstance(getattr(decoder, name, None), nn.ModuleList):
                return decoder, name, getattr(decoder, name)
    raise ReplayUnavailable(f"cannot find the decoder layers of transformers' {type(model).__name__}")


def _weight_map(path: Path) -> dict[str, str]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if not single.exists():
        raise ReplayUnavailable(f"no safetensors checkpoint in {path}")

    with safe_open(str(single), framework="pt") as f:
        return {key: single.name for key in f.keys()}


def replay_layers(
    model_path: str,
    samples: Sequence[dict[int, torch.Tensor]],
    layer_ids: Sequence[int],
    tolerance: float,
    trust_remote_code: bool = False,
    row_bounds: tuple[float, float] | None = None,
) -> ReplayReport:
    """Replay every requested layer ``L >= 1`` from captured ``L - 1``; ``samples``: our layer id -> [T, hidden].

    Passes where the largest error relative to the largest |value| of the captured layer is within ``tolerance``;
    with ``row_bounds`` (bf16/fp16 engines) where the median row is within the first and at most
    :data:`~speculators_v016.checks.fidelity.FLIPPED_ROWS` of the rows past the second.
    """
    todo = [layer for layer in layer_ids if layer >= 1]
    skipped = tuple(layer for layer in layer_ids if layer < 1)
    try:
        replayer = LayerReplayer(model_path, trust_remote_code)
    except ReplayUnavailable as exc:
        return ReplayReport([], str(exc))
    rows = []
    for layer in todo:
        worst_abs = worst_rel = 0.0
        errors = []
        try:
            for states in samples:
                got = replayer.replay(layer, states[layer - 1])
                want = states[layer].float()
                diff = (got - want).abs().max().item()
                worst_abs = max(worst_abs, diff)
                worst_rel = max(worst_rel, diff / max(want.abs().max().item(), 1e-12))
                errors.append(row_errors(got, want))
        except ReplayUnavailable as exc:
            return ReplayReport([], str(exc))
        per_row = torch.cat(errors) if errors else torch.zeros(1)
        past = (per_row > row_bounds[1]).float().mean().item() if row_bounds else 0.0
        rows.append(
            ReplayError(layer, layer - 1, worst_abs, worst_rel, tolerance, per_row.median().item(), past, row_bounds)
        )
    return ReplayReport(rows, not_replayed=skipped)
