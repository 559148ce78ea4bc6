"""``speculators-data-gen check``: the engine's hidden states against vLLM's logits and transformers.

:func:`check` runs a handful of samples through the generator, then (1) the
logit check (:mod:`~speculators_v016.checks.logit_check`, any size of target) and
(2), where transformers can load the target, compares every requested layer
with transformers on the same weights (:mod:`~speculators_v016.checks.fidelity`),
and (3) replays every requested layer ``L >= 1`` in transformers from the captured
layer ``L - 1`` (:mod:`~speculators_v016.checks.layer_replay`: one layer's weights
at a time, so any size of target; ``L - 1`` is captured for the check where it was
not requested). It returns a :class:`CheckReport`; the CLI prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer

from speculators_v016.checks.fidelity import (
    RELATIVE_TOLERANCE,
    ROW_BOUNDS,
    LayerError,
    compare,
    reference_layer_outputs,
)
from speculators_v016.checks.layer_replay import ReplayReport, replay_inputs, replay_layers
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.config import CheckConfig
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.layers import LayerPlan
from speculators_v016.run.prepared import prepare_samples
from speculators_v016.target import TargetInfo


@dataclass
class CheckReport:
    samples: int
    engine_dtype: str
    logit_line: str
    logits_ok: bool
    layers: list[LayerError] = field(default_factory=list)  # empty: transformers not run
    replay: ReplayReport | None = None
    stream_margins: list[str] = field(default_factory=list)  # the start-up stream proof, per consumer

    @property
    def ok(self) -> bool:
        return self.logits_ok and all(e.ok for e in self.layers) and (self.replay is None or self.replay.ok)

    def lines(self) -> list[str]:
        out = [f"stream proof: {line}" for line in self.stream_margins]
        out.append(f"logit check: {self.logit_line}")
        if self.layers:
            out.append(f"{self.samples} samples, engine dtype {self.engine_dtype}, reference transformers float32")
            out.append(
                f"{'layer':>6} {'max abs err':>12} {'relative':>10} {'median row':>10} {'rows past':>9} "
                f"{'tolerance':>16}  result"
            )
            for e in self.layers:
                bound = f"{e.row_bounds[0]:.1e}/{e.row_bounds[1]:.0e}" if e.row_bounds else f"{e.tolerance:.1e}"
                out.append(
                    f"{e.layer:>6} {e.max_abs:>12.3e} {e.relative:>10.3e} {e.median_row:>10.2e} {e.rows_past:>9.1%} "
                    f"{bound:>16}  {'pass' if e.ok else 'FAIL'}"
                )
        if self.replay is not None:
            out += self.replay.lines()
        return out


def check(config: CheckConfig) -> CheckReport:
    """Run ``config.samples`` samples of the dataset through the engine and check their states.

    ``config.transformers=False`` skips only the whole-model comparison (targets
    that do not fit here); the logit check and the layer replay run anyway.
    """
    model = config.engine.model
    tokenizer = AutoTokenizer.from_pretrained(
        config.engine.tokenizer, trust_remote_code=config.engine.trust_remote_code
    )
    prepared = prepare_samples(
        list(config.train_data_path), tokenizer, config.seq_length, max_samples=config.samples, num_proc=1
    )
    prompts = prepared.input_ids[: config.samples]
    num_layers = TargetInfo.read(model, config.engine.trust_remote_code).num_layers
    plan = LayerPlan.build(num_layers, config.layer_ids)
    # the layers asked for, plus the input of each (captured for the replay only), ascending
    captured = LayerPlan.build(num_layers, sorted({*plan.layer_ids, *replay_inputs(plan.layer_ids)}))
    with VllmHiddenStatesGenerator.from_config(config.engine, captured) as gen:
        engine = gen.engine
        checker = LogitChecker(model, engine.dtype, captured.last_layer_index)
        results: list = [None] * len(prompts)
        for index, ids, states in engine.stream(enumerate(prompts), prompt_logprobs=lambda _: checker.active):
            results[index] = {"input_ids": torch.tensor(ids), "hidden_states": states}
            if checker.active:
                checker.add(index, results[index]["input_ids"], states, engine.prompt_logprobs.pop(index))
        engine_dtype = str(engine.dtype).removeprefix("torch.")
        stages = {info.get("stage", 0): info for info in reversed(engine.capture_info)}  # TP rank 0 of each stage
        margins = [m for stage in sorted(stages) for m in stages[stage].get("stream_margins", {}).values()]
    by_layer = [dict(zip(captured.layer_ids, r["hidden_states"])) for r in results]
    logits_ok = checker.result.ok or (bool(checker.result.unavailable) and config.transformers)
    report = CheckReport(len(prompts), engine_dtype, checker.result.line(), logits_ok, stream_margins=margins)
    report.replay = replay_layers(
        model,
        by_layer,
        list(plan.layer_ids),
        RELATIVE_TOLERANCE.get(engine_dtype, 5e-2),
        config.engine.trust_remote_code,
        ROW_BOUNDS.get(engine_dtype),
    )
    if config.transformers:
        reference = reference_layer_outputs(model, prompts, torch.float32, config.engine.trust_remote_code)
        requested = [{"hidden_states": [states[layer] for layer in plan.layer_ids]} for states in by_layer]
        report.layers = compare(requested, reference, list(plan.layer_ids), engine_dtype)
    return report
