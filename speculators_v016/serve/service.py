"""Requests from every client, one engine: the service's loop, apart from its HTTP front.

:meth:`CaptureService.submit` checks a request (token ids in the vocabulary, at
most ``seq_length`` of them), queues it and returns a future. One thread runs
:meth:`CaptureEngine.stream <speculators_v016.engine.core.CaptureEngine.stream>`
over a feed of the queued requests, so requests of all clients are batched as a
run's samples are (async scheduling, the capture ring, FP8 storage, the start-up
stream proof). Each finished sample goes through a bounded queue to the publisher
threads. The engine's thread judges every sample as a run does: a sample whose
states hold rows no model produces is refused (its client told, counted), and
:data:`SCREENED_IN_A_ROW` such samples in a row stop the service (the capture is
broken: one request never stops it); and, for the first
``logit_check_samples`` requests, the logit check: their last layer, normed and
projected, must reproduce vLLM's own prompt logprobs. While a checked request
that was already taken is not judged yet, every sample that finishes is held
back, so nothing that finished beside a failing check is published (a client
asking one sample at a time is never held: its checked request comes first). The
publishers refuse a sample with NaN/Inf states (its client is told; a sample the
GPU proved finite as it left the device is not tested again), then publish it
(:class:`~speculators_v016.serve.folder.ServeDir`, or the Mooncake store:
:class:`~speculators_v016.serve.mooncake.MooncakeBackend`) and its future answered with
the handle. Bounded everywhere: at most ``max_pending`` requests are taken at once
(more wait in :meth:`submit`), the publisher queue is short, and the folder caps
the bytes not yet taken.

If the engine fails, every pending request fails with the reason and so does
every later one (:attr:`failure`): the service does not pretend to serve.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from loguru import logger

from speculators_v016.checks.finite import non_finite
from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.checks.self_check import SelfCheckError, check_logits, check_plausible
from speculators_v016.checks.zero_embeddings import zero_embedding_ids
from speculators_v016.config import ServeConfig
from speculators_v016.generator import VllmHiddenStatesGenerator
from speculators_v016.layers import LayerPlan
from speculators_v016.run.console import private_dir
from speculators_v016.run.prepared import PreparedSamples
from speculators_v016.serve.folder import ServeDir, ServeDirError
from speculators_v016.serve.mooncake import MooncakeBackend
from speculators_v016.store.sample_format import encode_parts, safetensors_parts
from speculators_v016.target import PromptError, TargetInfo, check_token_ids

REAP_INTERVAL = 1.0  # seconds between looks for what dead consumers left
MAX_REQUEST_IDS = 4096  # request ids remembered (a retry comes within seconds; the oldest are forgotten)
#: Samples screened out in a row (states no model produces, none passing between them) that stop the service: a
#: broken capture breaks every sample after it, so it stops within this many; one request, or a client's few
#: concurrent ones, never does (each is refused: its client told, the others served). A failed logit check stops it
#: at once.
SCREENED_IN_A_ROW = 3


class RequestError(ValueError):
    """A request that cannot be served as sent (the message names what is wrong); the service goes on."""


class ServiceStopped(RuntimeError):
    """The service stopped (asked to, or its engine failed: the message says which)."""


#: How a published file holds a sample: ``sample`` is a run's sample file (our format, what
#: OnlineSampleDataset reads); ``stacked`` is what upstream 0.9.0's ``FileTransfer`` reads (the
#: peer protocol, :mod:`speculators_v016.serve.peer_api`): ``hidden_states`` ``[T, layers, hidden]``
#: in capture order and ``token_ids`` ``[T]``.
LAYOUTS = ("sample", "stacked")


@dataclass
class Request:
    key: int
    ids: list[int]
    mask: list[int]
    consumer: dict | None
    layout: str = "sample"
    future: Future = field(default_factory=Future)


@dataclass
class ServiceStats:
    requests: int = 0
    served: int = 0
    tokens: int = 0
    bytes: int = 0
    refused: int = 0
    screened: int = 0  # refused: their states hold rows no model produces
    finite_proven: int = 0  # not NaN/Inf-tested by the publishers: the device proved their states finite
    finite_tested: int = 0  # NaN/Inf-tested by the publishers (the refused ones too)
    started: float = field(default_factory=time.monotonic)


class CaptureService:
    """The capture engine behind a queue: :meth:`submit` a sample, get a future of its published handle."""

    def __init__(self, config: ServeConfig, samples: PreparedSamples | None = None):
        self.config = config
        self.samples = samples
        self.target = TargetInfo.read(config.engine.model, config.engine.trust_remote_code)
        self.plan = LayerPlan.build(self.target.num_layers, config.layer_ids)
        if config.backend == "folder":
            self.backend = ServeDir(config.serve_dir, config.max_published_bytes, config.lease_seconds)
        else:
            self.backend = MooncakeBackend(config.mooncake_master, config.host, config.max_published_bytes,
                                           config.lease_seconds, log_dir=private_dir())  # fmt: skip
        self.stats = ServiceStats()
        self._counting = threading.Lock()  # the publishers' counters: several threads add to them
        self.zero_ids = zero_embedding_ids(config.engine.model, self.target.vocab_size) or frozenset()
        self._screened_in_a_row = 0
        self.failure: BaseException | None = None
        self._keys = itertools.count()
        self._key_lock = threading.Lock()
        self._given = 0  # request keys handed out so far
        self._checker, self._checked = None, set()  # the logit check and the request keys it judges
        self._unjudged: set[int] = set()  # checked requests taken and not judged yet
        self._queue: queue.Queue[Request] = queue.Queue()
        self._taken: dict[int, Request] = {}
        self._by_id: OrderedDict[str, Future] = OrderedDict()  # request ids clients gave -> their futures
        self._slots = threading.BoundedSemaphore(config.max_pending)
        self._to_publish: queue.Queue = queue.Queue(maxsize=max(2, config.write_workers))
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.generator: VllmHiddenStatesGenerator | None = None

    # -- start and stop ----------------------------------------------------------------------------
    def start(self) -> CaptureService:
        if self.backend.kind == "folder":
            self.backend.open()  # a folder it cannot use is refused before the engine starts
        try:
            self.generator = VllmHiddenStatesGenerator.from_config(self.config.engine, self.plan)
            self.engine = self.generator.engine
            if self.backend.kind != "folder":
                self.backend.open(self.max_object_bytes())
            self._checker, self._checked = self._logit_check()
            if self._checked:
                self.engine.warm_prompt_logprobs()  # vLLM compiles its prompt-logprobs kernel now, not in a request
        except BaseException:
            if self.generator is not None:
                self.generator.shutdown()
            self.backend.close()
            raise
        self._spawn(self._engine_loop, "engine")
        for i in range(self.config.write_workers):
            self._spawn(self._publisher, f"publisher-{i}")
        self._spawn(self._reaper, "reaper")
        return self

    def max_object_bytes(self) -> int:
        """The largest object a sample can make: ``seq_length`` rows of every layer, ids, mask, a header."""
        model_config = self.engine.core.vllm_config.model_config
        hidden, layers = model_config.get_hidden_size(), len(self.plan.layer_ids)
        element = 1 if self.config.engine.fp8 else model_config.dtype.itemsize
        per_token = layers * (hidden * element + (4 if self.config.engine.fp8 else 0)) + 16
        return self.config.seq_length * per_token + (64 << 10)

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=f"serve-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        """Stop taking requests, fail those not yet answered, stop the engine; published files stay."""
        self._stopping.set()
        self._fail_all(ServiceStopped("the service is stopping"))
        for _ in range(self.config.write_workers):
            try:
                self._to_publish.put_nowait(None)
            except queue.Full:
                pass
        for thread in self._threads:
            thread.join(timeout=30)
        if self.generator is not None:
            self.generator.shutdown()
        self.backend.close()

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name or self.config.engine.model

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- requests --------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def sample_of(self, index) -> tuple[list[int], list[int]]:
        """Sample ``index`` of the service's dataset (``--train-data-path``): its ids and loss mask."""
        if self.samples is None:
            raise RequestError("this service has no dataset (--train-data-path): send input_ids and loss_mask")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.samples):
            raise RequestError(f"sample index {index!r} is not in [0, {len(self.samples)})")
        return self.samples.input_ids[index], self.samples.loss_masks[index]

    def check(self, ids, mask) -> tuple[list[int], list[int]]:
        """A request's ids and mask as lists, or RequestError naming what is wrong."""
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids")
        if mask is None:
            mask = [1] * len(ids)
        if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) or m is True for m in mask):
            raise RequestError(f"loss_mask must be a list of {len(ids)} zeros and ones, one per input id")
        if len(ids) > self.config.seq_length:
            raise RequestError(f"{len(ids)} input ids exceed this service's --seq-length {self.config.seq_length}")
        try:
            check_token_ids("request", ids, self.vocab_size)
        except PromptError as exc:
            raise RequestError(str(exc)) from None
        return ids, mask

    def submit(
        self, ids, mask, consumer: dict | None = None, layout: str = "sample", request_id: str | None = None
    ) -> Future:
        """Queue one sample (waits while ``max_pending`` are taken); the future's result is its handle.
        ``request_id``: a call's tries carry one; a try whose id is known gets that request's future."""
        ids, mask = self.check(ids, mask)
        if layout == "stacked" and self.config.engine.fp8:
            raise RequestError(
                "--hidden-states-dtype fp8_e4m3 keeps one scale per token and layer; upstream's FP8 files have one "
                "per token: serve the engine's dtype to its client"
            )
        future = Future()
        if request_id is not None:
            with self._key_lock:
                known = self._by_id.get(request_id)
                if known is not None:
                    return known  # a retry: answered with the first try's handle, never published twice
                self._by_id[request_id] = future
                while len(self._by_id) > MAX_REQUEST_IDS:
                    self._by_id.popitem(last=False)
        try:
            while not self._slots.acquire(timeout=0.1):
                self._raise_if_down()
            try:
                self._raise_if_down()
            except BaseException:
                self._slots.release()
                raise
        except BaseException as exc:
            future.set_exception(exc)  # a retry that joined it is told too
            raise
        with self._key_lock:
            request = Request(next(self._keys), ids, mask, consumer, layout, future)
            self._given = request.key + 1
            if request.key in self._checked:
                self._unjudged.add(request.key)  # later samples wait until it is judged
        request.future.add_done_callback(lambda _: self._slots.release())
        self.stats.requests += 1
        self._queue.put(request)
        if self._stopping.is_set() or self.failure is not None:  # stopped while queueing: not left waiting
            self._fail_all(self.down())
        return request.future

    def release(self, request_id: str | None) -> bool:
        """A client gave up on request ``request_id``: what it published (or will) is deleted unless taken.
        False: no such request is known (never asked, already released, or long forgotten)."""
        if request_id is None:
            raise RequestError("request_id: the id of the request to release is needed")
        with self._key_lock:
            future = self._by_id.pop(request_id, None)
        if future is None:
            return False
        future.add_done_callback(self._release_published)
        return True

    def _release_published(self, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        handle = future.result()
        name = handle.get("file", handle.get("key"))
        if self.backend.release(name):
            logger.info("released {}: its client gave up on it", name)

    def health(self) -> str | None:
        """Why the service cannot serve now (its engine failed, it is stopping, publishing is blocked at the
        cap); None while it serves."""
        if self.failure is not None or self.stopping:
            return str(self.down())
        return self.backend.blocked()

    def down(self) -> ServiceStopped:
        if isinstance(self.failure, ServeDirError):
            return ServiceStopped(f"the service stopped: {self.failure}")
        if self.failure is not None:
            return ServiceStopped(f"the service's engine failed: {type(self.failure).__name__}: {self.failure}")
        return ServiceStopped("the service is stopping")

    def _raise_if_down(self) -> None:
        if self._stopping.is_set() or self.failure is not None:
            raise self.down()

    def _fail_all(self, exc: BaseException) -> None:
        pending = list(self._taken.values())
        while True:
            try:
                pending.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for request in pending:
            if not request.future.done():
                request.future.set_exception(exc)

    # -- the engine --------------------------------------------------------------------------------
    def _feed(self):
        """Queued requests as the engine's feed: None while it has work and nothing is queued; waits when idle."""
        while not self._stopping.is_set():
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                if self.engine.open_requests:
                    yield None
                    continue
                try:
                    request = self._queue.get(timeout=0.1)
                except queue.Empty:
                    continue
            if request.future.done():  # failed while queued (the service stopping)
                continue
            self._taken[request.key] = request
            yield request.key, request.ids

    def _logit_check(self):
        """The service's logit check (its first ``logit_check_samples`` requests), as a run has it."""
        if self.config.logit_check_samples <= 0:
            return None, set()
        checker = LogitChecker(self.config.engine.model, self.engine.dtype, self.plan.last_layer_index)
        return checker, set(range(self.config.logit_check_samples)) if checker.active else set()

    def _engine_loop(self) -> None:
        layer_ids = list(self.plan.layer_ids)
        want = self._checked.__contains__ if self._checked else None
        held: list[tuple] = []  # finished while a checked request, already taken, was not judged yet
        proven: set = set()  # keys whose states the device proved finite (GPU staging): not tested again
        try:
            window = 2 * self.config.engine.max_num_seqs
            stream = self.engine.stream(self._feed(), window=window, prompt_logprobs=want, proven=proven)
            for key, ids, states in stream:
                finite = key in proven
                proven.discard(key)
                request = self._taken.pop(key)
                if ids != request.ids:  # never: submit() keeps prompts within the engine's length
                    request.future.set_exception(RuntimeError(f"the engine changed request {key}'s ids"))
                    self._unjudged.discard(key)
                    continue
                theirs = self.engine.prompt_logprobs.pop(key, None) if key in self._checked else None
                input_ids = torch.tensor(ids, dtype=torch.long)
                try:
                    check_plausible(key, input_ids, states, layer_ids, bool(self._unjudged), self.zero_ids)
                except SelfCheckError as exc:
                    if self._screen_out(request, exc):
                        raise
                else:
                    self._screened_in_a_row = 0
                    try:
                        if theirs is not None:
                            check_logits(self._checker, key, input_ids, states, theirs, len(held))
                    except SelfCheckError as exc:
                        request.future.set_exception(ServiceStopped(f"the service stopped: {exc}"))
                        raise
                    held.append((request, states, finite))
                self._unjudged.discard(key)
                if not self._unjudged:  # nothing taken is still to be judged: publish what waited
                    for item in held:
                        self._hand_to_publishers(item)
                    held.clear()
                    if self._checker is not None and self._checker.active and self._given >= len(self._checked):
                        self._checker.release()
        except BaseException as exc:  # noqa: BLE001 - every request is told, the service stays down
            if not self._stopping.is_set():
                logger.error("the service's engine failed: {}: {}", type(exc).__name__, exc)
                self.failure = exc
            if isinstance(exc, SelfCheckError):
                self._stopping.set()  # states this service captures cannot be trusted: it serves no more
            for request, *_ in held:
                if not request.future.done():
                    request.future.set_exception(self.down())
            self._fail_all(self.down())

    def _screen_out(self, request: Request, exc: SelfCheckError) -> bool:
        """A sample whose states hold rows no model produces: refused (its client told), counted; True when
        :data:`SCREENED_IN_A_ROW` samples in a row were, and the service stops (the capture is broken)."""
        self.stats.screened += 1
        self._screened_in_a_row += 1
        if self._screened_in_a_row >= SCREENED_IN_A_ROW:
            request.future.set_exception(ServiceStopped(f"the service stopped: {exc}"))
            return True
        logger.error(
            "request {} refused, its states hold rows no model produces ({} in a row): {}",
            request.key,
            self._screened_in_a_row,
            exc.finding,
        )
        request.future.set_exception(
            RequestError(
                f"not published: its states hold rows no model produces ({exc.finding}); the service goes on "
                f"({self.stats.screened} samples refused so far, it stops after {SCREENED_IN_A_ROW} in a row)"
            )
        )
        return False

    def _hand_to_publishers(self, item: tuple) -> None:
        request = item[0]
        while True:  # a bounded queue: full publishers hold the engine back
            try:
                self._to_publish.put(item, timeout=0.1)
                return
            except queue.Full:
                if self._stopping.is_set():
                    request.future.set_exception(self.down())
                    return

    def _publisher(self) -> None:
        layer_ids = list(self.plan.layer_ids)
        while True:
            item = self._to_publish.get()
            if item is None:
                return
            request, states, finite = item
            try:
                request.future.set_result(self._publish(request, states, layer_ids, finite))
            except BaseException as exc:  # noqa: BLE001 - told to the one who asked
                with self._counting:
                    self.stats.refused += 1
                if not request.future.done():
                    request.future.set_exception(exc)

    def _publish(self, request: Request, states: list, layer_ids: list[int], finite: bool = False) -> dict:
        """``finite``: the device proved every state finite (``StepCapture.finite``); else they are tested here."""
        input_ids = torch.tensor(request.ids, dtype=torch.long)
        bad = [] if finite else non_finite(states)
        with self._counting:
            self.stats.finite_proven += finite
            self.stats.finite_tested += not finite
        if bad:
            raise RequestError(f"NaN/Inf hidden states in layers {[layer_ids[j] for j in bad]}: not published")
        if request.layout == "stacked":
            stacked = {"hidden_states": torch.stack(states, dim=1), "token_ids": input_ids}
            parts = safetensors_parts(stacked, {"format": "pt", "layer_ids": json.dumps(layer_ids)})
        else:
            sample = {"input_ids": input_ids, "loss_mask": torch.tensor(request.mask, dtype=torch.long)}
            parts = encode_parts({**sample, "hidden_states": states}, "safetensors", layer_ids)
        nbytes = sum(memoryview(p).nbytes for p in parts)
        self.backend.reserve(nbytes, self._stopping)
        handle = self.backend.publish(parts, nbytes, request.consumer)
        handle["num_tokens"] = len(request.ids)
        with self._counting:
            self.stats.served += 1
            self.stats.tokens += len(request.ids)
            self.stats.bytes += nbytes
        return handle

    def _reaper(self) -> None:
        while not self._stopping.wait(REAP_INTERVAL):
            for name, why in self.backend.reap():
                logger.warning("reclaimed {}: {}", name, why)
            try:
                if self.backend.check_lock() == "restored":
                    logger.warning("the serve folder's lock file was deleted while this service held it: made again")
            except ServeDirError as exc:  # another service may use the folder: this one publishes no more
                logger.error("{}", exc)
                self.failure = exc
                self._stopping.set()
                self._fail_all(self.down())
                return

    # -- what clients read of it -------------------------------------------------------------------
    def info(self) -> dict:
        model_config = self.engine.core.vllm_config.model_config
        return {
            "service": "speculators-v016",
            "model": self.config.engine.model,
            "layer_ids": list(self.plan.layer_ids),
            "vllm_aux_ids": list(self.plan.vllm_ids),
            "dtype": str(model_config.dtype).removeprefix("torch."),
            "hidden_states_dtype": self.config.engine.hidden_states_dtype,
            "hidden_size": model_config.get_hidden_size(),
            "seq_length": self.config.seq_length,
            "format": "safetensors",
            "backend": self.backend.describe(),
            "num_samples": None if self.samples is None else len(self.samples),
            "lengths": None if self.samples is None else [len(ids) for ids in self.samples.input_ids],
            "requests": self.stats.requests,
            "served": self.stats.served,
            "screened": self.stats.screened,
            "finite_proven": self.stats.finite_proven,
            "finite_tested": self.stats.finite_tested,
            "published_not_taken_bytes": self.backend.not_taken(),
            "publishing_waiting_seconds": round(self.backend.waiting_seconds(), 1),
            "max_published_bytes": self.config.max_published_bytes,
            "reclaimed": vars(self.backend.reclaimed),
            "logit_check": self._checker.result.line() if self._checker is not None else "off",
            "failure": None if self.failure is None else f"{type(self.failure).__name__}: {self.failure}",
        }
