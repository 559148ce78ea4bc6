"""The run's self-check: finished samples wait for the logit check, and what stops a run."""

import json

import pytest
import torch
from safetensors.torch import save_file

from speculators_v016.checks.self_check import HoldBack, NonFiniteError, SelfCheckError
from speculators_v016.checks.zero_embeddings import zero_embedding_ids
from speculators_v016.run import pipeline


class Checker:
    """A stand-in for the logit checker: passes every sample but those in ``failing``."""

    def __init__(self, failing=()):
        self.failing, self.released, self.last_passed = set(failing), False, True

    def add(self, name, input_ids, states, theirs):
        self.last_passed = name not in self.failing
        return 0.0 if self.last_passed else 1.0

    def release(self):
        self.released = True

    def describe_tolerance(self):
        return "5e-02"


def states(tokens: int = 4) -> list:
    return [torch.randn(tokens, 8), torch.randn(tokens, 8)]


def run(hold: HoldBack, order, theirs=lambda index: object()):
    for index in order:
        ids, h = torch.arange(4), states()
        hold.judge(index, index + 100, ids, h, theirs(index))
        hold.admit(index, index + 100, {"input_ids": ids, "hidden_states": h})


def test_samples_wait_until_every_checked_sample_passed():
    """Samples that finish before the checked ones are held; the last judgement writes them, in order."""
    written, checker = [], Checker()
    hold = HoldBack({0, 1}, checker, [2, 5], lambda name, sample: written.append(name))
    run(hold, [3, 0, 2])
    assert written == [] and not checker.released
    run(hold, [1])
    assert written == [103, 100, 102, 101] and checker.released
    run(hold, [4])
    assert written[-1] == 104  # nothing checked is left: written at once
    hold.finish()
    assert written == [103, 100, 102, 101, 104]


def test_nothing_checked_holds_nothing():
    written = []
    hold = HoldBack(set(), None, [2], lambda name, sample: written.append(name))
    run(hold, [0, 1], theirs=lambda index: None)
    assert written == [100, 101]


def test_a_checked_sample_without_logprobs_is_written_at_the_end():
    """vLLM gave no logprobs for a checked sample: it cannot be judged; what waited is written by finish()."""
    written, checker = [], Checker()
    hold = HoldBack({0}, checker, [2], lambda name, sample: written.append(name))
    run(hold, [1], theirs=lambda index: None)
    assert written == []
    hold.finish()
    assert written == [101] and not checker.released


def test_a_failed_logit_check_stops_before_anything_is_written():
    written = []
    hold = HoldBack({0, 1}, Checker(failing={101}), [2], lambda name, sample: written.append(name))
    run(hold, [2, 0])
    with pytest.raises(SelfCheckError, match=r"sample 101: .* \(3 finished samples held back"):
        run(hold, [1])
    assert written == []


@pytest.mark.parametrize("holding, kept", [(True, "nothing of this run was written"), (False, "is kept")])
def test_states_no_model_produces_stop_the_run(holding, kept):
    """A layer of zeros is refused, naming the sample, the layer id and what was written."""
    written = []
    hold = HoldBack({0} if holding else set(), Checker(), [2, 5], lambda name, sample: written.append(name))
    with pytest.raises(SelfCheckError, match=rf"sample 107, layer 5: .*{kept}"):
        hold.judge(7, 107, torch.arange(4), [torch.randn(4, 8), torch.zeros(4, 8)], None)


def test_the_pipeline_still_names_the_errors():
    """Callers that import the errors from the pipeline get the same classes."""
    assert pipeline.SelfCheckError is SelfCheckError and pipeline.NonFiniteError is NonFiniteError


def test_a_checked_sample_that_will_never_come_is_not_waited_for():
    """forget(): a checked turn --regenerate had no room for releases what waited; extras reach put."""
    written, checker = [], Checker()
    hold = HoldBack({0, 1}, checker, [2], lambda name, sample, record=None: written.append((name, record)))
    ids, h = torch.arange(4), states()
    hold.judge(0, 100, ids, h, object())
    hold.admit(0, 100, {"input_ids": ids, "hidden_states": h}, {"index": 100})
    assert written == [] and not checker.released
    hold.forget([1])
    assert written == [(100, {"index": 100})] and checker.released
    hold.forget([1])  # again: nothing more happens
    assert len(written) == 1


def test_a_zero_row_of_a_zero_embedding_token_does_not_stop_the_run():
    """HoldBack given the target's zero-embedding tokens: their zero rows pass, another token's zero row stops."""
    written = []
    hold = HoldBack(set(), None, [2, 5], lambda name, sample: written.append(name), frozenset({7}))
    h = [torch.randn(4, 8), torch.randn(4, 8)]
    for layer in h:
        layer[0] = 0
    hold.judge(0, 100, torch.tensor([7, 1, 2, 3]), h, None)
    with pytest.raises(SelfCheckError, match=r"sample 101, layer 2: rows \[0\] \(1 of 4\) are all 0") as caught:
        hold.judge(1, 101, torch.tensor([6, 1, 2, 3]), h, None)
    assert caught.value.finding == "sample 101, layer 2: rows [0] (1 of 4) are all 0"


def test_the_zero_embedding_rows_are_read_from_the_checkpoint_without_the_model(tmp_path):
    """The ids of all-zero rows of the embedding tensor, from one file or an index (shortest name wins); None
    where there is no safetensors checkpoint."""
    table = torch.randn(10, 4)
    table[[0, 6]] = 0
    other = torch.randn(10, 4)
    other[3] = 0  # an MTP layer's copy, or the output head: not the one read
    save_file({"model.embed_tokens.weight": table, "lm_head.weight": other}, tmp_path / "model.safetensors")
    assert zero_embedding_ids(tmp_path, 10) == {0, 6}
    assert zero_embedding_ids(tmp_path, 5) == {0}  # rows past the vocabulary are no tokens
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"model.layers.61.embed_tokens.weight": other}, sharded / "b.safetensors")
    save_file({"model.embed_tokens.weight": table.to(torch.bfloat16)}, sharded / "a.safetensors")
    weight_map = {"model.layers.61.embed_tokens.weight": "b.safetensors", "model.embed_tokens.weight": "a.safetensors"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert zero_embedding_ids(sharded, 10) == {0, 6}
    assert zero_embedding_ids(tmp_path / "absent", 10) is None
    assert zero_embedding_ids("org/model-on-a-hub", 10) is None
