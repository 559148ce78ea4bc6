"""One pipeline stage's share of the capture (``--pipeline-parallel-size`` above 1).

vLLM 0.16 gives stage ``s`` of ``P`` the decoder layers ``start .. end - 1``
(the decoder's ``start_layer`` / ``end_layer``; the other entries of its layer
list are ``PPMissingLayer``): the first stage embeds, the last holds the final
norm and samples, and between stages the stream travels as intermediate
tensors (``hidden_states``, ``residual``: what a stage's last layer returned).

**Which ids a stage captures.** vLLM aux id ``k`` is the stream at the input
of decoder layer ``k``, so the stage holding layer ``k`` captures it; id ``n``
(after the last layer) is the last stage's. An id at a boundary (``k`` = the
first layer of stage ``s + 1``) is captured on stage ``s + 1`` from what its
first layer receives; the stream proof establishes on stage ``s`` that what it
sends is exactly what its last layer returned, and on stage ``s + 1`` that its
first layer receives exactly what arrived
(:func:`~speculators_v016.worker.stream_proof.prove_streams` with a
:class:`StageLayers`). No aux state travels through vLLM's intermediate
tensors: each stage's TP rank 0 copies its own layers into its rows of the
shared ring slot (:meth:`StageLayers.rows`), and the engine joins the stages'
replies (:mod:`speculators_v016.engine.stages`).

Three facts of vLLM 0.16 handled here:

1. Its built-in aux outputs (``SupportsEagle3``) count ids from the stage's
   first layer and are dropped on every stage but the last, so under pipeline
   parallelism every id is a tap (:func:`pipeline_capture_mode`).
2. A non-last stage's ``execute_model`` returns its intermediate tensors
   before it keeps any step state (``execute_model_state`` stays None, the aux
   list is dropped): :class:`LastForwardAux` keeps the aux list of the
   runner's last forward, which the capture takes once.
3. **A bug** (PP with async scheduling and chunked prefill): on a non-last
   stage the runner's ``_update_states`` sets a running request's
   ``num_tokens_no_spec`` to its computed tokens (async scheduling sends no
   token ids to the stages: ``gpu_model_runner.py`` lines 1096-1103), shorter
   than its prompt while its prefill is chunked; when another request finishes
   in that step, ``InputBatch.condense`` moves the row by ``num_tokens_no_spec``
   tokens only (``gpu_input_batch.py`` lines 675-686), and the rest of the
   prompt is lost on the first stage: every later chunk embeds stale token ids
   (every layer of those rows 1.3-2.3 off, greedy tokens diverge; sync
   scheduling is right). :func:`keep_prompt_rows` makes the condense move at
   least the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


class StageError(RuntimeError):
    """A pipeline stage's layers are not what the capture can prove and attribute."""


@dataclass(frozen=True)
class StageLayers:
    """The decoder layers one pipeline stage holds, and so the vLLM aux ids it captures."""

    rank: int  # pipeline rank of the stage
    size: int  # pipeline stages
    start: int  # first decoder layer held
    end: int  # one past the last
    num_layers: int  # the model's decoder layers

    def __post_init__(self) -> None:
        n, first, last = self.num_layers, self.rank == 0, self.rank == self.size - 1
        if not (0 <= self.rank < self.size and 0 <= self.start < self.end <= n):
            raise StageError(f"stage {self.rank} of {self.size} holds layers {self.start}..{self.end - 1} of {n}")
        if (self.start == 0) != first or (self.end == n) != last:
            raise StageError(
                f"stage {self.rank} of {self.size} holds layers {self.start}..{self.end - 1} of {n}: "
                "the first stage must start at layer 0 and only the last may end at the last layer"
            )

    @classmethod
    def whole(cls, num_layers: int) -> StageLayers:
        """No pipeline parallelism: one stage holding every layer."""
        return cls(0, 1, 0, num_layers, num_layers)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns(self, k: int) -> bool:
        """Is vLLM aux id ``k`` (the input of layer ``k``; ``n``: after the last layer) captured here?"""
        return self.start <= k < self.end or (self.is_last and k == self.num_layers)

    def ids(self, capture_ids: Sequence[int]) -> tuple[int, ...]:
        """The ids of ``capture_ids`` (ascending) this stage captures."""
        return tuple(k for k in capture_ids if self.owns(k))

    def rows(self, capture_ids: Sequence[int]) -> tuple[int, int]:
        """``(first, end)``: where this stage's ids sit in the captured stack (contiguous, as ids ascend)."""
        at = [j for j, k in enumerate(capture_ids) if self.owns(k)]
        if not at:
            first = sum(1 for k in capture_ids if k < self.start)
            return first, first
        if at != list(range(at[0], at[-1] + 1)):
            raise StageError(f"the ids {list(capture_ids)} are not ascending: stage {self.rank}'s are not contiguous")
        return at[0], at[-1] + 1

    def describe(self) -> str:
        return f"stage {self.rank} of {self.size}: layers {self.start}..{self.end - 1}"


