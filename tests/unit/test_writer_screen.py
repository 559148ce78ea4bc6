"""The degenerate-row screen on the sample writer's threads: it judges a sample as the screen on its memory does,
and a finding keeps any file of it from being made."""

import pytest
import torch

from speculators_v016.checks import degenerate
from speculators_v016.checks.degenerate import may_be_degenerate
from speculators_v016.checks.self_check import HoldBack, SelfCheckError, WriterScreen
from speculators_v016.fp8 import Fp8States, quantize
from speculators_v016.run.run_report import exit_code
from speculators_v016.store import atomic_files
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import load_sample
from speculators_v016.store.writer import SampleWriter

LAYERS = [2, 5, 7]


def sample(index, tokens=12, hidden=40, dtype=torch.bfloat16, fp8=False):
    """Rows no two alike (random), every row non-zero."""
    g = torch.Generator().manual_seed(index)
    rows = [torch.randn(tokens, hidden, generator=g) + 3 for _ in LAYERS]
    states = [Fp8States(*quantize(r)) for r in rows] if fp8 else [r.to(dtype) for r in rows]
    return {
        "input_ids": torch.arange(tokens) + 10 * index,
        "loss_mask": torch.ones(tokens, dtype=torch.long),
        "hidden_states": states,
    }


def faults():
    """(what, sample) for each fault the screen must flag, and a clean sample."""
    zero_row, copied, fp8_copy, same_token = sample(2), sample(3), sample(4, fp8=True), sample(5)
    zero_row["hidden_states"][1][4] = 0
    copied["hidden_states"][2][9] = copied["hidden_states"][2][1]
    fp8_copy["hidden_states"][0].codes[6] = fp8_copy["hidden_states"][0].codes[2]
    fp8_copy["hidden_states"][0].scales[6] = fp8_copy["hidden_states"][0].scales[2]
    same_token["hidden_states"][0][3] = same_token["hidden_states"][0][2]
    same_token["input_ids"][3] = same_token["input_ids"][2]  # same token, same row: legitimate
    return [("zero row", zero_row, True), ("copied row", copied, True), ("fp8 copy", fp8_copy, True),
            ("same token", same_token, False), ("clean", sample(6), False)]  # fmt: skip


@pytest.mark.parametrize("what,s,flagged", faults())
def test_the_writer_screen_judges_as_the_screen_on_memory(what, s, flagged):
    """Each injected fault is flagged by the screen and refused by the writer's screen; a clean sample and a repeat
    of the same token by neither."""
    assert may_be_degenerate(s["input_ids"], s["hidden_states"]) is flagged, what
    if flagged:
        with pytest.raises(SelfCheckError, match="self-check failed: sample 0, layer"):
            WriterScreen(LAYERS).check(0, s)
    else:
        WriterScreen(LAYERS).check(0, s)


def test_a_zero_row_of_a_zero_embedding_token_is_not_flagged():
    """A zero row whose token's embedding row is zero is what the model computes: not flagged, any other is."""
    s = sample(7)
    s["hidden_states"][0][0] = 0
    zero_token = int(s["input_ids"][0])
    WriterScreen(LAYERS, frozenset({zero_token})).check(0, s)
    with pytest.raises(SelfCheckError, match=r"rows \[0\]"):
        WriterScreen(LAYERS, frozenset({zero_token + 1})).check(0, s)


@pytest.mark.parametrize("fmt,fp8", [("safetensors", False), ("safetensors", True), ("pt", False)])
def test_a_degenerate_sample_stops_the_writer_and_its_file_is_never_named(tmp_path, monkeypatch, fmt, fp8):
    """A copied row in sample 3: SelfCheckError naming sample, layer and rows (exit 7); no file or temporary file
    of it; the samples before it are written and listed, and read back equal."""
    monkeypatch.setattr(atomic_files, "WRITE_CHUNK", 256)
    writer = SampleWriter(tmp_path, fmt, LAYERS, workers=1, screen=WriterScreen(LAYERS))
    good = {i: sample(i, fp8=fp8) for i in range(3)}
    bad = sample(3, fp8=fp8)
    h = bad["hidden_states"][2]
    if fp8:
        h.codes[9], h.scales[9] = h.codes[1], h.scales[1]
    else:
        h[9] = h[1]
    for index, s in [*good.items(), (3, bad)]:
        writer.put(index, s)
    with pytest.raises(SelfCheckError) as raised:
        writer.close()
    assert (
        "self-check failed: sample 3, layer 7: rows [1, 9] (2 of 12) hold the same row, though their tokens differ"
        in str(raised.value)
    )
    assert "every sample written passed this check and is kept" in str(raised.value)
    assert exit_code(raised.value) == 7
    assert sorted(Manifest(tmp_path).entries()) == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir() if "data_" in p.name) == [f"data_{i}.{fmt}" for i in range(3)]
    for index, s in good.items():
        got = load_sample(tmp_path / f"data_{index}.{fmt}", dequantize_to=None)["hidden_states"]
        if fp8:
            assert all(
                torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))
                for a, b in zip(got, s["hidden_states"])
            )
        else:
            assert all(torch.equal(a, b) for a, b in zip(got, s["hidden_states"]))


def test_without_the_screen_the_same_sample_is_written(tmp_path):
    """The fault above goes through a writer given no screen: the screen is what refuses it."""
    bad = sample(3)
    bad["hidden_states"][2][9] = bad["hidden_states"][2][1]
    writer = SampleWriter(tmp_path, "safetensors", LAYERS, workers=1)
    writer.put(3, bad)
    writer.close()
    assert sorted(Manifest(tmp_path).entries()) == [3]


def test_a_flag_the_full_check_clears_is_written(tmp_path):
    """Two rows equal in the screen's 16 columns only (a candidate the full check clears): the sample is written."""
    s = sample(4, hidden=400)
    h = s["hidden_states"][0]
    near = h[1].clone()
    near[3] += 1  # column 3 is not one of the screen's columns at hidden 400
    assert 3 not in degenerate._columns(400).tolist()
    h[8] = near
    assert may_be_degenerate(s["input_ids"], s["hidden_states"])
    writer = SampleWriter(tmp_path, "safetensors", LAYERS, workers=1, screen=WriterScreen(LAYERS))
    writer.put(4, s)
    writer.close()
    assert sorted(Manifest(tmp_path).entries()) == [4]


def test_the_engine_thread_screens_only_while_samples_are_held():
    """With the writer screening, HoldBack screens a sample itself only while the logit check holds samples."""

    class Passing:
        last_passed = True

        def add(self, *args):
            return 0.0

        def release(self):
            pass

    written = []
    bad = sample(5)
    bad["hidden_states"][0][2] = 0
    hold = HoldBack({0}, Passing(), LAYERS, lambda name, s: written.append(name), writer_screens=True)
    with pytest.raises(SelfCheckError, match="nothing of this run was written"):
        hold.judge(1, 101, bad["input_ids"], bad["hidden_states"], None)  # sample 0 not judged yet: held
    hold.judge(0, 100, bad["input_ids"], sample(0)["hidden_states"], object())
    hold.admit(0, 100, sample(0))
    hold.judge(2, 102, bad["input_ids"], bad["hidden_states"], None)  # nothing held: the writer's screen judges it
    alone = HoldBack(set(), None, LAYERS, written.append)  # no writer screen: screened here
    with pytest.raises(SelfCheckError, match="sample 103, layer 2: rows \\[2\\]"):
        alone.judge(3, 103, bad["input_ids"], bad["hidden_states"], None)
