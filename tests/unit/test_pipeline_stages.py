"""Pipeline stages: which ids a stage captures, the stages' replies joined, the plan checked, vLLM's lost prompt rows."""

import numpy as np
import pytest
import torch

from speculators_v016.engine.assembly import AttributionError
from speculators_v016.engine.stages import StagePlanError, capture_ranks, check_stage_plan, join_stages
from speculators_v016.protocol import StepCapture
from speculators_v016.worker.pipeline_stage import LastForwardAux, StageError, StageLayers, keep_prompt_rows

IDS = (1, 3, 4, 7, 8)  # vLLM aux ids of an 8-layer model: layer inputs 1, 3, 4, 7 and the final norm's (8)


def test_each_id_is_captured_on_the_stage_holding_its_layer():
    """Id k on the stage holding layer k; the boundary id on the later stage; id n on the last stage."""
    first, last = StageLayers(0, 2, 0, 4, 8), StageLayers(1, 2, 4, 8, 8)
    assert first.ids(IDS) == (1, 3) and last.ids(IDS) == (4, 7, 8)
    assert first.rows(IDS) == (0, 2) and last.rows(IDS) == (2, 5)
    assert not first.owns(4) and last.owns(4)  # layer 4's input: the first layer of stage 1
    assert first.owns(3) and not last.owns(3)  # layer 3: the last layer of stage 0


def test_an_uneven_split_and_a_stage_without_ids():
    """Stages of 2 and 6 layers; a stage none of whose layers is asked for captures nothing, in place."""
    stages = [StageLayers(0, 3, 0, 2, 8), StageLayers(1, 3, 2, 5, 8), StageLayers(2, 3, 5, 8, 8)]
    assert [s.ids((1, 6, 8)) for s in stages] == [(1,), (), (6, 8)]
    assert [s.rows((1, 6, 8)) for s in stages] == [(0, 1), (1, 1), (1, 3)]
    assert StageLayers.whole(8).ids(IDS) == IDS


@pytest.mark.parametrize(
    "stage",
    [(0, 2, 1, 4, 8), (1, 2, 4, 7, 8), (0, 2, 0, 8, 8), (2, 2, 0, 4, 8), (0, 1, 0, 9, 8)],
    ids=["first-not-at-0", "last-short", "first-holds-all", "rank-out-of-range", "past-the-end"],
)
def test_stage_layouts_the_capture_cannot_prove_are_refused(stage):
    """A first stage not starting at layer 0, a last one not ending at the last, ranks out of range: refused."""
    with pytest.raises(StageError, match="stage"):
        StageLayers(*stage)


def test_capture_ranks_are_tp_rank_0_of_each_stage():
    """TP 2 x PP 2: ranks 0 and 2 capture; no stages: none (the output rank alone, as before)."""
    assert capture_ranks(4, 2, 2) == (0, 2)
    assert capture_ranks(2, 1, 2) == (0, 1)
    assert capture_ranks(8, 8, 1) == ()
    with pytest.raises(StagePlanError, match="6 workers for TP 2 x PP 2"):
        capture_ranks(6, 2, 2)


def _info(stage, layers, ids, rows):
    return {"stage": stage, "stage_layers": list(layers), "stage_ids": list(ids), "stage_rows": list(rows)}


def test_stage_plan_tiles_the_layer_plan():
    """Two stages whose ids tile the plan pass, with a line per stage; a gap, a disagreeing TP rank, a wrong id fail."""
    good = [_info(0, (0, 4), (1, 3), (0, 2)), _info(0, (0, 4), (1, 3), (0, 2)),
            _info(1, (4, 8), (4, 7, 8), (2, 5)), _info(1, (4, 8), (4, 7, 8), (2, 5))]  # fmt: skip
    lines = check_stage_plan(good, IDS, tensor_parallel_size=2)
    assert lines == ["stage 0: layers 0..3, captures vLLM aux ids [1, 3]",
                     "stage 1: layers 4..7, captures vLLM aux ids [4, 7, 8]"]  # fmt: skip
    with pytest.raises(StagePlanError, match="TP ranks of stage 1 disagree"):
        check_stage_plan(good[:3] + [_info(1, (4, 8), (4, 7), (2, 4))], IDS, 2)
    with pytest.raises(StagePlanError, match="worker 1 holds pipeline stage 1, expected 0"):
        check_stage_plan(good[::2], IDS, 2)
    shifted = [_info(0, (0, 4), (1, 3), (0, 2)), _info(1, (4, 8), (5, 7, 8), (2, 5))]  # one id one layer late
    with pytest.raises(StagePlanError, match=r"capture vLLM aux ids \[1, 3, 5, 7, 8\].*\[1, 3, 4, 7, 8\]"):
        check_stage_plan(shifted, IDS, 1)
    with pytest.raises(StagePlanError, match="stage 1 fills rows 3..4"):
        check_stage_plan([_info(0, (0, 4), (1, 3), (0, 2)), _info(1, (4, 8), (4, 7), (3, 5))], IDS, 1)


def _capture(stage, layers, req_ids=("a", "b"), starts=(0, 16), counts=(5, 3), slot=1, states=None):
    return StepCapture(7, list(req_ids), list(starts), list(counts), slot, states, None, layers, stage)