def stage_of(decoder: Any, num_layers: int) -> StageLayers:
    """This process's stage: vLLM's pipeline group, checked against the layers its decoder holds."""
    from vllm.distributed import get_pp_group  # noqa: PLC0415 - vLLM only in a worker

    group = get_pp_group()
    start, end = getattr(decoder, "start_layer", 0), getattr(decoder, "end_layer", num_layers)
    return StageLayers(group.rank_in_group, group.world_size, start, end, num_layers)


def pipeline_capture_mode(mode: str, stage: StageLayers) -> str:
    """``taps`` for every id under pipeline parallelism (vLLM 0.16's built-in aux ids are stage-relative
    and dropped on non-last stages); ``mode`` unchanged without it."""
    return "taps" if stage.size > 1 else mode


class LastForwardAux:
    """The aux list of the runner's last forward, kept for a stage whose runner drops it (not the last).

    Wraps the runner's ``_model_forward`` (what ``execute_model`` calls; warm-up
    and profiling runs call the model directly): with
    ``use_aux_hidden_state_outputs`` on, the model returns ``(hidden, aux)``.
    :meth:`take` hands the list out once: a capture never reads a forward twice.
    """

    def __init__(self, runner: Any):
        self.aux: list | None = None
        inner = runner._model_forward

        def forward(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.aux = list(out[1]) if isinstance(out, tuple) and len(out) == 2 else None
            return out

        runner._model_forward = forward

    def take(self, step: int) -> list:
        aux, self.aux = self.aux, None
        if aux is None:
            raise RuntimeError(
                f"step {step}: this pipeline stage ran no forward with aux outputs since its last capture"
            )
        return aux


def keep_prompt_rows(runner: Any) -> None:
    """Work around vLLM 0.16's lost prompt tokens on non-last stages with async scheduling (module doc, 3).

    Before each ``condense`` of the runner's input batch, every row's
    ``num_tokens_no_spec`` is raised to its prompt's length (the prompt is
    always whole in ``token_ids_cpu``: ``add_request`` wrote it), so a moved row
    keeps its whole prompt. Installed on whichever input batch the runner holds
    when a step starts (vLLM may make a new one when the KV cache is set up).
    """
    inner = runner._update_states

    def update_states(scheduler_output):
        batch = runner.input_batch
        if not getattr(batch, "_speculators_keeps_prompt_rows", False):
            condense = batch.condense

            def condense_keeping_prompts():
                held = [i for i, rid in enumerate(batch._req_ids) if rid is not None]
                if held:
                    rows = batch.num_tokens_no_spec
                    rows[held] = np.maximum(rows[held], batch.num_prompt_tokens[held])
                return condense()

            batch.condense = condense_keeping_prompts
            batch._speculators_keeps_prompt_rows = True
        return inner(scheduler_output)

    runner._update_states = update_states
