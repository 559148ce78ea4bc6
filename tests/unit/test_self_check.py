"""The run's self-check: finished samples wait for the logit check, and what stops a run."""

import pytest
import torch

from speculators_v016.checks.self_check import HoldBack, NonFiniteError, SelfCheckError
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


@pytest.mark.parametrize("holding, kept", [(True, "nothing of this run was written"), (False, "are kept")])
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
