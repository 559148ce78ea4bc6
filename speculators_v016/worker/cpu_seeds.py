"""Per-request seeds on vLLM 0.16's CPU runner: a discarded sample leaves the request's generator untouched.

Two facts of vLLM 0.16's CPU sampling decide this module:

- A step that computes a partial prefill chunk still samples a token for the request, and vLLM
  discards it. So that a seeded request's random stream does not depend on how its prompt was
  chunked (on the batch around it), vLLM winds the request's generator back after such a step
  (``gen.set_offset(gen.get_offset() - 4)`` in ``GPUModelRunner._bookkeeping_sync``): Philox
  offsets, which CUDA generators have and CPU ones do not ("CPU Generator does not use offset"), so
  on a CPU worker the first seeded request whose prefill is chunked fails the step.
- The CPU sampler (``TopKTopPSampler.forward_cpu``) uses the requests' generators only when every
  row of the batch has one; otherwise it samples the whole batch from the global generator.

:func:`discarded_generators_aside` gets vLLM's intended result without offsets: for the one step
about to be sampled, each row whose token will be discarded gets a scratch generator in place of
its own (so every row still has one, and the others keep their seeds), and its own is put back once
the step is sampled, having drawn nothing for the discarded token, as on a GPU after the wind-back.
The scratch generator's offset calls are no-ops. Used on CPU workers only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


class ScratchGenerator(torch.Generator):
    """A CPU generator for a draw that is thrown away; vLLM's wind-back of its offset does nothing."""

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        pass


@contextmanager
def discarded_generators_aside(runner) -> Iterator[None]:
    """Inside the block (one ``sample_tokens``), scratch generators for the rows whose sample vLLM discards."""
    batch = runner.input_batch
    mask = runner.discard_request_mask.np[: batch.num_reqs]
    aside = {int(i): batch.generators[int(i)] for i in np.nonzero(mask)[0] if int(i) in batch.generators}
    for i in aside:
        batch.generators[i] = ScratchGenerator()
    try:
        yield
    finally:
        batch.generators.update(aside)
