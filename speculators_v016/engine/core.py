"""vLLM 0.16 driven step by step, with capture between the two phases.

Each step: ``execute_model`` -> the capture on the workers (reads the
runner's ``execute_model_state.aux_hidden_states``) -> ``sample_tokens``; the
last two travel as one RPC (``speculators_capture_sample``) where the
executor allows it. With async scheduling (the default) up to
``max_concurrent_batches`` (2; under pipeline parallelism one per stage)
steps are in flight, as in vLLM's own
``EngineCore.step_with_batch_queue``; every call is non-blocking. Each step
gets a slot of the engine's :class:`~speculators_v016.shared.slot_ring.SlotRing`,
which the worker fills and the capture reply names; the slot comes back once
its rows are copied into the requests' tensors (no free slot: the oldest step
is retired first). With :data:`PLACE_ROWS` (on by default) an in-process
worker (the uniprocess executor) copies a prompt's rows straight into its
tensors instead, where the engine hands it their places with the step
(:meth:`~speculators_v016.engine.assembly.Assembler.place`; on GPUs only into
memory registered as pinned, ``stream(pinned=True)``): the copy out of the slot
is gone. Requests are
admitted from an iterator into a bounded window, and each one is yielded as
soon as all its prompt positions are captured, so memory stays bounded
however long the input is.
"""

from __future__ import annotations

import gc
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
from loguru import logger

from speculators_v016.config import EngineConfig
from speculators_v016.engine import worker_env
from speculators_v016.engine.assembly import (
    Allocate,
    Assembler,
    AttributionError,
    copy_threads,
    expected_rows,
    fresh_tensors,
)
from speculators_v016.engine.engine_args import vllm_config
from speculators_v016.engine.executor import capture_executor, executor_kind
from speculators_v016.engine.generation import Decoding, Generated, Generation
from speculators_v016.engine.prefault import prefaulter
from speculators_v016.engine.row_copies import RowCopies
from speculators_v016.engine.stages import check_stage_plan
from speculators_v016.engine.vllm_check import require_vllm
from speculators_v016.engine.worker_start import set_start_method
from speculators_v016.fp8 import CODE_DTYPE, SCALE_DTYPE
from speculators_v016.layers import LayerPlan
from speculators_v016.protocol import CaptureConfig
from speculators_v016.shared.shm_records import RunRecord, reclaim_and_log
from speculators_v016.shared.slot_ring import SlotRing
from speculators_v016.target import PromptError, check_token_ids

__all__ = ["CaptureEngine", "EngineConfig", "EngineDeadError", "PromptError"]

_IN_PROCESS_ENGINES = 0  # live engines whose worker runs in this process (uniprocess executor)
#: Whether an in-process worker copies prompts' rows straight into their tensors where it can (off: every row goes
#: through the ring slot and the copy out of it, as with other executors). On an H100 at hidden 7168 the CLI so
#: placed ran at 0.963x of the generator in bf16 against 0.826x through the slot (FP8: 0.992x against 0.998x), once
#: its pinned blocks were faulted in before being registered (docs/benchmarks/README.md, 2026-12-06, night)
PLACE_ROWS = True


class EngineDeadError(RuntimeError):
    """vLLM's executor failed (e.g. a worker process died); the engine cannot continue."""


class ExecuteModelError(RuntimeError):
    """vLLM's ``execute_model`` failed for a step: its own exception is the cause, and named first."""


def execute_model_failure(step: _Step) -> BaseException | None:
    """The exception ``execute_model`` raised for ``step``, if it failed (its future is done by the time the step's
    capture or sampling failed: the workers run them in order)."""
    try:
        step.executed.result()
    except Exception as exc:  # noqa: BLE001 - any failure of vLLM's is the one to name
        return exc
    return None


@dataclass
class EngineStats:
    prompts: int = 0
    tokens: int = 0
    truncated: int = 0
    steps: int = 0
    computed: int = 0  # tokens of the steps waited for (their scheduled tokens): the forward's progress (a request
    # vLLM preempts and computes again counts twice: rare in prefill runs)
    max_in_flight: int = 0
    stepped: float = 0.0  # s the caller's thread spent in vLLM's steps: scheduling and running or launching them,
    # then waiting for their output (where the GPU, the workers or a CPU forward set the pace)
    copied: float = 0.0  # s it spent handing steps' rows to the assembler (inline: the copies out of the ring)
    copy_thread: float = 0.0  # s the copy thread spent copying rows out of the ring (row copies on a thread)
    copy_waited: float = 0.0  # s the caller's thread waited for that thread (a free slot, or the stream's end)
    launched_before_copy: int = 0  # steps launched before the rows of the step waited on were copied out
    drained: float = 0.0  # s from the moment every prompt was fed, no step was in flight and none was left to each
    # stream's end: the last rows fetched and copied out, handed out, the stream's threads stopped (once a stream())
    prefault_hits: int = 0  # prompts whose tensors were made and touched ahead (GPU engines: engine/prefault.py)
    prefault_misses: int = 0  # prompts whose tensors were made when their first rows came after all
    placed_rows: int = 0  # prompts' rows the worker copied straight into their tensors, never into a slot


