"""A vLLM logits processor for the tests: the target's first generated tokens forced to given ids.

A tiny random model never writes a tool call by itself; the tool-turn tests of ``--regenerate`` need one
that does. This processor, loaded by the real engine (``--engine-args '{"logits_processors":
["speculators_v016.testing.forced_tokens:ForcedTokens"]}'``), leaves every logit but the forced token's at
-inf for the first steps of each request whose prompt does not hold ``unless_prompt_has``, so the engine
itself samples the forced ids: the capture, the stop decision, the journal and the samples are the run's own.
The raw logprobs vLLM reports (what the logit check compares) are computed before logits processors run.

The rule comes from the environment: ``SPECULATORS_V016_FORCED_TOKENS='{"force": [ids], "unless_prompt_has":
[ids]}'`` (no variable: nothing forced).
"""

from __future__ import annotations

import json
import os

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

VARIABLE = "SPECULATORS_V016_FORCED_TOKENS"
SPEC = "speculators_v016.testing.forced_tokens:ForcedTokens"


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


class ForcedTokens(LogitsProcessor):
    """Forces the ids of ``SPECULATORS_V016_FORCED_TOKENS`` as the first tokens of the requests it applies to."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        rule = json.loads(os.environ.get(VARIABLE) or "{}")
        self.force: list[int] = [int(i) for i in rule.get("force", [])]
        self.unless: list[int] | None = rule.get("unless_prompt_has")
        self.outputs: dict[int, list[int]] = {}  # batch row -> the request's output ids (vLLM's running list)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.outputs.pop(row, None)
        for row, _params, prompt, output in batch_update.added:
            self.outputs.pop(row, None)
            if self.force and not (self.unless and _holds(list(prompt or []), self.unless)):
                self.outputs[row] = output
        for a, b, direction in batch_update.moved:
            first, second = self.outputs.pop(a, None), self.outputs.pop(b, None)
            if first is not None:
                self.outputs[b] = first
            if direction == MoveDirectionality.SWAP and second is not None:
                self.outputs[a] = second

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, output in self.outputs.items():
            step = len(output)  # placeholders of tokens in flight (async scheduling) included
            if step < len(self.force) and row < logits.shape[0]:
                token = self.force[step]
                logits[row, :token] = float("-inf")
                logits[row, token + 1 :] = float("-inf")
        return logits
