"""vLLM's own loop computing the capture's aux states and dropping them: ``gpu_generator.py``'s ``vllm-aux`` side.

:class:`AuxOnlyExecutor` is vLLM's uniprocess executor whose worker, right after the model is loaded (before
vLLM profiles memory, compiles and captures CUDA graphs, as the generator's engine does it), gets the capture's
aux outputs installed: the stream proof, vLLM's built-in aux ids, our taps. There is no ring, and nothing
copies the aux states: each step computes them as the generator's steps do, and vLLM's runner drops them. So
``vllm-aux / vllm`` is what the capture's arithmetic costs vLLM's own loop, and ``uni / vllm-aux`` what the rest
of the generator costs (its loop, the copies, the proof). vLLM's engine core builds the executor in its own
process, by this module's name; the capture's vLLM ids come in :data:`IDS_VARIABLE` (JSON), set before the
engine starts.
"""

from __future__ import annotations

import json
import os

from vllm.v1.executor.uniproc_executor import UniProcExecutor

from speculators_v016.protocol import CaptureConfig, WorkerSetup

#: the capture's vLLM aux ids, a JSON list (speculators_v016.layers: our layer L is vLLM's L + 1)
IDS_VARIABLE = "SPECULATORS_BENCH_AUX_IDS"


def capture_config() -> CaptureConfig:
    """The capture this side's worker installs (also the engine's ``additional_config``: no compiled graph without
    these aux outputs is reused)."""
    return CaptureConfig(tuple(json.loads(os.environ[IDS_VARIABLE])))


def engine(engine_args):
    """vLLM's ``LLMEngine`` for ``engine_args`` with :class:`AuxOnlyExecutor`, built as ``from_engine_args`` builds
    it (its engine core in a process of its own where vLLM's multiprocessing is on). The class is handed to the
    engine, not given as ``distributed_executor_backend``: vLLM 0.16 turns async scheduling off for a class there,
    and the ``vllm`` side keeps it on."""
    from vllm import envs  # noqa: PLC0415 - read as vLLM reads it when the engine is made
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: PLC0415 - the same

    config = engine_args.create_engine_config()
    return LLMEngine(
        vllm_config=config,
        executor_class=AuxOnlyExecutor,
        log_stats=not engine_args.disable_log_stats,
        multiprocess_mode=bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING),
    )


class AuxOnlyExecutor(UniProcExecutor):
    """vLLM's uniprocess executor, its worker's model returning the capture's aux states (installed, not copied)."""

    def _init_executor(self) -> None:
        super()._init_executor()  # the worker exists and holds the loaded model
        capture = capture_config()
        setup = WorkerSetup(capture, output_rank=0, ring=None)
        self.capture_info = list(self.collective_rpc("speculators_capture_setup", args=(setup,)))
        installed = [info.get("stage_ids") for info in self.capture_info]
        if installed != [list(capture.capture_ids)]:  # the side measures nothing it claims otherwise
            raise RuntimeError(f"vllm-aux: aux ids {list(capture.capture_ids)} asked, the worker installed {installed}")
