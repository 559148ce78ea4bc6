"""The bytes a run will write, forecast before the engine starts, against the folder's free space."""

import re
import subprocess

import pytest

from helpers.cli import conversations, generate, write_jsonl
from speculators_v016.store.disk_forecast import GIB


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("forecast-data") / "chats.jsonl", conversations(30, seed=7))


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a filesystem whose free space the run's samples cannot fit."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=True)


def test_a_run_that_cannot_fit_is_refused_before_it_starts(small_disk, model_dir, data_file):
    """Forecast over the free space: exit 4 naming both figures and the ways out; no sample written."""
    out = small_disk / "out"
    result = generate(model_dir, data_file, out)
    assert result.exit_code == 4, result.output[-3000:]
    found = re.search(r"error: .*/out: this run would write at least ([\d.,]+) GiB \(([\d,]+) tokens x 4 layers x "
                      r"hidden 128 x 4 B\), and the folder's disk has ([\d.,]+) GiB free", result.output)  # fmt: skip
    assert found, result.output[-3000:]
    forecast, tokens = float(found[1].replace(",", "")), int(found[2].replace(",", ""))
    assert abs(forecast * GIB - tokens * (4 * 128 * 4 + 16)) <= 0.005 * GIB
    assert "--hidden-states-dtype fp8_e4m3" in result.output and "--ignore-disk-forecast" in result.output
    assert "samples to write" not in result.output  # the engine never started
    assert not list(out.glob("data_*"))


def test_the_forecast_is_said_and_a_run_that_fits_goes_on(tmp_path, model_dir, data_file):
    """A run that fits says its forecast on the terminal and writes every sample."""
    result = generate(model_dir, data_file, tmp_path / "out", "--max-samples", 4)
    assert result.exit_code == 0, result.output[-3000:]
    assert re.search(r"disk:       [\d.]+ GiB to write \([\d,]+ tokens x 4 layers x 128 x 4 B\), [\d.,]+ GiB free",
                     result.output), result.output[-3000:]  # fmt: skip
