"""Helpers of the shared-memory tests: a private stand-in for /dev/shm, a recorded run, a holder."""

import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A run of ours, in a process of its own: it records, creates its segments as vLLM and glibc do, and waits.
RUN = """
import mmap, os, sys, time
from speculators_v016.shared.shm_records import RunRecord
shm = sys.argv[1]
record = RunRecord.open(shm)
keep = []
def segment(name, size=8192):
    fd = os.open(os.path.join(shm, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    keep.append(mmap.mmap(fd, size))
    return fd
os.close(segment("psm_run0001"))         # a message queue: created and mapped
segment("ring-run0001")                  # held by a descriptor only
tmp = os.path.join(shm, "sem.Xrun0001")  # glibc's sem_open: a temporary name, mapped,
fd = segment("sem.Xrun0001")             # linked to the final name, the temporary removed
os.link(tmp, os.path.join(shm, "sem.mp-run0001"))
os.unlink(tmp)
os.close(fd)
record.refresh()
print("ready", record.run, flush=True)
time.sleep(600)
"""

#: What RUN records.
RECORDED = {"psm_run0001", "ring-run0001", "sem.mp-run0001"}

# A process that only maps a file (another program's, or a dead run's straggler).
HOLD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, os.fstat(fd).st_size)
os.close(fd)
print("ready", flush=True)
time.sleep(600)
"""


@contextmanager
def private_shm():
    """A private tmpfs folder standing in for /dev/shm (removed afterwards)."""
    where = tempfile.mkdtemp(prefix="speculators-test-shm-", dir="/dev/shm")
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def start(code: str, *args, prefix=()) -> tuple[subprocess.Popen, list[str]]:
    """Run a helper script; return it once it printed ``ready`` (and the rest of that line)."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    line = proc.stdout.readline().split()
    assert line and line[0] == "ready", f"helper did not start: {line}"
    return proc, line[1:]


def kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def make(shm: str, name: str, size: int = 4096) -> Path:
    path = Path(shm) / name
    path.write_bytes(b"\0" * size)
    return path