@dataclass
class _Step:
    scheduler_output: Any
    executed: Any  # future of execute_model
    output: Any  # future of (ModelRunnerOutput, the previous step's capture), or of execute_model's output
    captured: bool = True  # output carries a capture (not for a step without scheduled tokens)
    number: int = 0  # our step count (0: a step without scheduled tokens)


class _Waited(NamedTuple):
    """A step whose output the scheduler has, and whose rows still sit in their ring slot."""

    capture: Any  # StepCapture, or None (a step without scheduled tokens)
    outputs: dict  # the scheduler's engine-core outputs of the step


#: Engine starts tried when vLLM's rendezvous port is taken under it (see :func:`port_taken`).
START_ATTEMPTS = 3


def says_port_taken(text: str) -> bool:
    """Does this error text (an exception's, or a worker process's output) say torch's store found its port
    taken (EADDRINUSE)?"""
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def port_taken(exc: BaseException) -> bool:
    """Did an engine start fail because its rendezvous port was taken? vLLM picks a free port, closes it and
    binds it again later; another process (a second run on the node, any outgoing connection) can take it
    in between, and torch's store then fails with EADDRINUSE. Nothing was set up then: a new start is safe."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if says_port_taken(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def planned_depth(async_scheduling: bool, pipeline_parallel_size: int) -> int:
    """Steps in flight, as vLLM 0.16's executors allow them (``max_concurrent_batches``): one per pipeline
    stage, and 2 with async scheduling (known before the executor exists, to size the ring)."""
    return max(2 if async_scheduling else 1, pipeline_parallel_size)


def ring_slots(async_scheduling: bool, pipeline_parallel_size: int, copies_apart: bool = False) -> int:
    """Capture slots (see :meth:`CaptureEngine._make_ring`): the steps in flight, the step whose capture the
    worker holds, (without pipeline parallelism) the step whose rows are copied out while the next runs, and
    with the row copies on their own thread one more, so a copy running late does not hold the next launch."""
    depth = planned_depth(async_scheduling, pipeline_parallel_size)
    return depth + (1 if pipeline_parallel_size > 1 else 2) + copies_apart


def copies_apart(row_copies: str, device_type: str) -> bool:
    """Are a step's rows copied out of the ring on a thread of their own (``--row-copies``; auto: GPU engines)?"""
    return row_copies == "thread" or (row_copies == "auto" and device_type != "cpu")


def by_reference(executor_kind: str, device_type: str, fp8: bool) -> bool:
    """Does the engine read its worker's aux states as they are, with no ring and no copy into one? An in-process
    CPU engine storing the engine's dtype: the worker's tensors are this process's memory
    (:mod:`~speculators_v016.worker.held_states` refuses a model that reuses them across forwards)."""
    return executor_kind == "uni" and device_type == "cpu" and not fp8


def release_kv_caches(layers: dict) -> None:
    """A shut-down in-process engine's layers (``static_forward_context``) drop their KV cache, then the dict them."""
    for layer in layers.values():
        caches = getattr(layer, "kv_cache", None)
        if isinstance(caches, list):
            layer.kv_cache = [torch.empty(0) for _ in caches]
    layers.clear()


