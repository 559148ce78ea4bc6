"""What the engine and the workers exchange: the ring's description and each step's capture metadata.

Both sides import this module and nothing of each other, so the engine side
never loads worker code (aux outputs, CPU shims) and the worker side never
loads the engine loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
PREFIX = "speculators-v016-ring-"


@dataclass(frozen=True)
class RingSpec:
    """What a worker needs to map the ring (sent through the set-up RPC).

    A shared ring's file starts with a header that repeats the shape and the
    creator's random ``token``: the worker maps the file only if both match
    (a name that vanished or was replaced fails the run, never maps zeros).
    """

    name: str
    shared: bool
    slots: int
    num_ids: int
    max_rows: int
    hidden: int
    dtype: str  # e.g. "bfloat16"
    token: str = ""  # hex; the creator's identity token (shared rings)
    directory: str = SHM_DIR  # where a shared ring's file lies

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def slot_numel(self) -> int:
        return self.num_ids * self.max_rows * self.hidden

    @property
    def slot_bytes(self) -> int:
        return self.slot_numel * self.torch_dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    def describe(self) -> str:
        return (f"{self.slots} slots x {self.max_rows} rows x {self.num_ids} layers x {self.hidden} hidden "
                f"x {self.slot_bytes // self.slot_numel} bytes = {self.total_bytes / 2**20:,.0f} MiB")


@dataclass
class StepCapture:
    """The aux states of one step, in the runner's batch order.

    ``states`` is ``[num_capture_ids, rows, hidden]``: in the reply it is None
    when the rows sit in ring slot ``slot`` (the engine fills it in with a view
    of the slot); with no ring it is a host tensor.
    """

    step: int
    req_ids: list[str]
    starts: list[int]  # position in the prompt of each request's first row
    counts: list[int]  # rows per request
    slot: int | None = None
    states: torch.Tensor | None = None
