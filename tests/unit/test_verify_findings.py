"""verify on crafted folders: every defect is a finding naming the file (never a traceback), degenerate states
named by sample and layer, and a folder mixing layouts refused."""

import json
import shutil

import pytest
import torch

from helpers.folders import HIDDEN, LAYERS, make_folder, states
from speculators_v016 import fp8
from speculators_v016.checks.degenerate import degenerate_layers, may_be_degenerate
from speculators_v016.store.atomic_files import write_atomic
from speculators_v016.store.manifest import NAME, Entry, Manifest
from speculators_v016.store.sample_format import encode_parts
from speculators_v016.store.verify import verify


def test_a_crafted_good_folder_verifies(tmp_path):
    """The crafted folder is valid: the findings below come from the defect alone."""
    report = verify(make_folder(tmp_path / "out"))
    assert report.ok and report.samples == 3, report.problems


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_a_flipped_byte_anywhere_in_any_file_fails_verify(tmp_path, algorithm):
    """One byte changed (header, states, last byte) in any one file: verify names that file's digest, only it."""
    good = make_folder(tmp_path / "good", algorithm=algorithm)
    assert verify(good).ok, verify(good).problems
    for i in range(3):
        size = (good / f"data_{i}.safetensors").stat().st_size
        for where in (3, size // 2, size - 1):
            out = tmp_path / f"bad-{i}-{where}"
            shutil.copytree(good, out)
            target = out / f"data_{i}.safetensors"
            data = bytearray(target.read_bytes())
            data[where] ^= 0x01
            target.write_bytes(bytes(data))
            assert verify(out).problems == [f"{target}: size or {algorithm} differs from the manifest"]


def test_all_zero_states_are_named_by_sample_and_layer(tmp_path):
    """A run whose states are all 0 (its ring replaced by an empty file) fails verify, every sample named."""
    out = make_folder(tmp_path / "out", make_states=lambda length, i: [torch.zeros(length, HIDDEN) for _ in LAYERS])
    report = verify(out)
    assert not report.ok
    for i in range(3):
        for j, layer in enumerate(LAYERS):
            assert f"data_{i}.safetensors: hidden_states[{j}] (layer {layer}): every value is 0" in "\n".join(
                report.problems
            )


def test_one_zero_layer_and_one_repeated_row_are_named(tmp_path):
    """A single all-zero layer, or one row repeated at every position, is named with its sample and layer."""

    def broken(length, i):
        out = states(length, i)
        if i == 1:
            out[2] = torch.zeros(length, HIDDEN)
        if i == 2:
            out[0] = out[0][:1].expand(length, HIDDEN).clone()
        return out

    report = verify(make_folder(tmp_path / "out", make_states=broken))
    assert len(report.problems) == 2, report.problems
    assert "data_1.safetensors: hidden_states[2] (layer 7): every value is 0" in report.problems[0]
    assert (
        "data_2.safetensors: hidden_states[0] (layer 2): all 7 positions hold the same row, though the tokens differ"
    ) in report.problems[1]


def test_identical_rows_for_identical_tokens_are_not_flagged(tmp_path):
    """One token repeated may give one row repeated (no positional encoding): not a finding."""
    out = tmp_path / "out"
    make_folder(out, count=1, make_states=lambda length, i: [torch.ones(length, HIDDEN) for _ in LAYERS])
    sample = {
        "input_ids": torch.full((5,), 3),
        "loss_mask": torch.ones(5, dtype=torch.long),
        "hidden_states": [torch.ones(5, HIDDEN) for _ in LAYERS],
    }
    size, sha = write_atomic(out, "data_0.safetensors", encode_parts(sample, "safetensors", LAYERS))
    Manifest(out).compact({0: Entry(0, "data_0.safetensors", size, sha, 5, "blake3")})
    assert verify(out).ok, verify(out).problems


def _garbage_line(out):
    lines = (out / NAME).read_bytes().split(b"\n")
    (out / NAME).write_bytes(b"\n".join([lines[0], b"{garbage", *lines[1:]]))


def _non_utf8(out):
    (out / NAME).write_bytes(b"\xff\xfe\xfa\n" + (out / NAME).read_bytes())


def _manifest_folder(out):
    (out / NAME).unlink()
    (out / NAME).mkdir()


def _config(text):
    return lambda out: (out / "data_config.json").write_bytes(text)


def _config_without(field):
    def edit(out):
        data = json.loads((out / "data_config.json").read_text())
        *parents, last = field.split(".")
        node = data
        for key in parents:
            node = node[key]
        del node[last]
        (out / "data_config.json").write_text(json.dumps(data))

    return edit


def _format(out):
    data = json.loads((out / "data_config.json").read_text())
    data["speculators_v016"]["format"] = "npz"
    (out / "data_config.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    "break_it, finding",
    [
        (_garbage_line, "manifest.jsonl:2: not a manifest entry of this tool"),
        (_non_utf8, "manifest.jsonl:1: not a manifest entry of this tool (UnicodeDecodeError"),
        (_manifest_folder, "manifest.jsonl: cannot be read"),
        (_config(b"{not json"), "data_config.json: not valid JSON"),
        (_config(b"\xff\xfe"), "data_config.json: not valid JSON"),
        (_config(b"[1, 2]"), "data_config.json: no speculators_v016 section"),
        (_config_without("model.hidden_size"), "data_config.json: no field model.hidden_size"),
        (_config_without("speculators_v016.layers"), "data_config.json: no field speculators_v016.layers.layer_ids"),
        (_config_without("speculators_v016.shard"), "data_config.json: no field speculators_v016.shard.index"),
        (_format, "data_config.json: unknown sample format 'npz'"),
    ],
)
def test_a_broken_folder_is_a_finding_naming_the_file(tmp_path, break_it, finding):
    """Garbage or non-UTF-8 manifest lines, a manifest folder, a bad or incomplete config, an unknown format."""
    out = make_folder(tmp_path / "out")
    break_it(out)
    report = verify(out)
    assert not report.ok
    assert any(f"{out}/{finding}" in p for p in report.problems), report.problems


def test_shard_folders_beside_an_unsharded_run_are_a_finding(tmp_path):
    """A folder holding an unsharded run and shard folders (which a trainer would mix) fails verify."""
    out = tmp_path / "out"
    make_folder(out / "shard-00000-of-00002", count=4, shard=(0, 2), indices=[0, 2])
    make_folder(out / "shard-00001-of-00002", count=4, shard=(1, 2), indices=[1, 3])
    assert verify(out).ok
    make_folder(out)  # an unsharded run beside them
    report = verify(out)
    assert any(
        "holds shard folders and an unsharded run's files (data_0.safetensors, data_1.safetensors, "
        "data_2.safetensors" in p
        for p in report.problems
    ), report.problems
    for name in ("data_config.json", NAME, *(f"data_{i}.safetensors" for i in range(3))):
        (out / name).unlink()
    shutil.rmtree(out / "shard-00001-of-00002")
    make_folder(out / "shard-00001-of-00003", count=4, shard=(1, 3), indices=[1, 3])
    report = verify(out, partial=True)
    assert any("shard folders of runs split 2 and 3 ways" in p for p in report.problems), report.problems


def test_half_the_rows_zeroed_are_named_by_sample_layer_and_rows(tmp_path):
    """A layer with its second half of rows zeroed in every sample fails verify, naming sample, layer and rows."""

    def half_zero(length, i):
        out = states(length, i)
        out[1][length // 2 :] = 0
        return out

    report = verify(make_folder(tmp_path / "out", make_states=half_zero))
    assert not report.ok and len(report.problems) == 3, report.problems
    for i, problem in enumerate(report.problems):
        length = 5 + i
        rows = ", ".join(map(str, range(length // 2, length)))
        expected = (
            f"data_{i}.safetensors: hidden_states[1] (layer 4): rows [{rows}] ({length - length // 2} of {length})"
        )
        assert f"{expected} are all 0; no model produces this" in problem, problem


def test_a_row_repeated_for_another_token_is_named(tmp_path):
    """Row 4 holding row 1's values (their tokens differ) fails verify, naming both rows."""

    def copied(length, i):
        out = states(length, i)
        if i == 2:
            out[2][4] = out[2][1]
        return out

    report = verify(make_folder(tmp_path / "out", make_states=copied))
    assert report.problems == [
        f"{tmp_path}/out/data_2.safetensors: hidden_states[2] (layer 7): rows [1, 4] (2 of 7) hold the same row, "
        "though their tokens differ; no model produces this: the capture was broken"
    ]


def test_the_run_screen_sees_single_rows_and_agrees_with_verify():
    """The run's cheap screen flags one zero row or one copied row, passes real-looking and same-token rows."""
    ids = torch.arange(10, 19)
    good = states(9, 0)
    assert not may_be_degenerate(ids, good) and degenerate_layers(ids, good) == []
    zero_row = [h.clone() for h in good]
    zero_row[0][3] = 0
    assert may_be_degenerate(ids, zero_row)
    assert degenerate_layers(ids, zero_row) == [(0, "rows [3] (1 of 9) are all 0")]
    copied = [h.clone() for h in good]
    copied[1][8] = copied[1][0]
    assert may_be_degenerate(ids, copied)
    assert degenerate_layers(ids, copied) == [(1, "rows [0, 8] (2 of 9) hold the same row, though their tokens differ")]
    same_token = ids.clone()
    same_token[8] = same_token[0]  # the same token twice may give the same row
    assert not may_be_degenerate(same_token, copied) and degenerate_layers(same_token, copied) == []
    wide = torch.randn(40, 4096)  # more columns than the screen reads: the copy is still found
    wide[30] = wide[7]
    assert may_be_degenerate(torch.arange(40), [wide])
    assert degenerate_layers(torch.arange(40), [wide]) == [
        (0, "rows [7, 30] (2 of 40) hold the same row, though their tokens differ")
    ]


@pytest.mark.parametrize("kind", ["bf16", "fp8", "mixed dtypes"])
@pytest.mark.parametrize("layer", [0, 3])
def test_the_screen_of_all_layers_at_once_misses_no_layer(kind, layer):
    """The screen's pass over all layers together: a zero or copied row in any one layer is flagged, as alone."""
    ids, gen = torch.arange(300), torch.Generator().manual_seed(layer)
    rows = [torch.randn(300, w, generator=gen) for w in (256, 96, 256, 256)]
    good = [fp8.Fp8States(*fp8.quantize(r)) for r in rows] if kind == "fp8" else [r.bfloat16() for r in rows]
    if kind == "mixed dtypes":  # layers the pass cannot stack: screened one by one
        good[1] = rows[1]
    assert not may_be_degenerate(ids, good)
    for defect in ("zero", "copy"):
        bad = [fp8.Fp8States(h.codes.clone(), h.scales.clone()) if kind == "fp8" else h.clone() for h in good]
        target = bad[layer].codes if kind == "fp8" else bad[layer]
        if defect == "zero":
            target[123] = 0
        else:
            target[299] = target[5]
            if kind == "fp8":
                bad[layer].scales[299] = bad[layer].scales[5]
        assert may_be_degenerate(ids, bad), defect
        assert [j for j, _ in degenerate_layers(ids, bad)] == [layer], defect


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_run_screen_reads_each_dtype_by_its_bits(dtype):
    """Every float dtype: a row of -0.0 is a zero row (as ``== 0`` says), a copied row is found among 2560."""
    ids = torch.arange(2560)
    h = torch.randn(2560, 4096, generator=torch.Generator().manual_seed(5)).to(dtype)
    assert not may_be_degenerate(ids, [h]) and degenerate_layers(ids, [h]) == []
    h[1000] = -0.0
    h[2559] = h[17]
    assert may_be_degenerate(ids, [h])
    assert degenerate_layers(ids, [h]) == [
        (
            0,
            "rows [1000] (1 of 2560) are all 0; rows [17, 2559] (2 of 2560) hold the same row, though their tokens differ",
        )
    ]
    ids[2559] = ids[17]  # the same token: the copy is the model's own; the zero row is not
    assert degenerate_layers(ids, [h]) == [(0, "rows [1000] (1 of 2560) are all 0")]


def test_the_run_screen_sees_fp8_rows():
    """FP8 layers: a zero-code row or a copied row (codes and scale) is flagged and named."""
    ids = torch.arange(8)
    good = fp8.Fp8States(*fp8.quantize(torch.randn(8, 64)))
    assert not may_be_degenerate(ids, [good])
    broken = fp8.Fp8States(good.codes.clone(), good.scales.clone())
    broken.codes[4:] = 0
    broken.scales[4:] = 1.0
    broken.codes[1], broken.scales[1] = broken.codes[0], broken.scales[0]
    assert may_be_degenerate(ids, [broken])
    assert degenerate_layers(ids, [broken]) == [
        (
            0,
            "rows [4, 5, 6, 7] (4 of 8) are all 0; rows [0, 1] (2 of 8) hold the same row, though their tokens differ",
        )
    ]


def test_a_sample_replaced_by_a_symlink_is_a_finding(tmp_path):
    """A sample file replaced by a link to an identical copy fails verify (deep and quick), never followed."""
    out = make_folder(tmp_path / "out")
    copy = tmp_path / "elsewhere.safetensors"
    copy.write_bytes((out / "data_1.safetensors").read_bytes())
    (out / "data_1.safetensors").unlink()
    (out / "data_1.safetensors").symlink_to(copy)
    for deep in (True, False):
        report = verify(out, deep=deep)
        assert report.problems == [
            f"{out}/data_1.safetensors: a symbolic link, not the file this tool wrote (not followed)"
        ], report.problems


def test_a_duplicated_manifest_line_is_a_finding(tmp_path):
    """A manifest line appearing twice fails verify, naming the line and the one that listed the sample first."""
    out = make_folder(tmp_path / "out")
    lines = (out / NAME).read_text().splitlines(keepends=True)
    (out / NAME).write_text("".join(lines + [lines[1]]))
    report = verify(out)
    assert report.problems == [f"{out}/{NAME}:4: sample 1 listed again (first on line 2)"], report.problems


def zero_first_rows(length: int, seed: int) -> list[torch.Tensor]:
    """What a model without biases computes for a token whose embedding row is zero, at position 0."""
    out = states(length, seed)
    for h in out:
        h[0] = 0
    return out


def test_a_zero_row_of_a_token_whose_embedding_row_is_zero_is_the_models_own():
    """Position 0 all zero in every layer for a zero-embedding token: no finding; the same zero row for another
    token, a zero row further on, or every row zero are still findings."""
    ids = torch.arange(10, 19)
    real = zero_first_rows(9, 0)
    assert not may_be_degenerate(ids, real, frozenset({10})) and degenerate_layers(ids, real, frozenset({10})) == []
    assert degenerate_layers(ids, real) == [(j, "rows [0] (1 of 9) are all 0") for j in range(3)]
    assert degenerate_layers(ids, real, frozenset({11})) == [(j, "rows [0] (1 of 9) are all 0") for j in range(3)]
    later = [h.clone() for h in real]
    later[1][4] = 0
    assert may_be_degenerate(ids, later, frozenset({10}))
    assert degenerate_layers(ids, later, frozenset({10})) == [(1, "rows [4] (1 of 9) are all 0")]
    zeros = [torch.zeros(9, HIDDEN) for _ in LAYERS]
    assert degenerate_layers(ids, zeros, frozenset({10})) == [
        (j, "rows [1, 2, 3, 4, 5, 6, 7, 8] (8 of 9) are all 0") for j in range(3)
    ]


def test_verify_reads_the_zero_embedding_tokens_the_run_recorded(tmp_path):
    """A folder whose samples start with a zero-embedding token verifies when data_config.json records the token;
    without the record (an earlier release's folder) the zero rows are findings, as before."""
    out = make_folder(tmp_path / "out", make_states=zero_first_rows)
    assert len(verify(out).problems) == 9
    settings = json.loads((out / "data_config.json").read_text())
    settings["speculators_v016"]["zero_embedding_token_ids"] = [10]
    (out / "data_config.json").write_text(json.dumps(settings))
    report = verify(out)
    assert report.ok, report.problems
