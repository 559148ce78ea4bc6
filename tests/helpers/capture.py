"""The worker's set-up as the engine sends it, for stand-in workers of rank 0 (the output rank)."""

from speculators_v016.protocol import CaptureConfig, RingSpec, WorkerSetup


def worker_setup(
    num_ids: int,
    ring: RingSpec | None,
    staging: str = "auto",
    hidden_states_dtype: str | None = None,
    output_rank: int = 0,
) -> WorkerSetup:
    """A set-up capturing ``num_ids`` layers into ``ring``; the storage is the ring's unless given."""
    dtype = hidden_states_dtype or (ring.hidden_states_dtype if ring is not None else "auto")
    return WorkerSetup(CaptureConfig(tuple(range(num_ids)), hidden_states_dtype=dtype), output_rank, ring, staging)
