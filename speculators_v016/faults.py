"""Named fault points for the fault-injection tests (inactive unless the variable is set).

``SPECULATORS_V016_FAULT=name:n`` makes :func:`hit` act at the ``n``-th
(1-based) time the named point is passed in this process: ``kill`` points
SIGKILL the process (as a crash or an out-of-memory kill would), ``raise``
points raise the error a failing disk gives. Unset (always, outside tests),
a point costs one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter

VARIABLE = "SPECULATORS_V016_FAULT"
_passed: Counter = Counter()


def _armed(name: str) -> bool:
    spec = os.environ.get(VARIABLE)
    if not spec:
        return False
    point, _, count = spec.partition(":")
    if point != name:
        return False
    _passed[name] += 1
    return _passed[name] == int(count or 1)


def hit(name: str, path: str = "") -> None:
    """Pass fault point ``name`` (``kill-*`` kills the process, ``enospc-*`` fails the write)."""
    if not _armed(name):
        return
    if name.startswith("kill-"):
        os.kill(os.getpid(), signal.SIGKILL)
    if name.startswith("enospc-"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def armed_value(name: str) -> bool:
    """For data faults (e.g. ``nan-sample``): is this the pass to corrupt?"""
    return _armed(name)
