"""Prompts' tensors made and touched ahead on threads of their own (pure logic, no engine)."""

import sys
import threading
from pathlib import Path

import pytest
import torch

from speculators_v016.engine.assembly import Assembler, fresh_tensors
from speculators_v016.engine.prefault import Prefaulter, advise_huge_pages, prefaulter, spec_bytes, touch
from speculators_v016.fp8 import CODE_DTYPE, SCALE_DTYPE
from speculators_v016.protocol import StepCapture

SPECS = [((64, 32), torch.bfloat16)] * 2  # 8 KiB
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def steps(fp8=False, seed=0):
    """Three steps of four prompts (chunked), each row's values distinct; FP8: codes and one scale per row."""
    gen = torch.Generator().manual_seed(seed)
    plan = [(1, [("a", 0, 40), ("b", 0, 24)]), (2, [("a", 40, 24), ("c", 0, 40)]), (3, [("d", 0, 64)])]
    out = []
    for step, parts in plan:
        n = sum(p[2] for p in parts)
        states = torch.randn(3, n, 32, generator=gen)
        scales = None
        if fp8:
            states, scales = states.to(CODE_DTYPE), torch.rand(3, n, generator=gen).to(SCALE_DTYPE)
        else:
            states = states.to(torch.bfloat16)
        out.append((step, parts, StepCapture(step, *map(list, zip(*parts)), states=states, scales=scales)))
    return out


def assemble(prefault, fp8=False, settle=False):
    """Four prompts through three steps; ``settle``: each step's offers made before the next step comes
    (as when the GPU's step takes longer than the touching), else whatever the threads managed."""
    asm = Assembler((2, 0), fp8=fp8, prefault=prefault)
    for rid, length in [("a", 64), ("b", 24), ("c", 40), ("d", 64)]:
        asm.add_request(rid, rid.upper(), length)
    got = {}
    for step, parts, cap in steps(fp8):
        asm.expect(step, {r: (s, n) for r, s, n in parts})
        asm.add(cap)
        got.update(dict(asm.pop_complete()))
        if settle:
            for _, _, made in list(prefault._ahead.values()):
                made.result(10)
    return got


def test_tensors_made_ahead_are_the_ones_taken():
    """An offered request's tensors come from the threads, with the shapes and dtypes asked for."""
    pf = Prefaulter(fresh_tensors, 1 << 20, 2)
    try:
        assert pf.offer("r", SPECS)
        pf._ahead["r"][2].result(10)  # made by now (else take() would make them itself: see below)
        tensors = pf.take("r", SPECS)
        assert [(tuple(t.shape), t.dtype) for t in tensors] == SPECS and (pf.hits, pf.misses, pf.held) == (1, 0, 0)
        assert pf.take("never offered", SPECS)[0].shape == (64, 32) and pf.misses == 1
    finally:
        pf.close()


def test_held_bytes_stay_within_the_limit():
    """Offers past the limit are declined until taken; the first offer is always accepted, however large."""
    pf = Prefaulter(fresh_tensors, 2 * spec_bytes(SPECS), 1)
    try:
        assert pf.offer("a", SPECS) and pf.offer("b", SPECS) and not pf.offer("c", SPECS)
        assert pf.held == 2 * spec_bytes(SPECS)
        pf.take("a", SPECS)
        assert pf.offer("c", SPECS) and pf.held == 2 * spec_bytes(SPECS)
        pf.take("b", SPECS), pf.take("c", SPECS)
        assert pf.offer("huge", [((4096, 4096), torch.float32)]) and pf.held == 64 << 20
    finally:
        pf.close()


def test_other_specs_are_made_anew():
    """Tensors made for other shapes are never handed out: the request gets new ones of its own shape."""
    pf = Prefaulter(fresh_tensors, 1 << 20, 1)
    try:
        pf.offer("r", SPECS)
        tensors = pf.take("r", [((65, 32), torch.bfloat16)] * 2)
        assert tensors[0].shape == (65, 32) and (pf.hits, pf.misses) == (0, 1)
    finally:
        pf.close()


