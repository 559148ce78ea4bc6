"""Does a folder's file system take O_DIRECT, and which file system is it."""

import os

from speculators_v016.store import direct_io

#: File systems that take direct writes: a test there asserts they were used, never that they could not be.
TAKE_DIRECT = ("ext4", "xfs", "btrfs")


def takes_direct(folder) -> bool:
    """The folder's file system takes O_DIRECT (tmpfs before Linux 6.6 and some others do not)."""
    return direct_io.takes(folder)


def writer_goes_direct(folder) -> bool:
    """A SampleWriter writes the folder's files with O_DIRECT: its file system takes it and keeps its files on a
    disk (not tmpfs or ramfs, whose files are memory pages: written buffered there)."""
    return direct_io.takes(folder) and direct_io.in_memory(folder) is None


def fs_type(path) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts; '' where unknown)."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            mount = fields[1]
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, fields[2]
    return kind
