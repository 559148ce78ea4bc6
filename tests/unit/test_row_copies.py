"""Row copies on a thread of their own: the same tensors as inline, handed out and slots back only once landed."""

import threading

import pytest
import torch

from speculators_v016.engine.assembly import Assembler, AttributionError
from speculators_v016.engine.core import copies_apart, ring_slots
from speculators_v016.engine.row_copies import RowCopies, RowCopyError
from speculators_v016.fp8 import CODE_DTYPE, SCALE_DTYPE
from speculators_v016.protocol import StepCapture


class GatedCopies(RowCopies):
    """Copies that wait for ``gate`` (a test's hold on the copy thread)."""

    def __init__(self):
        super().__init__(threads=None)
        self.gate = threading.Event()

    def _copy(self, pairs):
        assert self.gate.wait(10)
        super()._copy(pairs)


class FailingCopies(RowCopies):
    """Copies that fail for the steps in ``failing``."""

    def __init__(self, failing):
        super().__init__(threads=None)
        self.failing = set(failing)

    def submit(self, step, pairs, release, completes):
        super().submit(step, [] if step not in self.failing else [(torch.empty(2), torch.empty(3))], release,
                       completes)  # fmt: skip


def schedule(seed):
    """Steps of a random chunked schedule: [(request, start, rows)] per step, and each request's length."""
    gen = torch.Generator().manual_seed(seed)
    lengths = {f"r{i}": int(torch.randint(1, 40, (1,), generator=gen)) for i in range(7)}
    done, steps, budget = dict.fromkeys(lengths, 0), [], 16
    while any(done[r] < n for r, n in lengths.items()):
        left, step = budget, []
        for r, n in lengths.items():
            take = min(n - done[r], left)
            if take > 0:
                step.append((r, done[r], take))
                done[r] += take
                left -= take
        steps.append(step)
    return steps, lengths


def capture(number, parts, layers, hidden, dtype, fp8, gen):
    rows = sum(n for _, _, n in parts)
    if fp8:
        states = torch.randint(0, 255, (layers, rows, hidden), dtype=torch.uint8, generator=gen).view(CODE_DTYPE)
        scales = torch.rand((layers, rows), generator=gen, dtype=SCALE_DTYPE)
    else:
        states, scales = torch.randn((layers, rows, hidden), generator=gen).to(dtype), None
    return StepCapture(number, [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts],
                       states=states, scales=scales)  # fmt: skip


def assemble(copies, seed=0, dtype=torch.bfloat16, fp8=False):
    """Every request's states through one assembler; the release count of each step's slot."""
    steps, lengths = schedule(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    asm = Assembler((2, 0), fp8=fp8, copies=copies)
    for r, n in lengths.items():
        asm.add_request(r, r, n)
    released, out = [], {}
    for number, parts in enumerate(steps, 1):
        asm.expect(number, {r: (s, n) for r, s, n in parts})
        asm.add(capture(number, parts, 3, 8, dtype, fp8, gen), lambda k=number: released.append(k))
        out.update(asm.pop_complete())
    asm.settle()
    out.update(asm.pop_complete())
    assert sorted(released) == list(range(1, len(steps) + 1))
    return out, lengths


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_thread_copies_equal_inline_copies(dtype, fp8):
    """A chunked schedule's states through the copy thread equal the inline ones bit for bit (bf16, fp32, FP8)."""
    copies = RowCopies(threads=2)
    try:
        threaded, lengths = assemble(copies, dtype=dtype, fp8=fp8)
    finally:
        copies.close()
    inline, _ = assemble(None, dtype=dtype, fp8=fp8)
    assert threaded.keys() == inline.keys() == lengths.keys()
    for key, states in inline.items():
        for a, b in zip(states, threaded[key]):
            pairs = [(a.codes, b.codes), (a.scales, b.scales)] if fp8 else [(a, b)]
            for x, y in pairs:
                assert x.shape[0] == lengths[key] and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_a_request_is_handed_out_and_its_slot_back_only_once_copied():
    """While the copy thread holds a step, its request is not handed out and its slot is not given back."""
    copies = GatedCopies()
    asm = Assembler((0,), copies=copies)
    asm.add_request("a", "A", 4)
    asm.expect(1, {"a": (0, 4)})
    released = []
    states = torch.arange(8.0).view(1, 4, 2)
    asm.add(StepCapture(1, ["a"], [0], [4], states=states), lambda: released.append(1))
    assert asm.pop_complete() == [] and released == [] and asm.copying == 1
    assert "a" in asm.unfinished()
    copies.gate.set()
    asm.land(wait=1)
    assert released == [1] and asm.copying == 0
    [(key, [got])] = asm.pop_complete()
    assert key == "A" and torch.equal(got, states[0])
    copies.close()


def test_a_request_over_two_steps_waits_for_the_second_steps_copies():
    """A prompt whose rows span two steps is complete only when the later step's copies have landed."""
    copies = GatedCopies()
    asm = Assembler((0,), copies=copies)
    asm.add_request("a", "A", 6)
    asm.expect(1, {"a": (0, 4)})
    asm.expect(2, {"a": (4, 2)})
    asm.add(StepCapture(1, ["a"], [0], [4], states=torch.ones(1, 4, 2)))
    asm.add(StepCapture(2, ["a"], [4], [2], states=torch.full((1, 2, 2), 2.0)))
    assert asm.pop_complete() == []
    copies.gate.set()
    asm.settle()
    [(_, [got])] = asm.pop_complete()
    assert got[:, 0].tolist() == [1, 1, 1, 1, 2, 2]
    copies.close()


def test_a_generating_request_is_handed_out_at_once_while_its_steps_slots_wait():
    """A generating request (rows copied on the engine's thread) is handed out with the copy thread held, as inline:
    when the scheduler ends it never waits on that thread; the prompt beside it and both slots wait for it."""
    copies = GatedCopies()
    asm = Assembler((0,), copies=copies)
    asm.add_request("g", "G", 2, generating=True)
    asm.add_request("p", "P", 2)
    released = []
    asm.expect(1, {"g": (0, 2)})
    asm.add(StepCapture(1, ["g"], [0], [2], states=torch.ones(1, 2, 2)), lambda: released.append(1))
    asm.grow("g", 3, final=True)  # one token sampled, the last: its row comes with the next step
    asm.expect(2, {"g": (2, 1), "p": (0, 2)})
    asm.add(StepCapture(2, ["g", "p"], [2, 0], [1, 2], states=torch.full((1, 3, 2), 2.0)), lambda: released.append(2))
    [(key, [got])] = asm.pop_complete()
    assert key == "G" and got[:, 0].tolist() == [1, 1, 2]
    assert released == [] and asm.copying == 2 and "p" in asm.unfinished()
    copies.gate.set()
    asm.settle()
    [(key, [got])] = asm.pop_complete()
    assert key == "P" and got[:, 0].tolist() == [2, 2] and released == [1, 2]
    copies.close()


def test_a_failed_copy_is_raised_naming_its_step_with_every_slot_back():
    """A copy that fails raises RowCopyError naming the step on the engine's side; every slot still goes back."""
    copies = FailingCopies(failing={2})
    asm = Assembler((0,), copies=copies)
    released = []
    for step in (1, 2, 3):
        asm.add_request(f"r{step}", step, 1)
        asm.expect(step, {f"r{step}": (0, 1)})
        asm.add(
            StepCapture(step, [f"r{step}"], [0], [1], states=torch.ones(1, 1, 2)), lambda k=step: released.append(k)
        )
    with pytest.raises(RowCopyError, match="copying step 2's rows out of its ring slot failed"):
        asm.settle()
    assert sorted(released) == [1, 2, 3]
    copies.close()


def test_a_refused_capture_gives_its_slot_back_at_once():
    """A capture the scheduler did not schedule is refused, and its slot given back, before any copy is queued."""
    copies = RowCopies(threads=None)
    asm = Assembler((0,), copies=copies)
    asm.add_request("a", "A", 4)
    asm.expect(1, {"a": (0, 3)})
    released = []
    with pytest.raises(AttributionError, match="scheduler scheduled"):
        asm.add(StepCapture(1, ["a"], [0], [4], states=torch.ones(1, 4, 2)), lambda: released.append(1))
    assert released == [1] and asm.copying == 0
    copies.close()


def test_where_the_rows_are_copied_and_the_ring_slot_it_adds():
    """auto copies on a thread on GPU engines and inline on CPU ones; the thread's mode has one more ring slot."""
    assert copies_apart("auto", "cuda") and not copies_apart("auto", "cpu")
    assert copies_apart("thread", "cpu") and not copies_apart("inline", "cuda")
    assert ring_slots(True, 1, copies_apart=True) == ring_slots(True, 1) + 1 == 5
