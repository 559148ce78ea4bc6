"""Shared memory of our runs: recorded while a run lives, reclaimed by record once it is dead.

A SIGKILLed run (a preempted cluster job) cannot clean up: what vLLM's
multiprocess executor and Python's multiprocessing create in ``/dev/shm``
(``psm_*`` message queues, ``sem.mp-*`` semaphores) and our capture ring (if
killed before the worker mapped it) stay until reboot. Nothing is deleted by
a name pattern or by "no process seems to use it": a name proves nothing
(``psm_`` is every Python ``SharedMemory``), and a process list proves
nothing either (containers sharing ``/dev/shm`` see none of each other's
processes; glibc maps a semaphore under a temporary name).

Instead each run that uses shared memory keeps a **record** in a private
folder of the user, ``/dev/shm/speculators-v016-runs-<uid>/`` (mode 0700,
refused if it is a link, another user's or open to others):

* ``<run>.lock``: held with ``flock`` for the whole life of the run (it
  reaches that name already locked). A lock that can be taken means every
  process of that run is gone, in any PID namespace on the same ``/dev/shm``:
  the kernel drops it with the last descriptor.
* ``<run>.json``: the segments the run owns, each as name, device and inode,
  rewritten atomically: the ring as soon as its file exists, then every
  second while the engine starts, and once more when it is up: every file of
  ``/dev/shm`` (not a link, this user's) whose device and inode one of the
  run's own processes (this process and its descendants) maps or holds open
  (``/proc/<pid>/maps`` and ``/proc/<pid>/fd``), less what they held before
  the engine started. Device and inode catch glibc's semaphores, mapped
  under a temporary name and renamed, and names reached through another path.

A new run (every engine start, every ``speculators-data-gen`` run, also one
with nothing left to do) takes the lock of each record it finds; for a dead
run it deletes exactly the recorded names that still are the recorded file
(same device and inode, regular, this user's, looked at without following
links, held by no process it can see), then the record. A live run's record,
a name it cannot attribute, a file that changed: all left alone.
``speculators-data-gen clean-shm`` lists the same (and deletes with ``--yes``).

What a SIGKILLed run can still leave: a segment created after its last record
update and before the kill (vLLM creates its segments during engine start,
recorded within a second; none later), the ring if killed within the
microseconds between its creation and its record, and everything of a run
whose records folder was unusable (a warning says so). Those names are in
no record: remove them by hand once you know they are yours (``ls -l
/dev/shm``; reboot clears ``/dev/shm``).

The folder lies in ``/dev/shm`` itself, not under ``$XDG_RUNTIME_DIR``: the
records then share the segments' filesystem, lifetime (a reboot or systemd's
``RemoveIPC`` clears both) and visibility (containers started with
``--ipc=host`` see the same records as the same segments, and the same
``flock``), while ``$XDG_RUNTIME_DIR`` is per login, absent in batch jobs and
containers, and would outlive or miss the segments it names.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from loguru import logger

from speculators_v016.protocol import SHM_DIR

RECORDS_PREFIX = "speculators-v016-runs-"
FORMAT = 1
#: Seconds between record updates while an engine starts (vLLM creates its segments then).
WATCH_INTERVAL = 1.0
_FILE = re.compile(r"^\.?([0-9]+-[0-9a-f]{12})\.(lock|json)(\.tmp)?$")


class RecordsDirError(OSError):
    """The records folder is not a private folder of this user."""


@dataclass(frozen=True)
class Segment:
    """A file of ``/dev/shm`` a run owns: its name and the identity of the file it had."""

    name: str
    dev: int
    ino: int
    size: int = 0


@dataclass
class SegmentState:
    """What reclaiming does with one recorded segment, and why."""

    name: str
    size: int
    delete: bool
    reason: str
    later: bool = False  # kept because a live process holds it: stays recorded for a later run


@dataclass
class RunState:
    """One record: its run, whether that run is alive, and what happens to its segments."""

    run: str
    alive: bool
    info: dict = field(default_factory=dict)
    segments: list[SegmentState] = field(default_factory=list)

    def describe(self) -> str:
        i = self.info
        who = f"pid {i.get('pid', '?')} on {i.get('host', '?')}, started {i.get('started', '?')}"
        return f"run {self.run} ({who}): {'alive' if self.alive else 'dead'}"


@dataclass
class ReclaimResult:
    runs: list[RunState] = field(default_factory=list)
    problem: str | None = None  # the records folder could not be used

    @property
    def deleted(self) -> list[SegmentState]:
        return [s for r in self.runs if not r.alive for s in r.segments if s.delete]

    @property
    def bytes(self) -> int:
        return sum(s.size for s in self.deleted)


# -- the records folder ---------------------------------------------------------
def records_path(shm_dir: str = SHM_DIR) -> str:
    return os.path.join(shm_dir, f"{RECORDS_PREFIX}{os.getuid()}")


def _open_records_dir(shm_dir: str, create: bool) -> int | None:
    """A descriptor of this user's private records folder (made 0700 if missing); None if absent."""
    path = records_path(shm_dir)
    shm_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if create:
            try:
                os.mkdir(os.path.basename(path), 0o700, dir_fd=shm_fd)
            except FileExistsError:
                pass
        try:
            fd = os.open(
                os.path.basename(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=shm_fd
            )
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise RecordsDirError(f"{path} is not a folder (a link or a file): not ours, not used") from None
            raise
    finally:
        os.close(shm_fd)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_mode & 0o700 != 0o700:
        os.close(fd)
        raise RecordsDirError(
            f"{path} is not a private folder of this user (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}; want uid {os.getuid()}, mode 700): not used"
        )
    return fd


# -- what our processes hold --------------------------------------------------------
def our_processes(root: int | None = None, skip: frozenset[int] = frozenset()) -> list[int]:
    """``root`` (default: this process) and its descendants, from ``/proc/*/stat``; ``skip``: pids whose
    subtrees are left out (children that existed before the engine started: not the engine's)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(c for c in children.get(pid, []) if c not in skip)
    return found


def held_files(pids, dev: int) -> dict[tuple[int, int], int]:
    """(device, inode) of the files on device ``dev`` that these processes map or hold open -> a pid.

    Each process and each descriptor is read on its own: one that vanishes
    mid-scan costs only itself. Unreadable entries are skipped, which here
    only means less is attributed to us (so less is ever deleted).
    """
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}".encode()  # how maps writes a device
    held: dict[tuple[int, int], int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as fh:
                for line in fh:  # address perms offset dev inode [path]
                    parts = line.split(None, 5)
                    if len(parts) >= 5 and parts[3] == want and parts[4] != b"0":
                        held.setdefault((dev, int(parts[4])), pid)
        except OSError:
            pass
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")  # the magic link leads to the open file itself
            except OSError:
                continue
            if st.st_dev == dev:
                held.setdefault((st.st_dev, st.st_ino), pid)
    return held


def _all_processes() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


# -- a live run's record -----------------------------------------------------------------
class RunRecord:
    """This run's record: a held lock, and the segments its processes own (see the module doc)."""

    def __init__(self, shm_dir: str, dir_fd: int, run: str, lock_fd: int):
        self.shm_dir, self.run = shm_dir, run
        self._dir_fd, self._lock_fd = dir_fd, lock_fd
        self._dev = os.stat(shm_dir).st_dev
        self._guard = threading.Lock()
        self._segments: dict[str, Segment] = {}
        self._info = {
            "format": FORMAT,
            "run": run,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        before = our_processes()
        self._skip = frozenset(before) - {os.getpid()}  # processes that are not the engine's (older children)
        self._baseline = set(held_files(before, self._dev))  # held before the engine: not ours
        self._warned = False
        self._write()

    @classmethod
    def open(cls, shm_dir: str = SHM_DIR) -> RunRecord | None:
        """Start this run's record; None (with a warning) if the records folder cannot be used."""
        try:
            dir_fd = _open_records_dir(shm_dir, create=True)
            if dir_fd is None:
                raise RecordsDirError(f"{records_path(shm_dir)} vanished while it was being made")
            try:
                for _ in range(5):
                    run = f"{os.getpid()}-{secrets.token_hex(6)}"
                    lock_fd = _new_lock(dir_fd, run)
                    if lock_fd is None:
                        continue
                    try:
                        return cls(shm_dir, dir_fd, run, lock_fd)
                    except BaseException:
                        for name in _files_of(run):
                            _unlink_quietly(name, dir_fd)
                        os.close(lock_fd)
                        raise
                raise RecordsDirError(f"could not start a record in {records_path(shm_dir)}")
            except BaseException:
                os.close(dir_fd)
                raise
        except OSError as exc:
            logger.warning(
                "the shared memory of this run is not recorded ({}): if it is killed, what it leaves in {} "
                "cannot be reclaimed by a later run",
                exc,
                shm_dir,
            )
            return None

    def add(self, name: str, st: os.stat_result) -> None:
        """Record one file of ours (the ring, as soon as it exists)."""
        with self._guard:
            self._segments[name] = Segment(name, st.st_dev, st.st_ino, st.st_size)
            self._save()

    def refresh(self, warn: bool = True) -> None:
        """Record every file of the folder that our processes hold now and did not hold at the start."""
        try:
            held = set(held_files(our_processes(skip=self._skip), self._dev)) - self._baseline
            found = {}
            if held:
                for name in os.listdir(self.shm_dir):
                    try:
                        st = os.lstat(os.path.join(self.shm_dir, name))
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and (st.st_dev, st.st_ino) in held:
                        found[name] = Segment(name, st.st_dev, st.st_ino, st.st_size)
        except OSError as exc:
            if warn:
                self._warn(exc)
            return
        with self._guard:
            if any(self._segments.get(n) != s for n, s in found.items()):
                self._segments.update(found)
                self._save(warn)

    def _save(self, warn: bool = True) -> None:
        """Write the record; a failure (``/dev/shm`` full) costs only reclaimability, never the run."""
        try:
            self._write()
        except OSError as exc:
            if warn:
                self._warn(exc)

    def _warn(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "the shared-memory record {} could not be updated ({}): if this run is killed, "
                "part of what it leaves in {} cannot be reclaimed",
                self.run,
                exc,
                self.shm_dir,
            )

    @contextmanager
    def watching(self, interval: float = WATCH_INTERVAL) -> Iterator[None]:
        """Refresh every ``interval`` seconds inside the block (an engine start), and once at its end."""
        stop = threading.Event()

        def loop():  # no logging here: vLLM may fork its workers meanwhile
            while not stop.wait(interval):
                self.refresh(warn=False)

        thread = threading.Thread(target=loop, name="speculators-shm-record", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        self.refresh()

    @property
    def segments(self) -> list[Segment]:
        with self._guard:
            return list(self._segments.values())

    def close(self) -> None:
        """The run is over: drop the record, or, if a recorded file still exists, leave it to the next run."""
        if self._lock_fd < 0:
            return
        with self._guard:
            left = [s for s in self._segments.values() if _same_file(self.shm_dir, s)]
            if left:
                self._segments = {s.name: s for s in left}
                self._save()
                logger.debug("shared memory left by this engine, recorded for the next run: {}", [s.name for s in left])
            else:
                for name in _files_of(self.run):
                    _unlink_quietly(name, self._dir_fd)
            os.close(self._lock_fd)  # the lock goes with it
            os.close(self._dir_fd)
            self._lock_fd = -1

    def _write(self) -> None:
        body = {**self._info, "segments": [asdict(s) for s in self._segments.values()]}
        tmp, final = f".{self.run}.json.tmp", f"{self.run}.json"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._dir_fd
        )
        try:
            os.write(fd, json.dumps(body).encode())
        finally:
            os.close(fd)
        os.replace(tmp, final, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)


def _new_lock(dir_fd: int, run: str) -> int | None:
    """``<run>.lock``, already locked when it gets that name; None if a reclaimer raced us (retry)."""
    tmp = f".{run}.lock.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, f"{run}.lock", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except (BlockingIOError, FileNotFoundError):  # a reclaimer took the fresh file for a dead run's
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _files_of(run: str) -> list[str]:
    """A run's files in the records folder, the lock last (it is what makes the others attributable)."""
    return [f".{run}.json.tmp", f"{run}.json", f".{run}.lock.tmp", f"{run}.lock"]


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _same_file(shm_dir: str, seg: Segment) -> bool:
    try:
        st = os.lstat(os.path.join(shm_dir, seg.name))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (seg.dev, seg.ino)


# -- reclaiming dead runs' segments --------------------------------------------------------
def reclaim(shm_dir: str = SHM_DIR, delete: bool = True) -> ReclaimResult:
    """Look at every record; delete dead runs' recorded segments (``delete=False``: only say what would go)."""
    result = ReclaimResult()
    try:
        dir_fd = _open_records_dir(shm_dir, create=False)
    except OSError as exc:
        result.problem = str(exc)
        return result
    if dir_fd is None:
        return result
    try:
        runs = sorted({m.group(1) for m in map(_FILE.match, os.listdir(dir_fd)) if m})
        in_use: dict[tuple[int, int], int] | None = None
        for run in runs:
            lock_fd = _take_lock(dir_fd, run)
            if lock_fd is None:
                info, segments = _read_record(dir_fd, run)
                result.runs.append(
                    RunState(
                        run,
                        alive=True,
                        info=info,
                        segments=[
                            SegmentState(s.name, s.size, False, "its run is alive (or its lock file is missing)")
                            for s in segments
                        ],
                    )
                )
                continue
            try:
                info, segments = _read_record(dir_fd, run)
                if segments and in_use is None:
                    in_use = held_files(_all_processes(), os.stat(shm_dir).st_dev)
                state = RunState(
                    run, alive=False, info=info, segments=[_judge(shm_dir, s, in_use or {}) for s in segments]
                )
                result.runs.append(state)
                if delete:
                    _reclaim_run(shm_dir, dir_fd, run, info, segments, state)
            finally:
                os.close(lock_fd)
    finally:
        os.close(dir_fd)
    return result


def reclaim_and_log(shm_dir: str = SHM_DIR) -> ReclaimResult:
    """:func:`reclaim`, saying what it deleted (and that there is more to see, if something was kept)."""
    result = reclaim(shm_dir)
    if result.deleted:
        logger.info(
            "reclaimed {} shared-memory segments ({:,} bytes) that dead runs of ours recorded in {}: {}",
            len(result.deleted),
            result.bytes,
            shm_dir,
            [s.name for s in result.deleted],
        )
    if result.problem:
        logger.warning("shared-memory records not read: {}", result.problem)
    return result


def _take_lock(dir_fd: int, run: str) -> int | None:
    """The run's lock, if it can be taken (its run is dead); None while it lives."""
    for name in (f"{run}.lock", f".{run}.lock.tmp"):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        except OSError:
            return None  # not a plain file of ours: leave it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd
    return None  # no lock file (removed by hand?): its run cannot be proven dead


def _read_record(dir_fd: int, run: str) -> tuple[dict, list[Segment]]:
    """The record's description and segments; a missing or unreadable record names none."""
    try:
        fd = os.open(f"{run}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return {}, []
    try:
        with os.fdopen(fd, "rb") as fh:
            body = json.loads(fh.read(1 << 22))
        info = {k: body[k] for k in ("run", "pid", "host", "started") if k in body}
        segments = [
            Segment(str(s["name"]), int(s["dev"]), int(s["ino"]), int(s.get("size", 0)))
            for s in body.get("segments", [])
        ]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}, []
    return info, [s for s in segments if _plain_name(s.name)]


def _plain_name(name: str) -> bool:
    return (
        bool(name)
        and "/" not in name
        and "\0" not in name
        and name not in (".", "..")
        and not name.startswith(RECORDS_PREFIX)
    )


def _judge(shm_dir: str, seg: Segment, in_use: dict[tuple[int, int], int]) -> SegmentState:
    """Delete the recorded name only if it still is the recorded file, this user's, and nobody we see holds it."""
    try:
        st = os.lstat(os.path.join(shm_dir, seg.name))
    except FileNotFoundError:
        return SegmentState(seg.name, 0, False, "already gone")
    except OSError as exc:
        return SegmentState(seg.name, 0, False, f"cannot be looked at ({exc.strerror})")
    size = st.st_size
    if not stat.S_ISREG(st.st_mode):
        return SegmentState(seg.name, size, False, "not a regular file now")
    if (st.st_dev, st.st_ino) != (seg.dev, seg.ino):
        return SegmentState(seg.name, size, False, "another file has this name now")
    if st.st_uid != os.getuid():
        return SegmentState(seg.name, size, False, f"owned by uid {st.st_uid}")
    if (st.st_dev, st.st_ino) in in_use:
        return SegmentState(
            seg.name,
            size,
            False,
            f"still mapped or open by pid {in_use[st.st_dev, st.st_ino]} (left for a later run)",
            later=True,
        )
    return SegmentState(seg.name, size, True, "recorded by this dead run, unchanged")


def _reclaim_run(shm_dir: str, dir_fd: int, run: str, info: dict, segments: list[Segment], state: RunState) -> None:
    """Delete the judged names (we hold the run's lock), then the record, unless something waits for later."""
    later = []
    for seg, judged in zip(segments, state.segments):
        if judged.delete:
            try:
                if not _same_file(shm_dir, seg):  # looked at again right before: still the recorded file?
                    judged.delete, judged.reason = False, "changed while being reclaimed"
                    continue
                os.unlink(os.path.join(shm_dir, seg.name))
            except FileNotFoundError:
                judged.delete, judged.reason = False, "already gone"
            except OSError as exc:
                judged.delete, judged.reason = False, f"could not be deleted ({exc.strerror})"
        elif judged.later:
            later.append(seg)
    if later:  # still in use by a process we can see: keep those in the record, for the next run
        body = {**info, "format": FORMAT, "segments": [asdict(s) for s in later]}
        tmp = f".{run}.json.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            os.write(fd, json.dumps(body).encode())
        finally:
            os.close(fd)
        os.replace(tmp, f"{run}.json", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return
    for name in _files_of(run):
        _unlink_quietly(name, dir_fd)


def report_lines(result: ReclaimResult, shm_dir: str = SHM_DIR, deleted: bool = False) -> list[str]:
    """What ``clean-shm`` prints: each record, each segment with what happens to it and why, a total."""
    lines = []
    if result.problem:
        lines.append(f"records not read: {result.problem}")
    for run in result.runs:
        lines.append(run.describe())
        for seg in run.segments:
            verb = ("deleted" if deleted else "delete") if seg.delete and not run.alive else "keep"
            size = f" ({_size(seg.size)})" if seg.size else ""
            lines.append(f"  {verb:8}{os.path.join(shm_dir, seg.name)}{size}: {seg.reason}")
        if not run.segments:
            lines.append("  (no segment recorded)")
    gone = result.deleted
    dead = sum(not r.alive for r in result.runs)
    total = f"{len(gone)} segments ({_size(result.bytes)}) of {dead} dead run(s)"
    lines.append(
        f"{'deleted' if deleted else 'would delete'}: {total}"
        + ("" if deleted or not gone else "; run again with --yes to delete them")
    )
    lines.append(
        f"only what a run of ours recorded is ever deleted; other files in {shm_dir} (another "
        "program's, or a run's that was killed before it recorded them) are not looked at"
    )
    return lines


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"
