"""What a run will write, forecast before the engine starts, against the free space of its folder.

A sample of ``T`` tokens holds, per captured layer, ``T`` rows of ``hidden`` values in the storage dtype
(FP8 storage: one byte a value and one float32 scale a row), plus its ``input_ids`` and ``loss_mask``
(int64 each). Headers, the manifest and the log are small beside that and left out, so the forecast is a
floor: a run it refuses cannot fit. A run whose tokens are not known before it starts (``--regenerate``:
the target writes them) gets no forecast.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from speculators_v016.store.outdir import OutputDirError

GIB = 1 << 30
ID_AND_MASK_BYTES = 16  # input_ids and loss_mask, int64 each, per token
FP8_SCALE_BYTES = 4  # one float32 scale per row and layer


class DiskForecastError(OutputDirError):
    """The forecast bytes of a run exceed its folder's free space; the message says both and the ways out."""


@dataclass(frozen=True)
class DiskForecast:
    tokens: int
    layers: int
    hidden: int
    value_bytes: int  # bytes of one stored value (2 for bf16, 1 for FP8 codes)
    row_extra_bytes: int  # bytes per row and layer beside the values (FP8: its scale)
    free: int  # bytes free in the folder

    @property
    def bytes(self) -> int:
        return self.tokens * token_bytes(self.layers, self.hidden, self.value_bytes, self.row_extra_bytes)

    @property
    def fits(self) -> bool:
        return self.bytes <= self.free

    def line(self) -> str:
        return (
            f"{self.bytes / GIB:,.2f} GiB to write ({self.tokens:,} tokens x {self.layers} layers x {self.hidden} x "
            f"{self.value_bytes} B), {self.free / GIB:,.2f} GiB free"
        )


def token_bytes(layers: int, hidden: int, value_bytes: int, row_extra_bytes: int = 0) -> int:
    """Bytes one token weighs in a sample file: its rows of every layer, its id and mask."""
    return layers * (hidden * value_bytes + row_extra_bytes) + ID_AND_MASK_BYTES


def stored_token_bytes(layers: int, hidden: int, value_bytes: int, fp8: bool) -> int:
    """:func:`token_bytes` as stored: FP8 codes (one byte) and a scale a row, else the model's dtype."""
    return token_bytes(layers, hidden, 1, FP8_SCALE_BYTES) if fp8 else token_bytes(layers, hidden, value_bytes)


def forecast(directory: Path, tokens: int, layers: int, hidden: int, value_bytes: int, fp8: bool) -> DiskForecast:
    """The forecast of writing ``tokens`` tokens of ``layers`` layers of width ``hidden`` into ``directory``."""
    return DiskForecast(
        tokens=tokens,
        layers=layers,
        hidden=hidden,
        value_bytes=1 if fp8 else value_bytes,
        row_extra_bytes=FP8_SCALE_BYTES if fp8 else 0,
        free=shutil.disk_usage(directory).free,
    )


def refuse_if_short(found: DiskForecast, directory: Path, fp8: bool) -> None:
    """DiskForecastError where ``found`` does not fit, naming both figures and the ways out."""
    if found.fits:
        return
    ways = [] if fp8 else ["--hidden-states-dtype fp8_e4m3 (about half the bytes)"]
    ways += [
        "`speculators-data-gen serve` (states served to the trainer, no dataset on disk)",
        "--num-shards with shards on other disks",
        "--max-samples",
        "--ignore-disk-forecast to start anyway",
    ]
    raise DiskForecastError(
        f"{directory}: this run would write at least {found.bytes / GIB:,.2f} GiB ({found.tokens:,} tokens x "
        f"{found.layers} layers x hidden {found.hidden} x {found.value_bytes} B), and the folder's disk has "
        f"{found.free / GIB:,.2f} GiB free. Ways out: {'; '.join(ways)}"
    )
