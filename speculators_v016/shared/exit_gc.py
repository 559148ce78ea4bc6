"""What a process of ours skips at exit: Python's last garbage collections over what it made.

At exit, after its exit handlers, Python collects garbage once more and again as it clears its modules. In a
process that imported vLLM, torch and transformers and ran an engine, those passes walk every object the process
made, for 2-3 s of CPU on a 2-core host (2026-12-08, the command's small CPU runs: 0.45 s from the summary to the
process's end with this, 2.5-3 s without), and find nothing that matters: every file is closed and made durable
before the command's summary, shared memory and processes are released explicitly, and ``weakref.finalize``
callbacks run at exit anyway. A process forked from a warm interpreter (the CLI tests) walks and copies what it
inherited too.

:func:`freeze_at_exit` registers :func:`gc.freeze` to run at exit: the objects alive then, and the garbage not yet
collected, move to the collector's permanent generation, which those passes skip. Only for processes that are ours
from start to end: the command's (``run/cli.py``) and vLLM's worker processes under our engine (a library user's
process keeps Python's own exit).
"""

from __future__ import annotations

import atexit
import gc


def freeze_at_exit() -> None:
    """At exit, once the exit handlers registered after this call have run, freeze what the process holds."""
    atexit.register(gc.freeze)