def test_stage_replies_join_into_one_capture():
    """Stages' replies in any order become one capture of every layer; without a ring their states are stacked."""
    joined = join_stages([None, _capture(1, (2, 5)), None, _capture(0, (0, 2))], 5)
    assert (joined.step, joined.slot, joined.req_ids, joined.layers) == (7, 1, ["a", "b"], None)
    a, b = torch.zeros(2, 8, 4), torch.ones(3, 8, 4)
    joined = join_stages([_capture(0, (0, 2), slot=None, states=a), _capture(1, (2, 5), slot=None, states=b)], 5)
    assert torch.equal(joined.states, torch.cat([a, b]))
    assert join_stages([None, None], 5) is None
    whole = _capture(0, None)
    assert join_stages([whole], 5) is whole  # no pipeline: the output rank's reply as it is


def test_a_joined_step_is_proven_finite_only_where_every_stage_proved_its_layers():
    """The NaN/Inf proof of a step under PP: every stage's, or none (the writers then test the bytes)."""

    def replies(first, second):
        one, two = _capture(0, (0, 2)), _capture(1, (2, 5))
        one.finite, two.finite = first, second
        return [one, two]

    assert join_stages(replies(True, True), 5).finite is True
    for first, second in [(True, None), (None, True), (False, True), (None, None)]:
        assert join_stages(replies(first, second), 5).finite is None, (first, second)


@pytest.mark.parametrize(
    "second, message",
    [
        (_capture(1, (2, 5), starts=(0, 15)), "pipeline stages disagree on a step"),
        (_capture(1, (2, 5), req_ids=("b", "a")), "pipeline stages disagree on a step"),
        (_capture(1, (2, 5), slot=2), "pipeline stages disagree on a step"),
        (_capture(1, (3, 5)), r"stage 1 filled rows \(3, 5\) of the captured stack after row 2"),
        (_capture(1, (2, 4)), "the stages filled 4 of 5 captured layers"),
    ],
    ids=["starts", "batch-order", "slot", "gap", "short"],
)
def test_stages_that_disagree_are_an_attribution_error(second, message):
    """Another batch order, start, slot, a gap or a missing layer on one stage: refused, naming the stages."""
    with pytest.raises(AttributionError, match=message):
        join_stages([_capture(0, (0, 2)), second], 5)


def test_a_missing_stage_reply_is_refused():
    """One stage's capture without the other's (a stage that missed a step): refused."""
    with pytest.raises(AttributionError, match="filled 2 of 5"):
        join_stages([_capture(0, (0, 2)), None], 5)


class _Runner:
    def __init__(self):
        self.calls = 0

    def _model_forward(self, **kwargs):
        self.calls += 1
        return "intermediate", [torch.full((3, 2), float(self.calls))]


def test_last_forward_aux_is_taken_once():
    """A stage's aux list is kept from its last forward and handed out once: never read twice."""
    runner = _Runner()
    kept = LastForwardAux(runner)
    assert runner._model_forward(input_ids=None) == ("intermediate", kept.aux)
    assert kept.take(1)[0][0, 0] == 1.0
    with pytest.raises(RuntimeError, match="step 2: this pipeline stage ran no forward"):
        kept.take(2)
    runner._model_forward()
    assert kept.take(3)[0][0, 0] == 2.0


class _Batch:
    """vLLM 0.16's InputBatch condense, as far as it concerns the rows' token ids (gpu_input_batch.py 640-690)."""

    def __init__(self, prompts):
        self._req_ids = [f"r{i}" for i in range(len(prompts))]
        self.num_prompt_tokens = np.array([len(p) for p in prompts])
        self.num_tokens_no_spec = self.num_prompt_tokens.copy()
        self.token_ids_cpu = np.zeros((4, 16), dtype=np.int64)
        for i, p in enumerate(prompts):
            self.token_ids_cpu[i, : len(p)] = p

    def condense(self):
        empty, last = self._req_ids.index(None), len(self._req_ids) - 1
        n = self.num_tokens_no_spec[last]
        self.token_ids_cpu[empty, :n] = self.token_ids_cpu[last, :n]
        self.num_tokens_no_spec[empty] = n
        self.num_prompt_tokens[empty] = self.num_prompt_tokens[last]
        self._req_ids[empty], self._req_ids[last] = self._req_ids[last], None


class _StageRunner:
    def __init__(self, batch):
        self.input_batch = batch

    def _update_states(self, scheduler_output):
        """As vLLM 0.16 on a non-last stage with async scheduling: request 0 finishes, request 1 (half of its
        chunked prompt computed) gets num_tokens_no_spec = its computed tokens, then the batch condenses."""
        batch = self.input_batch
        batch._req_ids[0] = None
        batch.num_tokens_no_spec[1] = 4
        batch.condense()


@pytest.mark.parametrize("kept", [False, True], ids=["vllm", "kept"])
def test_a_moved_row_keeps_its_whole_prompt(kept):
    """vLLM's condense moves a chunked prompt's row by its computed tokens and loses the rest; kept, it moves the prompt."""
    prompt = list(range(100, 110))
    runner = _StageRunner(_Batch([[1, 2, 3], prompt]))
    if kept:
        keep_prompt_rows(runner)
    runner._update_states(None)
    moved = runner.input_batch.token_ids_cpu[0, :10].tolist()
    assert (moved == prompt) is kept
    if not kept:
        assert moved[4:] == [0] * 6  # the prompt's remaining tokens are gone: the planted vLLM bug
