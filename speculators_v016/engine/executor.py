"""vLLM's executor class, extended with the capture set-up after model load, capture RPCs and a close."""

from __future__ import annotations

import functools
import os

from loguru import logger

from speculators_v016.engine.stages import capture_ranks, join_stages
from speculators_v016.protocol import CaptureConfig, WorkerSetup
from speculators_v016.shared.slot_ring import SlotRing

#: vLLM's executor class names, by the kind our settings and summary use.
KINDS = {"UniProcExecutor": "uni", "MultiprocExecutor": "mp", "RayDistributedExecutor": "ray"}
#: Seconds the workers get to release the capture at shutdown.
CLOSE_TIMEOUT_S = 30


class Single:
    """A future of a collective RPC, reduced to the output rank's reply."""

    def __init__(self, future, pick):
        self._future, self._pick = future, pick

    def done(self) -> bool:
        return self._future.done()

    def result(self):
        return self._pick(self._future.result())


class Pair:
    """Two futures as one of ``(first's result, second's result)``."""

    def __init__(self, first, second):
        self._first, self._second = first, second

    def done(self) -> bool:
        return self._first.done() and self._second.done()

    def result(self):
        return self._first.result(), self._second.result()


def executor_kind(base: type) -> str:
    """``uni``, ``mp`` or ``ray`` for a vLLM executor class (or the class name if it is none of them)."""
    for cls in base.__mro__:
        if cls.__name__ in KINDS:
            return KINDS[cls.__name__]
    return base.__name__


def capture_executor(
    base: type, capture: CaptureConfig, ring: SlotRing | None, in_flight: int = 0, by_reference: bool = False
) -> type:
    """``base`` executor + capture set-up (and ring mapping) right after model load, + a capture RPC.

    The set-up sends every worker one :class:`~speculators_v016.protocol.WorkerSetup`: ``capture``,
    the output rank (known once vLLM's workers exist), the ring's spec and ``in_flight``, the steps in
    flight (a GPU worker stages one per step; 0: one fewer than the ring's slots), and ``by_reference``
    (an in-process CPU engine: the states handed over as they are, no ring), and the driving process's pid (a
    worker in another process freezes its objects at exit: shared/exit_gc.py)."""
    one_reply = executor_kind(base) == "mp"  # the multiprocess executor can ask one rank alone

    class CaptureExecutor(base):
        kind = executor_kind(base)
        capture_ranks: tuple[int, ...] = ()  # TP rank 0 of each pipeline stage (set up in _init_executor)

        def _init_executor(self) -> None:
            super()._init_executor()  # workers exist and hold the loaded model
            par = self.vllm_config.parallel_config
            self.capture_output_rank = getattr(self, "output_rank", par.world_size - par.tensor_parallel_size)
            self.capture_ranks = capture_ranks(par.world_size, par.tensor_parallel_size, par.pipeline_parallel_size)
            setup = WorkerSetup(
                capture, self.capture_output_rank, ring.spec if ring is not None else None,
                capture_ranks=self.capture_ranks, staging_buffers=in_flight, by_reference=by_reference,
                driver_pid=os.getpid(),
            )  # fmt: skip
            self.capture_info = list(self.collective_rpc("speculators_capture_setup", args=(setup,)))

        def capture_rpc(
            self,
            method: str,
            args: tuple = (),
            non_block: bool = False,
            timeout: float | None = None,
            paired: bool = False,
        ):
            """A capture RPC; the reply is the output rank's, or under pipeline parallelism every stage's
            captures joined (``paired``: replies are ``(model output, capture)``; the output is the output rank's)."""
            if self.capture_ranks:
                res = self.collective_rpc(method, args=args, non_block=non_block, timeout=timeout)
                pick = functools.partial(self._joined, paired)
            elif one_reply and hasattr(self, "output_rank"):
                res = self.collective_rpc(
                    method, args=args, non_block=non_block, timeout=timeout, unique_reply_rank=self.output_rank
                )
                pick = lambda r: r  # noqa: E731
            else:
                res = self.collective_rpc(method, args=args, non_block=non_block, timeout=timeout)
                pick = lambda rs: next((r for r in rs if r is not None), None)  # noqa: E731
            return Single(res, pick) if non_block else pick(res)

        def _joined(self, paired: bool, replies: list):
            """Every rank's reply -> the stages' captures joined (and the output rank's model output)."""
            captures = [r[1] if paired else r for r in replies if r is not None]
            joined = join_stages(captures, len(capture.capture_ids))
            return (replies[self.capture_output_rank][0], joined) if paired else joined

        def capture_and_sample(self, step: int, slot: int | None, grammar_output, placement: dict | None = None):
            """Future of ``(model runner output, the previous step's capture)``: step ``step`` captured
            into ``slot``, then sampled. One RPC where vLLM's executor runs ours (uni, mp; not with a
            KV connector, whose aggregator reads the replies), else the capture RPC and vLLM's own.
            ``placement`` (:class:`~speculators_v016.protocol.RowPlacement` by request): the uniprocess
            executor's worker alone, whose arguments are this process's objects, never pickled."""
            if placement and self.kind != "uni":
                raise RuntimeError(f"rows placed in requests' tensors need the uniprocess executor, not {self.kind}")
            placed = (placement,) if placement else ()
            if self.kind in ("uni", "mp") and getattr(self, "kv_output_aggregator", None) is None:
                from vllm import envs  # noqa: PLC0415 - vLLM only when an engine starts

                return self.capture_rpc(
                    "speculators_capture_sample",
                    (step, slot, grammar_output, *placed),
                    non_block=True,
                    timeout=envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS,
                    paired=True,
                )
            capture = self.capture_rpc("speculators_capture_step", (step, slot, *placed), non_block=True)
            return Pair(self.sample_tokens(grammar_output, non_block=True), capture)

        def shutdown(self) -> None:
            """Release the capture in the workers (staging, the ring's pinned registration, the states held by
            reference), then vLLM's shutdown."""
            holds = ring is not None or by_reference
            closing = holds and hasattr(self, "capture_info") and not getattr(self, "is_failed", False)
            if closing and not getattr(self, "_capture_closed", False):
                self._capture_closed = True
                try:
                    self.collective_rpc("speculators_capture_close", timeout=CLOSE_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - the workers' exit still drops the registration
                    logger.warning(
                        "capture close in the workers failed ({}: {}); shutting down anyway", type(exc).__name__, exc
                    )
            super().shutdown()

    CaptureExecutor.__name__ = CaptureExecutor.__qualname__ = f"Capture{base.__name__}"
    return CaptureExecutor