class CaptureEngine:
    """An in-process vLLM ``EngineCore`` whose steps we drive ourselves."""

    def __init__(self, config: EngineConfig, plan: LayerPlan):
        self.vllm_version = require_vllm()
        self.config, self.plan = config, plan
        #: what every worker's capture does (sent whole, with the ring and the output rank, at set-up)
        self.capture = CaptureConfig(tuple(plan.capture_ids), config.capture_mode, config.hidden_states_dtype)
        vllm_config = self._vllm_config()
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start(vllm_config)
                break
            except Exception as exc:
                if attempt == START_ATTEMPTS or not port_taken(exc):
                    raise
                logger.info(
                    "engine start {} of {}: vLLM's rendezvous port was taken by another process between "
                    "its choice and its use ({}); starting again",
                    attempt,
                    START_ATTEMPTS,
                    exc,
                )
        try:
            self._check_started(vllm_config)
        except BaseException:
            self.shutdown()
            raise
        self._reset_run_state()
        logger.info(
            "engine ready: {} (async scheduling {}, {} steps in flight, capture {})",
            config.model,
            self.async_scheduling,
            self.depth,
            self.capture_info[0],
        )

    def _vllm_config(self):
        """vLLM's config from ours (:mod:`~speculators_v016.engine.engine_args`); async scheduling set as we run it."""
        s = self.config
        config = vllm_config(s, self.capture)
        use_async = s.async_scheduling
        if use_async and config.parallel_config.distributed_executor_backend == "ray":
            logger.warning("vLLM 0.16's Ray executor does not support async scheduling: running sync")
            use_async = False
        if use_async and s.pipeline_parallel_size > 1 and not s.pipeline_async_scheduling:
            # vLLM 0.16's async PP broadcasts each step's sampled tokens from the last stage to the first in
            # sample_tokens, so the first stage starts step k+1 only after the last finished step k; sync
            # keeps one batch per stage in flight (docs/pipeline-parallel.md; --pipeline-async-scheduling).
            logger.info("pipeline parallelism: async scheduling off, one batch per stage in flight")
            use_async = False
        # vLLM's CPU platform turns async scheduling off in its config hook; we
        # own the loop (and the CPU output shim), so we set it back, before the
        # executor exists and the workers receive the config.
        config.scheduler_config.async_scheduling = use_async
        self.async_scheduling = use_async
        worker_env.check(  # what vLLM's workers would fail on after they started
            os.environ,
            cpu=config.device_config.device_type == "cpu",
            workers=config.parallel_config.world_size,
            stages=config.parallel_config.pipeline_parallel_size,
            num_layers=config.model_config.hf_text_config.num_hidden_layers,
        )
        return config

    def _start(self, config) -> None:
        """The ring, then vLLM's engine core with our executor (workers load the model and set up capture)."""
        from vllm.v1.engine.core import EngineCore  # noqa: PLC0415 - vLLM only when an engine starts
        from vllm.v1.executor.abstract import Executor  # noqa: PLC0415 - vLLM only when an engine starts

        global _IN_PROCESS_ENGINES
        executor_class = Executor.get_class(config)
        self.executor_kind = executor_kind(executor_class)
        #: each step's rows copied out of the ring on a thread of their own (GPU engines by default), or inline
        self.row_copies_apart = copies_apart(self.config.row_copies, config.device_config.device_type)
        set_start_method(config.device_config.device_type, self.executor_kind)  # GPU workers: spawned, never forked
        self._in_process = self.executor_kind == "uni"
        self._executor_failed = False
        reclaim_and_log()  # dead runs' recorded segments: every engine start, whatever its executor
        # A record of what this engine holds in /dev/shm, for the next run if this one is killed: only
        # with worker processes (the uniprocess executor creates nothing there; Ray's workers are not ours).
        self.shm_record = RunRecord.open() if self.executor_kind not in ("uni", "ray") else None
        #: an in-process CPU engine reads its worker's aux states as they are: no ring, no copy into one
        self.by_reference = by_reference(self.executor_kind, config.device_config.device_type, self.config.fp8)
        try:
            self.ring = None if self.by_reference else self._make_ring(config)
            try:
                cpu, workers = config.device_config.device_type == "cpu", config.parallel_config.world_size
                # vLLM's queues and semaphores, recorded as they appear; CPU workers bound where vLLM cannot
                with self._recording(), worker_env.workers_bound(cpu and self.executor_kind == "mp", workers):
                    self.core = EngineCore(
                        config,
                        capture_executor(
                            executor_class,
                            self.capture,
                            self.ring,
                            planned_depth(self.async_scheduling, config.parallel_config.pipeline_parallel_size),
                            self.by_reference,
                        ),
                        log_stats=False,
                        executor_fail_callback=self._on_executor_failure,
                    )
            except BaseException:
                if self.ring is not None:
                    self.ring.close()
                raise
        except BaseException:
            self._close_record()
            if self._in_process and _IN_PROCESS_ENGINES == 0:
                # A start refused in this process (e.g. by the stream proof) has set up vLLM's
                # parallel state here; the next engine needs it fresh, as after a shutdown.
                from vllm.distributed.parallel_state import (  # noqa: PLC0415 - vLLM only when an engine starts
                    cleanup_dist_env_and_memory,
                )

                cleanup_dist_env_and_memory()
            raise
        if self.ring is not None:
            self.ring.unlink()  # the output-rank worker has mapped it: a crash now leaves no file
        _IN_PROCESS_ENGINES += self._in_process
        self.scheduler = self.core.scheduler
        self.executor = self.core.model_executor
        self.depth = self.executor.max_concurrent_batches
        self.capture_info = self.executor.capture_info
        self.vocab_size = config.model_config.get_vocab_size()
        self.dtype = config.model_config.dtype
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_prompt_len = config.model_config.max_model_len - 1  # room for the one sampled token
        self.copy_threads = copy_threads(config.device_config.device_type)
        self.device_type = config.device_config.device_type
        #: the worker may copy rows straight into requests' tensors: in-process, one stage, a ring
        self.can_place = (
            self.ring is not None and self._in_process and config.parallel_config.pipeline_parallel_size == 1
        )

    def _check_started(self, config) -> None:
        """The ring covers the steps in flight, the loaded model has the planned depth, and (pipeline
        parallelism) the stages' layers tile the plan's."""
        if self.ring is not None and self.ring.spec.slots < self.depth + 1:
            raise RuntimeError(f"{self.depth} steps in flight need {self.depth + 1} capture slots")
        layers = {i["num_layers"] for i in self.capture_info if i}
        if layers != {self.plan.num_layers}:
            raise ValueError(f"the loaded model has {layers} decoder layers, the layer plan {self.plan.num_layers}")
        self.stage_lines = check_stage_plan(
            self.capture_info, self.plan.capture_ids, config.parallel_config.tensor_parallel_size
        )
        for line in self.stage_lines if config.parallel_config.pipeline_parallel_size > 1 else ():
            logger.info("pipeline {}", line)

    def _reset_run_state(self) -> None:
        from vllm.sampling_params import SamplingParams  # noqa: PLC0415 - vLLM only when an engine starts

        self._sampling = SamplingParams(max_tokens=1, temperature=0.0)
        self._sampling_logprobs = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        self._logprob_keys: dict[str, Any] = {}  # request id -> key, for prompts whose logprobs are wanted
        self._decoding: dict[str, Decoding] = {}  # request id -> what a generating request sampled so far
        self.generated: dict[Any, Generated] = {}  # key -> a finished generating request's tokens, until taken
        self.prompt_logprobs: dict[Any, Any] = {}  # key -> vLLM's log p(token t+1 | ..t), [len - 1]
        self.open_requests: set = set()  # during stream(): ids admitted and not yet complete (a feed may ask)
        self._next_id = 0
        self._step = 0
        self._broken: BaseException | None = None
        self._logprobs_warm = False
        self.stats = EngineStats()

    def _make_ring(self, config) -> SlotRing | None:
        """The capture slots of ``max_num_batched_tokens`` rows (none for Ray, nor for an in-process CPU engine,
        which reads its states by reference): depth + 1 (the steps in flight
        and the one whose capture the worker still holds), and without pipeline parallelism one more: the step
        waited on keeps its slot while the next step is launched, so its rows are copied out while the device
        computes (:meth:`stream`)."""
        if self.executor_kind == "ray":  # workers may sit on other hosts: states travel in the reply
            return None
        record = self.shm_record
        ring = SlotRing.create(
            slots=ring_slots(
                self.async_scheduling, config.parallel_config.pipeline_parallel_size, self.row_copies_apart
            ),
            num_ids=len(self.plan.capture_ids),
            max_rows=config.scheduler_config.max_num_batched_tokens,
            hidden=config.model_config.get_hidden_size(),
            dtype=config.model_config.dtype,
            shared=not self._in_process,
            hidden_states_dtype=self.capture.hidden_states_dtype,
            created=record.add if record is not None else None,
        )
        logger.debug("capture ring {}: {}", ring.spec.name, ring.spec.describe())
        return ring

    @contextmanager
    def _recording(self):
        """Keep this engine's shared-memory record current while vLLM starts (a no-op without a record)."""
        if self.shm_record is None:
            yield
            return
        with self.shm_record.watching():
            yield

    def _close_record(self) -> None:
        record, self.shm_record = getattr(self, "shm_record", None), None
        if record is not None:
            record.close()

    def _on_executor_failure(self) -> None:
        """Called by vLLM's executor monitor when a worker process dies."""
        self._executor_failed = True
        logger.error("a vLLM worker process died: stopping")

    # -- requests ---------------------------------------------------------
    def _admit(self, feed: Iterator, assembler: Assembler, window: int, waiting: set, want=None) -> bool:
        """Move prompts from ``feed`` into the scheduler until ``window`` are open."""
        from vllm.v1.request import Request  # noqa: PLC0415 - vLLM only when an engine starts

        while len(waiting) < window:
            try:
                item = next(feed)
            except StopIteration:
                return False
            if item is None:  # a feed with nothing ready until a sample it waits for is yielded
                if not waiting:
                    raise RuntimeError("the feed has nothing ready and no request is running: it waits for nothing")
                return True
            key, ids, generation = item if len(item) == 3 else (*item, None)
            ids = self.check_prompt(key, ids, generation=generation)
            rid = f"s{self._next_id}"
            self._next_id += 1
            assembler.add_request(rid, (key, ids, rid), len(ids), generating=generation is not None)
            waiting.add(rid)
            logprobs = want is not None and want(key)
            if logprobs:
                self._logprob_keys[rid] = key
            if generation is not None:
                self._decoding[rid] = Decoding(len(ids), generation)
                params = generation.sampling_params(prompt_logprobs=logprobs)
            else:
                params = self._sampling_logprobs if logprobs else self._sampling
            self.scheduler.add_request(
                Request(
                    rid, ids, params, None, None, arrival_time=time.time(), block_hasher=self.core.request_block_hasher
                )
            )
            self.stats.prompts += 1
            self.stats.tokens += len(ids)
        return True

    def check_prompt(self, key: Any, ids, count: bool = True, generation: Generation | None = None) -> list[int]:
        """The prompt as a list, truncated to ``max_model_len - 1``; PromptError if unusable (a generating
        prompt is never truncated: it must leave room for its ``max_new_tokens`` and the step past them)."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if not ids:
            raise PromptError(f"prompt {key!r} is empty")
        check_token_ids(key, ids, self.vocab_size)
        if generation is not None:
            room = self.max_prompt_len + 1 - generation.max_new_tokens - 1
            if len(ids) > room:
                raise PromptError(
                    f"prompt {key!r}: {len(ids)} tokens and {generation.max_new_tokens} new ones (and the step past "
                    f"them) exceed max_model_len {self.max_prompt_len + 1}"
                )
            return ids
        if len(ids) > self.max_prompt_len and count:
            logger.warning(
                "prompt {!r}: {} tokens truncated to {} (max_model_len - 1)", key, len(ids), self.max_prompt_len
            )
            self.stats.truncated += 1
        return ids[: self.max_prompt_len]

    # -- steps ------------------------------------------------------------
    def _launch(self, assembler: Assembler) -> _Step:
        began = time.perf_counter()  # a uniprocess CPU engine runs the forward here; a GPU one launches it
        try:
            so = self.scheduler.schedule()
            executed = self.executor.execute_model(so, non_block=True)
            if so.total_num_scheduled_tokens == 0:  # still carries finished request ids to the workers
                return _Step(so, executed, executed, captured=False)
            self._step += 1
            self.stats.steps += 1
            rows = expected_rows(so)
            assembler.expect(self._step, rows)
            slot = self.ring.acquire() if self.ring is not None else None
            placement = assembler.place(self._step, rows)  # empty unless the worker copies rows into their tensors
            grammar = self.scheduler.get_grammar_bitmask(so)
            output = self.executor.capture_and_sample(self._step, slot, grammar, *((placement,) if placement else ()))
            return _Step(so, executed, output, number=self._step)
        finally:
            self.stats.stepped += time.perf_counter() - began

    def _retire(self, step: _Step, assembler: Assembler, keep: bool = True) -> None:
        """Wait for ``step``, hand its output to the scheduler and its rows to ``assembler``."""
        self._finish(self._wait(step, assembler), assembler, keep)

    def _wait(self, step: _Step, assembler: Assembler) -> _Waited:
        """Wait for ``step``'s output and hand it to the scheduler; its rows stay in their ring slot until
        :meth:`_finish` (so the next step can be launched first, see :meth:`stream`)."""
        began = time.perf_counter()
        try:
            output = step.output.result()
        except Exception:
            self._raise_execute_model_failure(step)
            raise
        output, capture = output if step.captured else (output, None)
        self.stats.stepped += time.perf_counter() - began
        self.stats.computed += step.scheduler_output.total_num_scheduled_tokens
        try:
            if output is None:  # execute_model failed: raise its error
                self._raise_execute_model_failure(step)
                raise RuntimeError("vLLM returned no model output for a step")
            outputs = self.scheduler.update_from_output(step.scheduler_output, output)
        except BaseException:
            self._consume(capture, assembler, keep=False)  # its slot goes back
            raise
        return _Waited(capture, outputs)

    def _finish(self, waited: _Waited, assembler: Assembler, keep: bool = True) -> None:
        """A waited step's rows to ``assembler`` (its slot back to the ring), then its sampled tokens and
        prompt logprobs (in this order: a generating request grows only after its step's rows are in)."""
        began = time.perf_counter()
        self._consume(waited.capture, assembler, keep)
        self.stats.copied += time.perf_counter() - began
        if self._logprob_keys:
            self._keep_prompt_logprobs(waited.outputs)
        if self._decoding:
            self._take_sampled(waited.outputs, assembler)

    @staticmethod
    def _raise_execute_model_failure(step: _Step) -> None:
        """Where vLLM's ``execute_model`` failed for ``step``, raise that: the capture's or sampling's error, which
        follows from it, stays as context only."""
        failure = execute_model_failure(step)
        if failure is None:
            return
        where = f"step {step.number}" if step.number else "a step without scheduled tokens"
        raise ExecuteModelError(f"vLLM's execute_model failed at {where}: {type(failure).__name__}: {failure}") from (
            failure
        )

    def _take_sampled(self, outputs: dict, assembler: Assembler) -> None:
        """The tokens a step sampled for generating requests: their samples grow, and end at a stop or the cap."""
        for batch in outputs.values():
            for out in batch.outputs:
                decoding = self._decoding.get(out.request_id)
                if decoding is None or decoding.finished or not out.new_token_ids:
                    continue
                ended = decoding.add(out.new_token_ids, out.new_logprobs)
                assembler.grow(out.request_id, decoding.result.length, final=ended)

    def _keep_prompt_logprobs(self, outputs: dict) -> None:
        """vLLM's prompt logprobs of the prompts that asked for them (they come whole, with the first token)."""
        for batch in outputs.values():
            for out in batch.outputs:
                tensors = out.new_prompt_logprobs_tensors
                if tensors is not None and out.request_id in self._logprob_keys:
                    key = self._logprob_keys.pop(out.request_id)
                    self.prompt_logprobs[key] = tensors.logprobs[:, 0].clone()

    def _consume(self, capture, assembler: Assembler, keep: bool = True) -> None:
        """Hand a capture's rows to ``assembler`` (unless dropped); its slot goes back once they are copied."""
        if capture is None:
            return
        release = None if capture.slot is None else partial(self.ring.release, capture.slot)
        try:
            if keep:
                if capture.slot is not None:
                    rows = sum(capture.counts)
                    capture.states = self.ring.slot(capture.slot)[:, :rows]
                    scales = self.ring.scales(capture.slot)
                    capture.scales = scales[:, :rows] if scales is not None else None
                taken, release = release, None
                assembler.add(capture, taken)  # gives the slot back, now or once the rows are copied
        finally:
            capture.states = capture.scales = None
            if release is not None:
                release()

    def stream(
        self,
        prompts: Iterable[tuple[Any, list[int]]],
        window: int | None = None,
        prompt_logprobs=None,
        allocate: Allocate | None = None,
        proven: set | None = None,
        pinned: bool = False,
    ) -> Iterator[tuple[Any, list[int], list]]:
        """Yield ``(key, input_ids, states per requested layer)`` as each prompt completes.

        A layer's states are a ``[len, hidden]`` tensor in the engine's dtype,
        or, with ``hidden_states_dtype="fp8_e4m3"``, a
        :class:`~speculators_v016.fp8.Fp8States` (codes and scales).

        ``prompt_logprobs(key) -> bool`` picks prompts whose vLLM prompt logprobs
        are kept in :attr:`prompt_logprobs` (by key) before they are yielded.
        ``allocate`` gives the memory of each prompt's states (default: fresh
        tensors, which the caller owns), e.g. a
        :class:`~speculators_v016.engine.buffer_pool.BufferPool`'s ``take``.
        ``proven``: a set the keys are added to, before they are yielded, whose
        every state the device proved finite as it left it (GPU staging:
        ``StepCapture.finite``); the caller takes them out. Code
        that changes a sample's states afterwards must take its key out too.
        ``pinned``: ``allocate``'s memory is registered with the device as pinned
        and stays so (and allocated) while a copy into it may be in flight, e.g. a
        pinned :class:`~speculators_v016.engine.buffer_pool.BufferPool`: with
        :data:`PLACE_ROWS` a GPU worker of this process then copies the rows there
        directly (:attr:`can_place`; a CPU one does so into any memory, its copies
        done when the step's call returns).

        If the caller stops early or a prompt is refused, the prompts already
        admitted are aborted and the steps in flight are retired, so the
        engine is ready for the next call. An error inside vLLM leaves the
        engine unusable (it says so on the next call).
        """
        if self._broken is not None:
            raise RuntimeError(f"this engine failed earlier and cannot be used again: {self._broken}")
        prefault = prefaulter(allocate or fresh_tensors, self.copy_threads)
        held = self.ring is not None or self.by_reference  # rows to copy out of a slot, or out of the worker's states
        copies = RowCopies(self.copy_threads) if self.row_copies_apart and held else None
        assembler = Assembler(self.plan.capture_order, allocate, fp8=self.config.fp8, copy_threads=self.copy_threads,
                              prefault=prefault, copies=copies, place=self._placed_row(pinned))  # fmt: skip
        feed, waiting, in_flight = iter(prompts), set(), deque()
        self.open_requests = waiting
        drain_began = None  # when no step was in flight and none was left: the stream's end is drained from there
        window = window or 2 * self.config.max_num_seqs
        more = True
        try:
            while True:
                more = more and self._admit(feed, assembler, window, waiting, prompt_logprobs)
                if drain_began is None and not (more or in_flight or self.scheduler.has_requests()):
                    drain_began = time.perf_counter()
                if self._can_launch(in_flight, assembler):
                    in_flight.appendleft(self._launch(assembler))
                    self.stats.max_in_flight = max(self.stats.max_in_flight, len(in_flight))
                    if len(in_flight) < self.depth and not in_flight[-1].output.done():
                        continue  # keep the pipeline full before waiting on the oldest step
                if in_flight:
                    waited = self._wait(in_flight.pop(), assembler)
                    try:  # the next step goes to the device before this one's rows are copied out of the ring
                        if self._can_launch(in_flight, assembler):
                            in_flight.appendleft(self._launch(assembler))
                            self.stats.max_in_flight = max(self.stats.max_in_flight, len(in_flight))
                            self.stats.launched_before_copy += 1
                    finally:
                        self._finish(waited, assembler)
                elif assembler.pending_steps:
                    self._consume(self.executor.capture_rpc("speculators_capture_flush"), assembler)
                elif assembler.copying:  # nothing else to wait for: the last steps' copies
                    assembler.settle()
                yield from self._handed_out(assembler.pop_complete(), assembler.proven, proven)
                waiting.intersection_update(assembler.unfinished())
                if not (more or waiting or in_flight or self.scheduler.has_requests()):
                    return
                if waiting and not (
                    in_flight or self.scheduler.has_requests() or assembler.pending_steps or assembler.copying
                ):
                    raise AttributionError(
                        f"requests finished without complete hidden states: {assembler.unfinished()}"
                    )
        except (GeneratorExit, PromptError):
            self._settle(assembler)  # the slots the copies hold come back before the steps in flight retire
            self._abandon(waiting, in_flight)
            raise
        except BaseException as exc:
            self._broken = exc
            if self._executor_failed or getattr(self.executor, "is_failed", False):
                raise EngineDeadError(
                    f"a vLLM worker process died, so the engine stopped "
                    f"({type(exc).__name__}: {exc}); finished samples are kept"
                ) from exc
            raise
        finally:
            self._settle(assembler)  # no copy may still read the ring once the stream is left
            if copies is not None:
                copies.close()
                self.stats.copy_thread += copies.copying
                self.stats.copy_waited += copies.waited
            self.stats.placed_rows += assembler.placed_rows
            if prefault is not None:
                prefault.close()
                self.stats.prefault_hits += prefault.hits
                self.stats.prefault_misses += prefault.misses
            if drain_began is not None:
                self.stats.drained += time.perf_counter() - drain_began

    @property
    def wants_pinned(self) -> bool:
        """Would :meth:`stream` place rows in memory its caller says is pinned (``pinned=True``)? A GPU engine
        with :data:`PLACE_ROWS` on that :attr:`can_place`; the caller then registers its memory."""
        return PLACE_ROWS and self.can_place and self.device_type != "cpu"

    def _placed_row(self, pinned: bool) -> tuple | None:
        """(hidden, stored dtype, FP8 scales' dtype) of the rows the worker copies into requests' tensors;
        None where it copies them into the ring slot (see :meth:`stream`'s ``pinned``)."""
        if not (PLACE_ROWS and self.can_place and (pinned or self.device_type == "cpu")):
            return None
        spec = self.ring.spec
        return spec.hidden, *((CODE_DTYPE, SCALE_DTYPE) if self.config.fp8 else (spec.torch_dtype, None))

    @staticmethod
    def _settle(assembler: Assembler) -> None:
        """Wait for the copies in flight, their slots back; a failed copy here is not what is being raised."""
        try:
            assembler.settle()
        except Exception as exc:  # noqa: BLE001 - the stream is already failing or ending; say so, raise the first
            logger.warning("while the stream ended, a step's row copies failed: {}", exc)

    def _handed_out(self, complete: list, finite: set[str], proven: set | None) -> list:
        """Complete requests as the caller gets them; a generating one ends in the scheduler (it ran a step
        past its end, or further) and its ids and result are the sample's: :attr:`generated` by key. The keys of
        those the device proved finite (request ids taken out of ``finite``) go into ``proven``, if given."""
        out, finished = [], []
        for (key, ids, rid), states in complete:
            if rid in finite:
                finite.discard(rid)
                if proven is not None:
                    proven.add(key)
            decoding = self._decoding.pop(rid, None)
            if decoding is not None:
                finished.append(rid)
                ids = ids + decoding.result.token_ids
                self.generated[key] = decoding.result
            out.append((key, ids, states))
        if finished:
            from vllm.v1.request import RequestStatus  # noqa: PLC0415 - vLLM only where an engine runs

            self.scheduler.finish_requests(finished, RequestStatus.FINISHED_ABORTED)
        return out

    def _abandon(self, waiting: set, in_flight: deque) -> None:
        """Abort admitted prompts and retire the steps in flight (the engine stays usable)."""
        from vllm.v1.request import RequestStatus  # noqa: PLC0415 - vLLM only when an engine starts

        self.scheduler.finish_requests(list(waiting) + list(self._decoding), RequestStatus.FINISHED_ABORTED)
        self._logprob_keys.clear()
        self._decoding.clear()
        scratch = Assembler(self.plan.capture_order, fp8=self.config.fp8)
        while in_flight:
            self._retire(in_flight.pop(), scratch, keep=False)
        while self.scheduler.has_requests():  # finished ids still have to reach the workers
            self._retire(self._launch(scratch), scratch, keep=False)
        self._consume(self.executor.capture_rpc("speculators_capture_flush"), scratch, keep=False)

    def warm_prompt_logprobs(self) -> float:
        """Run vLLM's prompt-logprobs path once, before a run's clock starts; return its seconds.

        vLLM 0.16 ranks each prompt token with ``batched_count_greater_than``,
        a ``torch.compile(dynamic=True)`` kernel compiled on its first use and
        again for a single row (sizes 0 and 1 are specialised): 7-17 s on a
        CPU host, inside the first step that asks for prompt logprobs (the
        logit check's). Two tiny prompts through the real path (2 rows and 1
        row of prompt logprobs) compile both here; the engine is left as it was.
        """
        if self._logprobs_warm:
            return 0.0
        start = time.perf_counter()
        prompts = [(("warm-up", 0), [1, 2, 3]), (("warm-up", 1), [1, 2])]
        for _ in self.stream(prompts, prompt_logprobs=lambda key: True):
            pass
        self.prompt_logprobs.clear()
        self.stats = EngineStats()
        self._logprobs_warm = True
        seconds = time.perf_counter() - start
        logger.info("vLLM's prompt-logprobs path warmed up in {:.1f} s (compiled once, before the run)", seconds)
        return seconds

    def _slot_free(self, assembler: Assembler) -> bool:
        """A ring slot for the next step; where the row copies hold them all, the oldest step's copies are waited
        for (the copy thread waits on nothing of the engine's)."""
        if self.ring is None:
            return True
        if not self.ring.free and assembler.copying:
            assembler.land(wait=1)
        return self.ring.free > 0

    def _can_launch(self, in_flight: deque, assembler: Assembler) -> bool:
        """A step can go to the device now: work is scheduled, fewer than ``depth`` are in flight, a slot is free."""
        return self.scheduler.has_requests() and len(in_flight) < self.depth and self._slot_free(assembler)

    def shutdown(self) -> None:
        global _IN_PROCESS_ENGINES
        ring, self.ring = getattr(self, "ring", None), None
        core, self.core = getattr(self, "core", None), None
        if core is None:
            if ring is not None:
                ring.close()
            self._close_record()
            return
        try:
            layers = getattr(getattr(getattr(core, "vllm_config", None), "compilation_config", None),
                             "static_forward_context", {})  # fmt: skip
            try:
                core.shutdown()
            finally:
                if ring is not None:
                    ring.close()
            # The config keeps every attention layer (and its KV cache) by name, and a layer may outlive the
            # engine: vLLM 0.16's CPU fused-MoE layer stays referenced after shutdown, and through its config
            # held a whole KV cache (1 GiB a MoE engine, seen in one test process); on GPUs a compiled
            # engine's layers outlive it too (torch.compile's caches), each holding its share of the KV cache
            # (the next engine in the process found 35 GiB less free memory per compiled engine before).
            # The layers let go of their KV cache and the config of the layers.
            if self._in_process:
                release_kv_caches(layers)
            # The executor holds the worker, and the worker the model and its KV cache (an in-process engine's
            # whole GPU memory share: 35.8 GiB at 0.25 of an H200, held while a caller kept the generator).
            self.executor = None
            del core
            gc.collect()  # release vLLM's native handles now, not inside a later engine's compile
        finally:
            self._close_record()  # after vLLM removed its segments: what is left stays recorded
        if self._in_process:
            # A uniprocess engine initialised vLLM's parallel state in this
            # process; the next engine (maybe another model family, e.g. MoE
            # with an expert-parallel group) needs it fresh.
            _IN_PROCESS_ENGINES -= 1
            if _IN_PROCESS_ENGINES == 0:
                from vllm.distributed.parallel_state import (  # noqa: PLC0415 - vLLM only when an engine starts
                    cleanup_dist_env_and_memory,
                )

                cleanup_dist_env_and_memory()
