"""Fault injection for the fault tests, installed from outside the production code.

``python -m speculators_v016.testing.faults <CLI arguments>`` runs the real
``speculators-data-gen`` with one fault armed by ``SPECULATORS_V016_FAULT=name:n``
(act at the ``n``-th, 1-based, pass of the named point). The production
modules carry no fault points: each fault wraps one of their seams here.

* ``kill-mid-write:n`` / ``enospc-write:n``: the ``n``-th sample file is half
  written when the process is SIGKILLed / the write fails with ENOSPC
  (wraps :func:`speculators_v016.store.atomic_files.write_parts`). Before the
  kill, it waits (up to 10 s) until the manifest lists ``n - 1`` samples, so
  with one write worker the files before it are committed, as with no batching.
* ``kill-after-rename:n``: SIGKILL right after the ``n``-th sample file got
  its final name, before its group commit (wraps the writer's ``write_durable``):
  files in place that the manifest does not list yet.
* ``plant-tmp-link:n``: from the ``n``-th sample file on, the temporary name
  the writer is about to create (``.tmp-data_N.safetensors.<pid>``) is found
  taken by a symbolic link to ``$SPECULATORS_V016_FAULT_TARGET/data_N...``, as
  if someone with write access to the folder planted it while the run wrote
  (wraps the writer's ``write_durable``): a run must never write through it.
* ``kill-before-manifest:n``: SIGKILL after the ``n``-th file is in place and
  before its manifest line; the lines before it in its batch are written
  first (wraps :meth:`Manifest.append`).
* ``kill-mid-commit:n``: SIGKILL in the middle of the ``n``-th group commit's
  manifest write, leaving half of its text (a torn last line).
* ``kill-after-commit:n``: SIGKILL right after the ``n``-th group commit
  (folder and manifest fsynced).
* ``nan-sample:n``: the ``n``-th sample the engine yields, among those the logit
  check does not judge, gets a NaN in its last layer (wraps :meth:`CaptureEngine.stream`).
* ``shift-check:n``: the ``n``-th logit-checked sample's last layer is shifted
  by one position (wraps :meth:`LogitChecker.add`).
* ``ring-vanish:n`` / ``ring-replace:n``: the ``n``-th shared capture ring's
  ``/dev/shm`` name is deleted (by a cleaner, say) / deleted and re-created as
  another file of the same size, after the engine made it and before the worker
  maps it (wraps :meth:`SlotRing.create`).
* ``zero-states:n``: from the ``n``-th sample the engine yields on, every
  hidden state is 0, as when the capture ring was replaced by an empty file
  (wraps :meth:`CaptureEngine.stream`).
* ``zero-sample:n``: the ``n``-th sample the engine yields (its warm-up prompts not
  counted), and only it, has every hidden state 0 (a capture that failed once; wraps
  :meth:`CaptureEngine.stream`).
* ``pace:n``: the engine yields a sample at most every ``n`` milliseconds (a slow
  target: the run is still mid-way when a test's outside SIGKILL lands, however
  fast the machine; wraps :meth:`CaptureEngine.stream`). Not a pass count.
* ``wrong-layer:n``: from the ``n``-th sample on, the middle captured layer
  holds the layer captured before it, as if its tap read the wrong layer
  (wraps :meth:`CaptureEngine.stream`).
* ``done-raises:n``: from the ``n``-th sample whose file is written on, the
  memory handed back is refused by the buffer pool (the ``done`` callback
  raises on a writer thread, as with layer tensors that did not come from the
  pool; wraps :meth:`BufferPool.give_back`).
* ``half-zero-rows:n``: from the ``n``-th sample the engine yields on, the
  first captured layer's second half of rows is 0 (a copy that stopped half
  way; wraps :meth:`CaptureEngine.stream`).
* ``wrong-layer-check:n``: the ``n``-th logit-checked sample's last layer is
  replaced by the captured layer before it (wraps :meth:`LogitChecker.add`).
* ``stage-boundary-late`` (a vLLM worker's fault): under pipeline parallelism every
  stage after the first stores, in the row of its first captured layer, the
  layer after it (the boundary id one layer late, as when a stage counts its
  ids from its own first layer), after the start-up proof (wraps the worker's
  ``Capture._aux``).
* ``execute-model-fails:n`` (a vLLM worker's fault, in-process with the uniprocess executor): the
  ``n``-th call of the model runner's ``execute_model`` with scheduled tokens raises, as a kernel that fails inside the
  forward does (wraps vLLM's ``GPUModelRunner.execute_model``, which the CPU runner inherits).
* ``nan-step:n`` (a vLLM worker's fault, in-process with the uniprocess executor): the ``n``-th step the
  capture takes gets a NaN in the first row of every captured layer before it is copied out, as when the forward
  produced one (wraps the worker's ``Capture._aux``): on a GPU's staged path the device's NaN/Inf proof fails
  and the writers test the sample's bytes.
* ``vllm-prompt-rows`` (a vLLM worker's fault): the workaround of vLLM 0.16's
  lost prompt rows (PP, async scheduling, chunked prefill) is not installed
  (replaces :func:`speculators_v016.worker.pipeline_stage.keep_prompt_rows`
  where the capture set-up calls it), so vLLM's own behaviour shows.

Beside any fault, ``SPECULATORS_V016_GPU_POOL=1`` gives the CPU engine's run a GPU engine's buffer pool: every
sample in its shared blocks, none in fresh memory (wraps :class:`BufferPool`'s constructor: ``fresh_below`` 0), so
the write helpers (:mod:`speculators_v016.store.write_helper`) write every file, as on a GPU.

A worker's fault reaches vLLM's worker processes because they are spawned: each
imports the driving program's main module, this one, as ``__mp_main__``, and
installs the worker faults (:func:`install_worker`) before it builds its worker.

* ``fork-workers``: vLLM chooses its workers' start method alone, as before GPU
  workers were always spawned (:mod:`speculators_v016.engine.worker_start`;
  replaces the engine's ``set_start_method``): on GPUs it forks them.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from collections import Counter
from importlib.metadata import entry_points
from pathlib import Path

import torch

from speculators_v016.checks.logit_check import LogitChecker
from speculators_v016.engine import core as engine_core
from speculators_v016.engine.buffer_pool import BufferPool
from speculators_v016.engine.core import CaptureEngine
from speculators_v016.fp8 import Fp8States
from speculators_v016.shared.slot_ring import SlotRing, file_bytes
from speculators_v016.store import atomic_files, writer
from speculators_v016.store.manifest import Manifest
from speculators_v016.store.sample_format import parse_sample_name

VARIABLE = "SPECULATORS_V016_FAULT"
GPU_POOL = "SPECULATORS_V016_GPU_POOL"  # "1": every sample in the pool's shared blocks, as on a GPU engine
TARGET = "SPECULATORS_V016_FAULT_TARGET"  # the folder a planted link points into (plant-tmp-link)
COMMAND = "speculators-data-gen"
_passed: Counter = Counter()
_lock = threading.Lock()  # writer threads pass points concurrently


def _armed(name: str) -> bool:
    """Is this pass of point ``name`` the one to act on?"""
    point, _, count = os.environ.get(VARIABLE, "").partition(":")
    if point != name:
        return False
    with _lock:
        _passed[name] += 1
        return _passed[name] == int(count or 1)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_entries(directory: str, count: int, timeout: float = 10.0) -> None:
    """Wait until the manifest in ``directory`` lists ``count`` samples (group commits run on their own thread)."""
    deadline = time.monotonic() + timeout
    while len(Manifest(Path(directory)).entries()) < count and time.monotonic() < deadline:
        time.sleep(0.02)


def install() -> None:
    """Wrap the seams that the armed fault needs (nothing when the variable is unset), and the pool's with
    ``SPECULATORS_V016_GPU_POOL=1``."""
    if os.environ.get(GPU_POOL) == "1":
        original_init = BufferPool.__init__

        def init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self.fresh_below = 0  # as a GPU engine's: no sample in fresh memory

        BufferPool.__init__ = init
    point = os.environ.get(VARIABLE, "").partition(":")[0]
    if point in ("kill-mid-write", "enospc-write"):
        original_parts = atomic_files.write_parts

        def write_parts(fh, parts, digest, scans=None, sink=None):
            final = os.path.basename(fh.name).removeprefix(atomic_files.TMP_PREFIX).rpartition(".")[0]
            if parse_sample_name(final) is None:
                return original_parts(fh, parts, digest, scans, sink)  # only sample files count (not data_config.json)
            views = [memoryview(p).cast("B") for p in parts]
            scans = list(scans) if scans is not None else [None] * len(views)
            if len(views) == 1:  # split a single buffer so the fault lands mid-file
                half = len(views[0]) // 2
                views, scans = [views[0][:half], views[0][half:]], scans * 2
            first = (len(views) + 1) // 2
            size = original_parts(fh, views[:first], digest, scans[:first], sink)
            if _armed(point):
                fh.flush()
                if sink is not None:
                    sink.flush()  # a direct write queues its blocks until the file's end: half of them go out now
                if point == "kill-mid-write":
                    _wait_for_entries(os.path.dirname(fh.name), _passed[point] - 1)
                    _kill()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), fh.name)
            return size + original_parts(fh, views[first:], digest, scans[first:], sink)

        atomic_files.write_parts = write_parts
    elif point == "kill-after-rename":
        original_durable = writer.write_durable

        def write_durable(directory, name, parts, **options):
            result = original_durable(directory, name, parts, **options)
            if _armed(point):
                _kill()
            return result

        writer.write_durable = write_durable
    elif point == "plant-tmp-link":
        original_durable = writer.write_durable
        planting = []

        def write_durable(directory, name, parts, **options):
            if planting or _armed(point):
                planting.append(name)
                tmp = Path(directory) / f"{atomic_files.TMP_PREFIX}{name}.{os.getpid()}"
                tmp.symlink_to(Path(os.environ[TARGET]) / name)
            return original_durable(directory, name, parts, **options)

        writer.write_durable = write_durable
    elif point in ("kill-before-manifest", "kill-mid-commit", "kill-after-commit"):
        original_append = Manifest.append

        def append(self, *entries):
            if point == "kill-before-manifest":
                for i in range(len(entries)):
                    if _armed(point):  # one pass per sample: the lines before it, then the kill
                        if i:
                            original_append(self, *entries[:i])
                        _kill()
                return original_append(self, *entries)
            if point == "kill-mid-commit" and _armed(point):
                text = "".join(e.line() for e in entries)  # the lines the manifest writes
                cut = len(text) // 2 + (text[len(text) // 2 - 1] == "\n")  # inside a line: a torn one
                with self.path.open("a") as fh:
                    fh.write(text[:cut])
                    fh.flush()
                _kill()
            original_append(self, *entries)
            if point == "kill-after-commit" and _armed(point):
                _kill()

        Manifest.append = append
    elif point == "nan-sample":
        original_stream = CaptureEngine.stream

        def stream(self, *args, **kwargs):
            checked = kwargs.get("prompt_logprobs") or (lambda key: False)
            proven = kwargs.get("proven")
            for key, ids, states in original_stream(self, *args, **kwargs):
                if not checked(key) and _armed(point):
                    if proven is not None:  # changed after the device: its NaN/Inf proof no longer holds
                        proven.discard(key)
                    last = states[-1]
                    if isinstance(last, Fp8States):  # a NaN row quantizes to a NaN scale
                        last.scales[len(ids) // 2] = float("nan")
                    else:
                        last[len(ids) // 2, 0] = float("nan")
                yield key, ids, states

        CaptureEngine.stream = stream
    elif point in ("zero-states", "zero-sample"):
        original_stream = CaptureEngine.stream
        zeroing = []

        def stream(self, *args, **kwargs):
            for key, ids, states in original_stream(self, *args, **kwargs):
                warm_up = isinstance(key, tuple) and key[:1] == ("warm-up",)  # not a request of the service's
                if (zeroing and point == "zero-states") or (not (warm_up and point == "zero-sample") and _armed(point)):
                    zeroing.append(key)
                    states = [
                        Fp8States(torch.zeros_like(h.codes), torch.ones_like(h.scales))
                        if isinstance(h, Fp8States)
                        else torch.zeros_like(h)
                        for h in states
                    ]
                yield key, ids, states

        CaptureEngine.stream = stream
    elif point == "pace":
        original_stream = CaptureEngine.stream
        pause = int(os.environ[VARIABLE].partition(":")[2] or 100) / 1000

        def stream(self, *args, **kwargs):
            for item in original_stream(self, *args, **kwargs):
                time.sleep(pause)
                yield item

        CaptureEngine.stream = stream
    elif point == "wrong-layer":
        original_stream = CaptureEngine.stream
        armed = []

        def stream(self, *args, **kwargs):
            for key, ids, states in original_stream(self, *args, **kwargs):
                if armed or _armed(point):
                    armed.append(key)
                    middle = len(states) // 2
                    before = states[middle - 1]
                    states[middle] = (
                        Fp8States(before.codes.clone(), before.scales.clone())
                        if isinstance(before, Fp8States)
                        else before.clone()
                    )
                yield key, ids, states

        CaptureEngine.stream = stream
    elif point == "done-raises":
        original_give_back = BufferPool.give_back
        refusing = []

        def give_back(self, tensors):
            if refusing or _armed(point):
                refusing.append(True)
                raise RuntimeError("these tensors were not taken from this pool, or were given back twice")
            return original_give_back(self, tensors)

        BufferPool.give_back = give_back
    elif point == "half-zero-rows":
        original_stream = CaptureEngine.stream
        armed = []

        def stream(self, *args, **kwargs):
            for key, ids, states in original_stream(self, *args, **kwargs):
                if armed or _armed(point):
                    armed.append(key)
                    first = states[0]
                    half = len(ids) // 2
                    if isinstance(first, Fp8States):  # a zero row: codes 0 under scale 1, as the quantizer makes
                        first.codes[half:] = 0
                        first.scales[half:] = 1.0
                    else:
                        first[half:] = 0
                yield key, ids, states

        CaptureEngine.stream = stream
    elif point in ("shift-check", "wrong-layer-check"):
        original_add = LogitChecker.add

        def add(self, key, input_ids, states, vllm_logprobs):
            if _armed(point):
                states = list(states)
                last = states[self.last]
                if point == "wrong-layer-check":
                    states[self.last] = states[self.last - 1]
                elif isinstance(last, Fp8States):
                    states[self.last] = Fp8States(torch.roll(last.codes, 1, 0), torch.roll(last.scales, 1, 0))
                else:
                    states[self.last] = torch.roll(last, 1, 0)
            return original_add(self, key, input_ids, states, vllm_logprobs)

        LogitChecker.add = add
    elif point in ("ring-vanish", "ring-replace"):
        original_create = SlotRing.create.__func__

        def create(cls, **kwargs):
            ring = original_create(cls, **kwargs)
            if ring.spec.shared and _armed(point):
                os.unlink(ring.spec.path)
                if point == "ring-replace":
                    with open(ring.spec.path, "xb") as fh:
                        fh.truncate(file_bytes(ring.spec))
            return ring

        SlotRing.create = classmethod(create)
    elif point == "fork-workers":
        engine_core.set_start_method = lambda device_type, executor_kind: None
    elif point in ("execute-model-fails", "nan-step"):  # the uniprocess executor's worker is this process
        install_worker()
    elif point and point not in WORKER_FAULTS:
        raise SystemExit(f"{VARIABLE}={os.environ[VARIABLE]}: unknown fault point {point!r}")


WORKER_FAULTS = ("stage-boundary-late", "vllm-prompt-rows", "execute-model-fails", "nan-step")
#: What the planted execute_model failure says.
PLANTED_FAILURE = "planted: a kernel failed inside the forward"


def install_worker() -> None:
    """In a vLLM worker process of a faulty run: wrap the worker seams the armed fault needs."""
    point = os.environ.get(VARIABLE, "").partition(":")[0]
    if point not in WORKER_FAULTS:
        return
    from speculators_v016.worker import capture  # noqa: PLC0415 - worker code only in workers

    if point == "stage-boundary-late":
        original_aux = capture.Capture._aux

        def late_aux(self, runner, step):
            aux = list(original_aux(self, runner, step))
            if self.stage is not None and self.stage.rank > 0 and len(aux) > 1:
                aux[0] = aux[1]
            return aux

        capture.Capture._aux = late_aux
    elif point == "nan-step":
        original_aux = capture.Capture._aux

        def nan_aux(self, runner, step):
            aux = original_aux(self, runner, step)
            if self.is_output and _armed(point):
                with torch.inference_mode():  # vLLM's tensors: changed in place where vLLM made them
                    for layer in aux:  # every captured layer: the stored ones are among them
                        layer[0, 0] = float("nan")
            return aux

        capture.Capture._aux = nan_aux
    elif point == "vllm-prompt-rows":
        capture.keep_prompt_rows = lambda runner: None
    elif point == "execute-model-fails":
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: PLC0415 - vLLM only in a faulty run

        original_execute = GPUModelRunner.execute_model

        def execute_model(self, scheduler_output, *args, **kwargs):
            if scheduler_output.total_num_scheduled_tokens and _armed(point):
                raise RuntimeError(PLANTED_FAILURE)
            return original_execute(self, scheduler_output, *args, **kwargs)

        GPUModelRunner.execute_model = execute_model


def main() -> None:
    """Arm the fault, then run the installed ``speculators-data-gen`` command (its console-script entry point).

    The kit reaches the command as a user does, through the distribution's entry point, never by
    importing the CLI module: the test kit sits below the run and does not name its modules.
    """
    install()
    (command,) = entry_points(group="console_scripts", name=COMMAND)
    sys.argv[0] = COMMAND
    command.load()()


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # a vLLM worker process spawned by a faulty run (see the module's doc)
    install_worker()