def test_a_request_not_started_is_made_on_the_callers_thread():
    """While the threads are busy, take() does not wait for a queued offer: it cancels it and makes its own."""
    started, release, calls = threading.Event(), threading.Event(), []

    def slow(specs):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            started.set()
            release.wait(10)
        return fresh_tensors(specs)

    pf = Prefaulter(slow, 1 << 20, 1)
    try:
        pf.offer("first", SPECS), pf.offer("queued", SPECS)
        assert started.wait(10)  # the one thread is busy with "first"
        tensors = pf.take("queued", SPECS)
        assert tensors[0].shape == (64, 32) and pf.misses == 1
        assert calls[-1] == threading.current_thread().name  # made here; the queued offer never ran
        release.set()
        assert pf.take("first", SPECS)[0].shape == (64, 32) and pf.hits == 1
        assert sum(name.startswith("speculators-prefault") for name in calls) == 1
    finally:
        release.set()
        pf.close()


def test_an_allocation_error_reaches_the_caller():
    """A failure on a prefault thread is raised where the tensors are taken, not swallowed."""

    def fails(specs):
        raise MemoryError("no room")

    pf = Prefaulter(fails, 1 << 20, 1)
    try:
        pf.offer("r", SPECS)
        pf._ahead["r"][2].exception(10)  # ran (and failed) on the thread
        with pytest.raises(MemoryError, match="no room"):
            pf.take("r", SPECS)
    finally:
        pf.close()


@pytest.mark.parametrize("settle", [True, False], ids=["made-in-time", "as-the-threads-go"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_assembly_with_prefault_equals_without(fp8, settle):
    """Prompts assembled into prefaulted tensors equal those assembled into fresh ones, bit for bit."""
    plain = assemble(None, fp8)
    pf = Prefaulter(fresh_tensors, 1 << 20, 2)
    try:
        ahead = assemble(pf, fp8, settle)
    finally:
        pf.close()
    assert sorted(plain) == sorted(ahead) == ["A", "B", "C", "D"]
    for key in plain:
        for x, y in zip(plain[key], ahead[key]):
            if fp8:
                assert torch.equal(x.codes.view(torch.uint8), y.codes.view(torch.uint8))
                assert torch.equal(x.scales, y.scales)
            else:
                assert torch.equal(x, y)
    assert pf.hits + pf.misses == 2  # c and d were offered after step 1 (a and b had begun then)
    if settle:
        assert pf.hits == 2


def test_a_touch_after_the_copy_would_be_caught():
    """The comparison above sees a late touch: zeros planted in a prefaulted prompt's pages make it differ."""
    pf = Prefaulter(fresh_tensors, 1 << 20, 2)
    ahead = assemble(pf)
    pf.close()
    plain = assemble(None)
    assert torch.equal(ahead["C"][0], plain["C"][0])
    touch(ahead["C"][0])  # the planted fault: the thread's zeros landing after the engine's copy
    assert not torch.equal(ahead["C"][0], plain["C"][0])


def test_touch_writes_every_page_and_only_zeros():
    """touch() faults every page of a tensor in; its data is zeros only at each page's first byte."""
    t = torch.full((3 << 20,), 7, dtype=torch.uint8)
    touch(t)
    assert int((t == 0).sum()) == -(-t.numel() // 4096) and t[1] == 7


@pytest.mark.skipif(not (sys.platform.startswith("linux") and THP.exists()), reason="Linux with THP only")
def test_huge_pages_are_asked_for_large_tensors_only():
    """madvise(MADV_HUGEPAGE) is accepted for a 4 MiB tensor and not tried for a small one."""
    assert advise_huge_pages(torch.empty(4 << 20, dtype=torch.uint8))
    assert not advise_huge_pages(torch.empty(4096, dtype=torch.uint8))


def test_cpu_engines_have_no_prefaulter():
    """CPU engines (no bounded copy threads) make their tensors as before; GPU engines get one."""
    assert prefaulter(fresh_tensors, None) is None
    pf = prefaulter(fresh_tensors, 4)
    assert isinstance(pf, Prefaulter)
    pf.close()
