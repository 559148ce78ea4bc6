"""Fault injection for the fault tests, installed from outside the production code.

``python -m speculators_v016.testing.faults <CLI arguments>`` runs the real
``speculators-data-gen`` with one fault armed by ``SPECULATORS_V016_FAULT=name:n``
(act at the ``n``-th, 1-based, pass of the named point). The production
modules carry no fault points: each fault wraps one of their seams here.

* ``kill-mid-write:n`` / ``enospc-write:n``: the ``n``-th sample file is half
  written when the process is SIGKILLed / the write fails with ENOSPC
  (wraps :func:`speculators_v016.store.atomic_files.write_parts`).
* ``kill-before-manifest:n``: SIGKILL after the ``n``-th file is in place and
  before its manifest line (wraps :meth:`Manifest.append`).
* ``nan-sample:n``: the ``n``-th sample the engine yields, among those the logit
  check does not judge, gets a NaN in its last layer (wraps :meth:`CaptureEngine.stream`).
* ``shift-check:n``: the ``n``-th logit-checked sample's last layer is shifted
  by one position (wraps :meth:`LogitChecker.add`).
* ``ring-vanish:n`` / ``ring-replace:n``: the ``n``-th shared capture ring's
  ``/dev/shm`` name is deleted (by a cleaner, say) / deleted and re-created as
  another file of the same size, after the engine made it and before the worker
  maps it (wraps :meth:`SlotRing.create`).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections import Counter

import torch

VARIABLE = "SPECULATORS_V016_FAULT"
_passed: Counter = Counter()


def _armed(name: str) -> bool:
    """Is this pass of point ``name`` the one to act on?"""
    point, _, count = os.environ.get(VARIABLE, "").partition(":")
    if point != name:
        return False
    _passed[name] += 1
    return _passed[name] == int(count or 1)


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install() -> None:
    """Wrap the seams that the armed fault needs (nothing when the variable is unset)."""
    point = os.environ.get(VARIABLE, "").partition(":")[0]
    if point in ("kill-mid-write", "enospc-write"):
        from speculators_v016.store import atomic_files
        from speculators_v016.store.sample_format import parse_sample_name

        original_parts = atomic_files.write_parts

        def write_parts(fh, parts, digest):
            final = os.path.basename(fh.name).removeprefix(atomic_files.TMP_PREFIX).rpartition(".")[0]
            if parse_sample_name(final) is None:
                return original_parts(fh, parts, digest)  # only sample files count (not data_config.json)
            views = [memoryview(p).cast("B") for p in parts]
            if len(views) == 1:  # split a single buffer so the fault lands mid-file
                half = len(views[0]) // 2
                views = [views[0][:half], views[0][half:]]
            first = (len(views) + 1) // 2
            size = original_parts(fh, views[:first], digest)
            if _armed(point):
                fh.flush()
                if point == "kill-mid-write":
                    _kill()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), fh.name)
            return size + original_parts(fh, views[first:], digest)

        atomic_files.write_parts = write_parts
    elif point == "kill-before-manifest":
        from speculators_v016.store.manifest import Manifest

        original_append = Manifest.append

        def append(self, *args, **kwargs):
            if _armed(point):
                _kill()
            return original_append(self, *args, **kwargs)

        Manifest.append = append
    elif point == "nan-sample":
        from speculators_v016.engine.core import CaptureEngine

        original_stream = CaptureEngine.stream

        def stream(self, *args, **kwargs):
            checked = kwargs.get("prompt_logprobs") or (lambda key: False)
            for key, ids, states in original_stream(self, *args, **kwargs):
                if not checked(key) and _armed(point):
                    states[-1][len(ids) // 2, 0] = float("nan")
                yield key, ids, states

        CaptureEngine.stream = stream
    elif point == "shift-check":
        from speculators_v016.run.logit_check import LogitChecker

        original_add = LogitChecker.add

        def add(self, key, input_ids, states, vllm_logprobs):
            if _armed(point):
                states = list(states)
                states[self.last] = torch.roll(states[self.last], 1, 0)
            return original_add(self, key, input_ids, states, vllm_logprobs)

        LogitChecker.add = add
    elif point in ("ring-vanish", "ring-replace"):
        from speculators_v016.engine.slot_ring import SlotRing, file_bytes

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
    elif point:
        raise SystemExit(f"{VARIABLE}={os.environ[VARIABLE]}: unknown fault point {point!r}")


def main() -> None:
    install()
    from speculators_v016.run.cli import main as cli_main

    sys.argv[0] = "speculators-data-gen"
    cli_main()


if __name__ == "__main__":
    main()
