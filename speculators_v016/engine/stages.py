"""Pipeline stages on the engine side: which stage captures which layers, and one step's replies joined.

Under pipeline parallelism (``--pipeline-parallel-size`` P) TP rank 0 of every
stage captures the layers its stage holds into its rows of the step's ring
slot and replies with the step's metadata (:mod:`speculators_v016.worker.pipeline_stage`).
:func:`check_stage_plan` checks at start-up that the stages' layers tile the
layer plan; :func:`join_stages` makes one capture of a step's replies, after
checking that every stage computed the same requests, starts and counts (the
assembler then checks them once more against the scheduler's output, as
without stages): a stage that ran another batch, or missed a step, is an
:class:`~speculators_v016.engine.assembly.AttributionError`, never a guess.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speculators_v016.engine.assembly import AttributionError
from speculators_v016.protocol import StepCapture


class StagePlanError(RuntimeError):
    """The pipeline stages' layers do not cover the layer plan exactly."""


def capture_ranks(world_size: int, tensor_parallel_size: int, pipeline_parallel_size: int) -> tuple[int, ...]:
    """TP rank 0 of every stage, in stage order (vLLM's ranks: ``stage x TP + TP rank``); () without stages."""
    if pipeline_parallel_size <= 1:
        return ()
    if world_size != tensor_parallel_size * pipeline_parallel_size:
        raise StagePlanError(
            f"{world_size} workers for TP {tensor_parallel_size} x PP {pipeline_parallel_size}: "
            "the capture knows no such layout"
        )
    return tuple(stage * tensor_parallel_size for stage in range(pipeline_parallel_size))


def check_stage_plan(infos: Sequence[dict], capture_ids: Sequence[int], tensor_parallel_size: int) -> list[str]:
    """Every worker's set-up agrees with its rank's stage, and the stages' ids tile ``capture_ids`` in order;
    returns one line per stage (its layers, and the plan's ids it captures). Raises StagePlanError."""
    stages: dict[int, dict] = {}
    for rank, info in enumerate(infos):
        stage = info.get("stage", 0)
        if stage != rank // tensor_parallel_size:
            raise StagePlanError(f"worker {rank} holds pipeline stage {stage}, expected {rank // tensor_parallel_size}")
        seen = stages.setdefault(stage, info)
        keys = ("stage_layers", "stage_ids", "stage_rows")
        if any(seen.get(k) != info.get(k) for k in keys):
            raise StagePlanError(
                f"the TP ranks of stage {stage} disagree on their layers: "
                f"{ {k: seen.get(k) for k in keys} } vs { {k: info.get(k) for k in keys} }"
            )
    ids, end, lines = [], 0, []
    for stage in sorted(stages):
        info = stages[stage]
        first, last = info["stage_rows"]
        if first != end or last - first != len(info["stage_ids"]):
            raise StagePlanError(f"stage {stage} fills rows {first}..{last - 1} of the captured stack after row {end}")
        end = last
        ids += info["stage_ids"]
        start, stop = info["stage_layers"]
        lines.append(f"stage {stage}: layers {start}..{stop - 1}, captures vLLM aux ids {info['stage_ids'] or 'none'}")
    if ids != list(capture_ids):
        raise StagePlanError(f"the stages capture vLLM aux ids {ids}, the layer plan asks for {list(capture_ids)}")
    return lines


def join_stages(replies: Sequence[StepCapture | None], num_ids: int) -> StepCapture | None:
    """One step's capture from its stages' replies (None where no stage has one pending)."""
    got = [c for c in replies if c is not None]
    if not got:
        return None
    if len(got) == 1 and got[0].layers is None:
        return got[0]
    if any(c.layers is None for c in got):
        raise AttributionError(f"step {got[0].step}: a capture of every layer among the replies of pipeline stages")
    got.sort(key=lambda c: c.layers)
    first = got[0]
    for other in got[1:]:
        mine = (first.step, first.slot, first.req_ids, first.starts, first.counts)
        theirs = (other.step, other.slot, other.req_ids, other.starts, other.counts)
        if mine != theirs:
            raise AttributionError(
                f"pipeline stages disagree on a step: stage {first.stage} captured (step, slot, requests, starts, "
                f"counts) {mine}, stage {other.stage} {theirs}"
            )
    end = 0
    for c in got:
        if c.layers[0] != end or c.layers[1] <= c.layers[0]:
            raise AttributionError(
                f"step {first.step}: stage {c.stage} filled rows {c.layers} of the captured stack after row {end}"
            )
        end = c.layers[1]
    if end != num_ids:
        raise AttributionError(f"step {first.step}: the stages filled {end} of {num_ids} captured layers")
    joined = StepCapture(first.step, first.req_ids, first.starts, first.counts, first.slot)
    # the NaN/Inf proof: only where every stage proved its layers
    joined.finite = True if all(c.finite is True for c in got) else None
    if first.slot is None:  # no ring (Ray): each stage's layers travelled in its reply
        joined.states = torch.cat([c.states for c in got])
        joined.scales = torch.cat([c.scales for c in got]) if first.scales is not None else None
    return joined
