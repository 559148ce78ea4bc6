"""The run's self-check: what decides that a run stops, and the samples it holds back until then.

Every finished sample's layers are screened for states no model produces
(:mod:`~speculators_v016.checks.degenerate`); the first samples the logit
check judges must reproduce vLLM's own prompt logprobs
(:mod:`~speculators_v016.checks.logit_check`). A failure is a
:class:`SelfCheckError` (exit 7). Until the logit check has judged all of its
samples, :class:`HoldBack` keeps every finished sample from the writer, so a
failure stops the run before anything it judged is written (a resume redoes
them). :class:`NonFiniteError`: more samples with NaN/Inf states than the run
allows (the writer rejects each, :mod:`~speculators_v016.checks.finite`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from speculators_v016.checks.degenerate import (
    degenerate_layers,
    may_be_degenerate,
)


class NonFiniteError(RuntimeError):
    """Too many samples had NaN or Inf hidden states."""


class SelfCheckError(RuntimeError):
    """The captured states failed the run's own check (logit check, or states no model produces);
    ``finding``: for the latter, the sample, layer and rows alone (without what the run does about it)."""

    def __init__(self, message: str, finding: str | None = None):
        super().__init__(message)
        self.finding = finding


def check_plausible(
    name: int,
    input_ids: torch.Tensor,
    states: list,
    layer_ids: list[int],
    holding: bool,
    zero_ids: frozenset[int] = frozenset(),
) -> None:
    """Raise SelfCheckError if a layer of sample ``name`` holds states no model produces (``zero_ids``: tokens
    whose input embedding row is zero, :mod:`~speculators_v016.checks.zero_embeddings`)."""
    if not may_be_degenerate(input_ids, states, zero_ids):
        return
    found = degenerate_layers(input_ids, states, zero_ids)
    if found:
        j, what = found[0]
        kept = "nothing of this run was written" if holding else "every sample written passed this check and is kept"
        finding = f"sample {name}, layer {layer_ids[j]}: {what}"
        raise SelfCheckError(
            f"self-check failed: {finding}. No model produces this: the capture is broken, and the run stops "
            f"({kept}; this sample is not written). Please report it with the log",
            finding,
        )


def check_logits(checker, name: int, input_ids: torch.Tensor, states: list, theirs, held: int) -> None:
    """Raise SelfCheckError if sample ``name``'s last layer does not reproduce vLLM's own logits."""
    delta = checker.add(name, input_ids, states, theirs)
    if not checker.last_passed:  # NaN fails too
        raise SelfCheckError(
            f"self-check failed: sample {name}: the captured last layer, normed and projected, does not reproduce "
            f"vLLM's own prompt logprobs (logit check: max |delta| {delta:.3g}, tolerance "
            f"{checker.describe_tolerance()}). The captured states are wrong for this model or setup; the run "
            f"stops before writing any sample ({held + 1} finished samples held back; a resume redoes them). "
            "Please report it with the log"
        )


class WriterScreen:
    """The degenerate-row screen run on the sample writer's threads, off the engine's: each sample is screened on
    its memory just before its writer writes it. A finding raises :class:`SelfCheckError` there: no file of it is
    made, the writer stops and the run with it (exit 7). On the engine's thread the screen took a third of that
    thread at hidden 7168 on the H200 host; gathering its columns from each 512 KiB chunk as the writers wrote it
    (the previous design) cost 0.12 CPU-s per GiB under the GIL, 0.0027 for the whole layer at once, and put the
    CLI at 0.33x of the generator there (docs/benchmarks/gpu_generator.md)."""

    errors = (SelfCheckError,)  #: what the screen raises: a finding, passed on by the writer as it is

    def __init__(self, layer_ids: list[int], zero_ids: frozenset[int] = frozenset()):
        self.layer_ids, self.zero_ids = layer_ids, zero_ids

    def check(self, name: int, sample: dict) -> None:
        """Raise :class:`SelfCheckError` if sample ``name``'s states hold a degenerate row."""
        check_plausible(name, sample["input_ids"], sample["hidden_states"], self.layer_ids, False, self.zero_ids)


class HoldBack:
    """Finished samples, held back from the writer until the logit check has judged every sample it checks.

    ``checked``: the indexes the logit check judges (empty: nothing is held);
    ``checker``: the run's :class:`~speculators_v016.checks.logit_check.LogitChecker`
    (released once all of them passed); ``put(name, sample)``: hand a sample to
    the writer; ``zero_ids``: tokens whose input embedding row is zero;
    ``writer_screens``: the writer runs the degenerate-row screen (:class:`WriterScreen`), so a sample is screened
    here only while samples are held (a finding then stops the run with nothing written).
    """

    def __init__(
        self,
        checked: set,
        checker,
        layer_ids: list[int],
        put: Callable[[int, dict], None],
        zero_ids: frozenset[int] = frozenset(),
        writer_screens: bool = False,
    ):
        self.checker, self.layer_ids, self.put, self.zero_ids = checker, layer_ids, put, zero_ids
        self.writer_screens = writer_screens
        self.awaiting = set(checked)  # checked samples not judged yet
        self.held: list[tuple] = []  # (name, sample, what else put takes)

    def judge(self, index, name: int, input_ids: torch.Tensor, states: list, theirs) -> None:
        """Raise SelfCheckError if sample ``index`` (file name ``name``) fails the self-check; ``theirs``:
        vLLM's prompt logprobs of a checked sample."""
        if self.awaiting or not self.writer_screens:
            check_plausible(name, input_ids, states, self.layer_ids, bool(self.awaiting), self.zero_ids)
        if index in self.awaiting and theirs is not None:
            check_logits(self.checker, name, input_ids, states, theirs, len(self.held))

    def admit(self, index, name: int, sample: dict, *extra) -> None:
        """Write judged sample ``index`` now, or hold it back while checked samples are not judged yet;
        ``extra`` goes to ``put`` with it (a --regenerate sample's record)."""
        if self.awaiting:
            self.held.append((name, sample, *extra))
        else:
            self.put(name, sample, *extra)
        self.forget([index])

    def forget(self, indexes) -> None:
        """``indexes`` are judged (or will never come: a turn --regenerate had no room for); once no checked
        sample is left, what waited is written."""
        before = bool(self.awaiting)
        self.awaiting.difference_update(indexes)
        if before and not self.awaiting:  # every checked sample judged and passed: write what waited, drop the head
            self.checker.release()
            self.finish()

    def hand_over(self, index, to) -> None:
        """Checked sample ``index`` will not be written (a --regenerate turn folded into the sample of turn ``to``):
        sample ``to`` is checked in its place."""
        if index in self.awaiting:
            self.awaiting.discard(index)
            self.awaiting.add(to)

    def finish(self) -> None:
        """Write what is still held: judged and passed (a checked sample vLLM gave no logprobs for)."""
        for held in self.held:
            self.put(*held)
        self.held.clear()
