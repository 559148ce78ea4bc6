"""The disk forecast: bytes per token by storage, and the refusal's wording."""

import pytest

from speculators_v016.store.disk_forecast import DiskForecast, DiskForecastError, forecast, refuse_if_short


def test_bytes_per_token_by_storage(tmp_path):
    """bf16: 2 B a value; FP8: 1 B a value and a 4 B scale a row; ids and mask 16 B a token."""
    bf16 = forecast(tmp_path, tokens=1000, layers=4, hidden=7168, value_bytes=2, fp8=False)
    fp8 = forecast(tmp_path, tokens=1000, layers=4, hidden=7168, value_bytes=2, fp8=True)
    assert bf16.bytes == 1000 * (4 * 7168 * 2 + 16)
    assert fp8.bytes == 1000 * (4 * (7168 + 4) + 16)
    assert bf16.free > 0 and bf16.fits


def test_a_forecast_past_the_free_space_is_refused_naming_both_and_the_ways_out(tmp_path):
    """Short by one byte: refused with both figures; FP8 storage is not offered to a run that has it."""
    short = DiskForecast(tokens=100, layers=2, hidden=64, value_bytes=2, row_extra_bytes=0, free=100 * 272 - 1)
    with pytest.raises(
        DiskForecastError, match=r"would write at least 0\.00 GiB \(100 tokens x 2 layers x hidden 64"
    ) as e:
        refuse_if_short(short, tmp_path, fp8=False)
    assert "--hidden-states-dtype fp8_e4m3" in str(e.value) and "--ignore-disk-forecast" in str(e.value)
    with pytest.raises(DiskForecastError) as e:
        refuse_if_short(short, tmp_path, fp8=True)
    assert "fp8_e4m3" not in str(e.value)
    refuse_if_short(DiskForecast(100, 2, 64, 2, 0, free=100 * 272), tmp_path, fp8=False)  # exactly fits
