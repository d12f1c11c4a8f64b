"""The directory `offload="disk"` keeps optimizer state in: the state file reserved whole before
anything changes (a full or read-only disk is an error then, not a crash mid-step), removed with its
optimizer, the leftovers of processes that died without removing theirs found and removed, a
memory-backed file system warned of, and the directory's bandwidth measured for the tools.

Each process writes under a directory of its own, named by host, pid and the pid's start time,
which is how a later process tells a dead owner from a live one.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from zerocompile.rank_deaths import process_start_time
from zerocompile.user_warnings import warn_at_caller

_DIRECTORY_PREFIX = "zerocompile-offload-"
_MEMORY_FILE_SYSTEMS = ("tmpfs", "ramfs", "devtmpfs")


def measure_disk_bandwidth(directory: str | os.PathLike, nbytes: int = 256 * 2**20) -> dict[str, float]:
    """Bytes per second of writing `nbytes` to a new file in `directory` (fsync'd) and of reading
    them back from the disk (the file's own pages evicted first): what a streamed step can move."""
    chunk = min(64 * 2**20, nbytes)
    block = os.urandom(chunk)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="zerocompile-bandwidth-") as handle:
        started = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.pwrite(handle.fileno(), block[: min(chunk, nbytes - offset)], offset)
        os.fsync(handle.fileno())
        written = time.perf_counter() - started
        os.posix_fadvise(handle.fileno(), 0, nbytes, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.pread(handle.fileno(), chunk, offset)
        read = time.perf_counter() - started
    return {"write": nbytes / written, "read": nbytes / read}


def describe_directory(directory: str | os.PathLike) -> str:
    """"/nvme/zc (ext4, 1,234,567,890 bytes free)": where offloaded state would go."""
    path = Path(directory)
    return f"{path} ({file_system(path) or 'unknown file system'}, {shutil.disk_usage(path).free:,} bytes free)"


def reserve_file(directory: Path, nbytes: int) -> Any:
    """A new file of `nbytes` reserved on disk under this process's directory in `directory`
    (leftovers of dead processes removed first), open for reading and writing."""
    if not directory.is_dir():
        raise FileNotFoundError(f"offload_dir {str(directory)!r} is not a directory: create it, or name one that exists")
    _remove_leftovers(directory)
    _warn_if_memory(directory)
    mine = directory / f"{_DIRECTORY_PREFIX}{socket.gethostname()}-{os.getpid()}-{process_start_time(os.getpid())}"
    try:
        mine.mkdir(exist_ok=True)
        handle = tempfile.NamedTemporaryFile(dir=mine, prefix="optimizer-", suffix=".state", delete=False)
    except OSError as error:
        raise OSError(
            error.errno,
            f"offload='disk' cannot write in offload_dir {str(directory)!r} ({error.strerror}): give a "
            "directory this process can write",
        ) from error
    try:
        if nbytes:
            os.posix_fallocate(handle.fileno(), 0, nbytes)
    except OSError as error:
        remove_file(handle, None)
        free = shutil.disk_usage(directory).free
        if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise OSError(
                error.errno,
                f"offload='disk' needs {nbytes:,} bytes in {str(directory)!r} for this rank's optimizer state "
                f"and could not reserve them ({error.strerror}; {free:,} bytes free): free space there or "
                "choose another offload_dir",
            ) from error
        raise
    return handle


def remove_file(handle: Any, mapping: mmap.mmap | None) -> None:
    path = Path(handle.name)
    path.unlink(missing_ok=True)
    handle.close()
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:  # a state tensor outlives its optimizer: the pages go when it does
            pass
    try:
        path.parent.rmdir()
    except OSError:  # another optimizer of this process still has a file there
        pass


def _remove_leftovers(directory: Path) -> None:
    """Remove the offload directories of this host's processes that have ended."""
    host = socket.gethostname()
    for entry in directory.glob(f"{_DIRECTORY_PREFIX}{host}-*"):
        pid, _, start = entry.name.removeprefix(f"{_DIRECTORY_PREFIX}{host}-").partition("-")
        if not pid.isdigit() or process_start_time(int(pid)) == start:
            continue
        # Claimed by renaming it out of the pattern: of the ranks of a restarted job that find it,
        # one removes it.
        claimed = directory / f".zerocompile-removing-{entry.name}-{os.getpid()}"
        try:
            entry.rename(claimed)
        except OSError:
            continue
        size = sum(f.stat().st_size for f in claimed.iterdir() if f.is_file())
        shutil.rmtree(claimed, ignore_errors=True)
        warn_at_caller(
            f"offload='disk': removed {entry} ({size:,} bytes), left by process {pid} which ended without "
            "removing its optimizer state"
        )


def _warn_if_memory(directory: Path) -> None:
    kind = file_system(directory)
    if kind in _MEMORY_FILE_SYSTEMS:
        warn_at_caller(
            f"offload_dir {str(directory)!r} is on {kind}, which keeps files in memory: the optimizer state "
            "offloaded there still uses RAM. Give a directory on a disk"
        )


def file_system(directory: Path) -> str | None:
    """The type of the file system `directory` lies on (Linux's /proc/self/mounts), or None."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    real = str(directory.resolve())
    best, kind = "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind
