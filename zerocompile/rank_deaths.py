"""How this host's ranks die, recorded for their peers, and the description of a dead peer.

When a rank dies of a signal (SIGSEGV in a kernel, SIGABRT, SIGKILL) its peers see only a closed
connection in their next collective. The dying process cannot tell them more itself: a segmentation
fault in C code runs no more Python, and SIGKILL runs nothing. So while a sharded model lives on a
group of more than one rank, each rank points faulthandler (every thread's stack, on a fatal signal)
at a pipe read by a small watcher process (`death_watcher.py`), which copies the report to the
rank's stderr and, when the pipe closes after a report, writes a death note into a directory of
the job on this host. Each rank also records its pid there, so a peer on the same host can tell a
rank whose process is gone without any report (SIGKILL: the OOM killer, a launcher or a user).

When a collective fails, `describe_dead_ranks` (called by `guard`) reads that directory and names
the dead rank, its signal and the innermost frame it was in. (A rank that leaves on an uncaught
Python exception says so through the same pipe as it exits: its peers would otherwise see a
process gone without a report.)

The job directory, `<tempdir>/zerocompile-ranks-<token>`, is named by a token the first rank to
ask puts in the job's default store: every rank of the job, whichever group it shards over, gets
the same one, with no collective. Files are removed, and the directory by the last rank to leave
it, when the last sharded model is collected; a job whose ranks crashed leaves its directory
behind, a few hundred bytes per rank plus the reports of the dead ones.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import json
import linecache
import os
import re
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from zerocompile.death_watcher import EXCEPTION_MARK

WATCHER = Path(__file__).with_name("death_watcher.py")
_TOKEN_KEY = "zerocompile/rank-deaths/token"
# A transport failure or timeout, as gloo, NCCL and the c10d stores word them.
_PEER_FAILURE = re.compile(
    r"timed? ?out|timeout|connection (closed|reset|refused)|closed by peer|pair closure|broken pipe|socket",
    re.IGNORECASE,
)
# How `describe_deaths_in` begins when it found no dead peer.
NO_DEATH = "no other rank of the group died"
# How long a survivor looks for its dead peers' notes: a watcher writes within milliseconds of
# the death, more under load.
WAIT = 3.0
POLL = 0.05
# With no rank gone after this long, none died on this host: the failure was a stall, or a death
# on another host. (A process is a zombie moments after the kernel closed its connections.)
SETTLE = 0.5


class RankDeaths:
    """This process's part while it holds a sharded model: its watcher, and its record in the job
    directory. `start` and `stop` are idempotent; a process forked from a watched one (a
    DataLoader worker) is not watched: its crash is not its rank's death."""

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.rank: int | None = None
        self.watcher: subprocess.Popen | None = None
        self._write_fd: int | None = None
        self._was_enabled = False
        self._hooked = False

    @property
    def watching(self) -> bool:
        return self._write_fd is not None

    def start(self, directory: Path, rank: int) -> None:
        """Record this process as `rank` in `directory`, and its fatal-error report for the watcher."""
        if self.watching and (directory, rank) == (self.directory, self.rank):
            return
        self.stop()
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A note left by an earlier attempt of the job under this rank is not this process's.
        (directory / f"death-{rank}.json").unlink(missing_ok=True)
        host, pid = socket.gethostname(), os.getpid()
        record = directory / f"rank-{rank}.json"
        _write_json(record, {"rank": rank, "pid": pid, "host": host, "start": process_start_time(pid)})
        read_fd, write_fd = os.pipe()
        try:
            self.watcher = subprocess.Popen(
                [sys.executable, "-I", "-S", str(WATCHER), str(read_fd), str(directory), str(rank), str(pid), host],
                pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        except BaseException:
            os.close(write_fd)
            record.unlink(missing_ok=True)
            raise
        finally:
            os.close(read_fd)
        if not self._hooked:  # os.register_at_fork has no undo: the hook does nothing unwatched
            os.register_at_fork(after_in_child=self._forget_in_child)
            self._hooked = True
        atexit.register(self._at_exit)
        self._was_enabled = faulthandler.is_enabled()
        faulthandler.enable(file=write_fd, all_threads=True)
        self.directory, self.rank, self._write_fd = directory, rank, write_fd

    def stop(self) -> None:
        """Give faulthandler back as it was, end the watcher (no note: this is no death) and remove
        this rank's record, and the directory if it was the last one there."""
        if not self.watching:
            return
        atexit.unregister(self._at_exit)
        self._let_go()
        record = self.directory / f"rank-{self.rank}.json"
        try:
            if json.loads(record.read_text())["pid"] == os.getpid():  # else a later attempt's rank
                record.unlink()
            self.directory.rmdir()  # fails while other ranks' records are there
        except OSError:
            pass
        # Reaped if it has ended already, without waiting for it in a finalizer; else when the
        # next watcher replaces it (subprocess reaps the Popen objects it drops).
        self.watcher.poll()

    def _let_go(self) -> None:
        """faulthandler as it was before `start`, and the pipe closed: the watcher reads its end."""
        if self._was_enabled:
            # faulthandler does not tell which file it wrote to before: the process's stderr.
            faulthandler.enable(file=2, all_threads=True)
        else:
            faulthandler.disable()
        os.close(self._write_fd)
        self._write_fd = None

    def _forget_in_child(self) -> None:
        if self.watching:
            self._let_go()

    def _at_exit(self) -> None:
        """A rank leaving on an uncaught exception tells its watcher so, else its peers would see
        only a process gone without a report. The interpreter set `sys.last_value` when it printed
        the traceback. This runs before the models' finalizers, which would end the watch as a
        normal end: atexit runs the last registered first, and weakref.finalize registered its
        hook with the first model's finalizer, before `start`. The record stays for the peers."""
        error = getattr(sys, "last_value", None)
        if not self.watching or error is None:
            return
        text = "".join(traceback.format_exception(error))
        try:
            os.write(self._write_fd, EXCEPTION_MARK + json.dumps(text).encode() + b"\n")
        except OSError:
            pass
        self._let_go()
        self._name_the_dead_peer(error)

    def _name_the_dead_peer(self, error: BaseException) -> None:
        """Under the traceback of an error a dead peer caused, which peer died, of what and where.

        The errors of zero-compiled graphs say it themselves (`guard`), but not the backward that
        Inductor compiled, which AOTAutograd runs with no hook of ours around it: there gloo's own
        "Connection closed by peer" is what the rank leaves on, and this is where it is explained."""
        if not looks_like_a_lost_peer(error) or self.directory is None:
            return
        world = dist.get_world_size() if dist.is_initialized() else 1 + max(
            (int(path.stem.removeprefix("rank-")) for path in self.directory.glob("rank-*.json")), default=0
        )
        deaths = describe_deaths_in(self.directory, list(range(world)), self.rank)
        if deaths.startswith(NO_DEATH) or deaths in str(error):
            return
        try:
            sys.stderr.write(f"zerocompile: rank {self.rank} failed because {deaths}\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # stderr closed
            pass


RANK_DEATHS = RankDeaths()


def watch_job() -> None:
    """Record how this rank dies, for the job of the default process group (see the module
    docstring). A host where that cannot be done (no writable temporary directory, no process to
    spare) gets a warning: training goes on, its peers would only learn less of a death."""
    store = dist.distributed_c10d._get_default_store()
    token = store.compare_set(_TOKEN_KEY, "", uuid.uuid4().hex).decode()
    directory = Path(tempfile.gettempdir(), f"zerocompile-ranks-{token}")
    try:
        RANK_DEATHS.start(directory, dist.get_rank())
    except OSError as error:
        warnings.warn(
            f"zerocompile: cannot record in {directory} how this rank dies ({error}): if it dies of a signal, "
            "its peers' errors will not say which signal or where",
            RuntimeWarning,
            stacklevel=2,
        )


def worth_watching(group: dist.ProcessGroup) -> bool:
    """Whether a model on `group` has peers that could die: more than one rank, and real ones."""
    return dist.get_world_size(group) > 1 and dist.get_backend(group) != "fake"


# ------------------------------------------------------------------------------ the survivor's side


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def describe(self) -> str:
        source = linecache.getline(self.file, self.line).strip()
        return f'File "{self.file}", line {self.line} in {self.function}' + (f": `{source}`" if source else "")


# A frame line of faulthandler ('  File "x.py", line 3 in f') and of a traceback ('..., line 3, in f').
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+),? in (.+)$')
_CURRENT = re.compile(r"^(Current thread 0x[0-9a-f]+|Stack) \(most recent call first\):$")


def crashing_frames(report: str) -> list[Frame] | None:
    """The frames of the thread a faulthandler report says crashed, innermost first; None if the
    report names no crashing thread (the signal came on a thread that never ran Python)."""
    frames: list[Frame] | None = None
    for line in report.splitlines():
        if frames is None:
            if _CURRENT.match(line):
                frames = []
            continue
        match = _FRAME.match(line)
        if match is None:
            if line.startswith("  "):  # "  <no Python frame>", "  ..." (frames left out)
                continue
            break
        frames.append(Frame(match[1], int(match[2]), match[3]))
    return frames


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.join(paths[key], "") for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def where(frames: Sequence[Frame] | None) -> str:
    """Where a rank was: its innermost frame, and the innermost outside Python's own and installed
    packages' code when that is another one: the code the user can act on."""
    if frames is None:
        return "in a thread that runs no Python code (a native library's own thread)"
    if not frames:
        return "with no Python frame on the crashing thread"
    text = f"while in: {frames[0].describe()}"
    roots = _library_roots()
    if frames[0].file.startswith(roots):
        own = next((frame for frame in frames if not frame.file.startswith(roots)), None)
        if own is not None:
            text += f", called from {own.describe()}"
    return text


def _traceback_frames(text: str) -> list[Frame]:
    return [Frame(m[1], int(m[2]), m[3]) for line in text.splitlines() if (m := _FRAME.match(line))][::-1]


def describe_note(note: dict, who: str) -> str:
    """One dead rank, from its death note (see `death_watcher.death_note`); `who` names it
    ("rank 1 of 2 (pid 123)")."""
    if note["kind"] == "exception":
        text = note["exception"].rstrip()
        return f"{who} exited on an uncaught Python exception, {text.splitlines()[-1]}, {where(_traceback_frames(text))}"
    signal = f"{note['signal']} (signal {note['signal_number']})" if note["signal"] else "a fatal signal"
    return f"{who} died of {signal} {where(crashing_frames(note['report']))}"


def _gone_text(who: str) -> str:
    return (
        f"{who} is gone without a fatal-error report: killed by a signal that cannot be "
        "caught (SIGKILL: the OOM killer, a launcher or a user), or by one it does not handle "
        "(SIGTERM), or it left through os._exit"
    )


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, value: dict) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/`pid`/stat after the command name (state first), or None where the
    process is gone or the system has no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_start_time(pid: int) -> str | None:
    """When process `pid` started (Linux: clock ticks since boot), or None where unknown: a pid the
    kernel gave to a new process since has another."""
    fields = _stat_fields(pid)
    return None if fields is None else fields[19]


def _gone(record: dict) -> bool:
    """Whether the process of a rank's record on this host has ended (a zombie has)."""
    pid = record["pid"]
    if record.get("start") is not None:
        fields = _stat_fields(pid)
        return fields is None or fields[0] in ("Z", "X") or fields[19] != record["start"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _who(group_rank: int, ranks: Sequence[int], pid: int) -> str:
    """ "rank 1 of 2 (pid 123)", with the global rank where the group's numbering differs."""
    global_rank = "" if ranks[group_rank] == group_rank else f"global rank {ranks[group_rank]}, "
    return f"rank {group_rank} of {len(ranks)} ({global_rank}pid {pid})"


def _these(ranks: Sequence[int], one: str, several: str) -> str:
    """ "rank 3 is" / "ranks 3, 5 are": `one` or `several` after the listed ranks."""
    listed = ", ".join(map(str, ranks))
    return f"rank {listed} {one}" if len(ranks) == 1 else f"ranks {listed} {several}"


def describe_deaths_in(directory: Path, ranks: Sequence[int], rank: int, within: float = WAIT) -> str:
    """What `directory` says of the group's other ranks (`ranks`: the global rank of each group
    rank; `rank`: this process's group rank): each dead rank's description, or that none died on
    this host. Looks for up to `within` seconds while a rank is gone but its note not yet written,
    `SETTLE` seconds while none is gone."""
    host = socket.gethostname()
    started = time.monotonic()
    while True:
        notes, gone, alive, unseen = {}, {}, [], []
        for group_rank, global_rank in enumerate(ranks):
            if group_rank == rank:
                continue
            record = _read_json(directory / f"rank-{global_rank}.json")
            note = _read_json(directory / f"death-{global_rank}.json")
            if note is not None and (record is None or record["pid"] == note["pid"]):
                notes[group_rank] = note
            elif record is None or record["host"] != host:
                unseen.append(group_rank)
            elif _gone(record):
                gone[group_rank] = record["pid"]
            else:
                alive.append(group_rank)
        waited = time.monotonic() - started
        if (notes and not gone) or waited >= within or (not notes and not gone and waited >= SETTLE):
            break
        time.sleep(POLL)
    if notes or gone:
        return "; ".join(
            [describe_note(note, _who(r, ranks, note["pid"])) for r, note in notes.items()]
            + [_gone_text(_who(r, ranks, pid)) for r, pid in gone.items()]
        )
    parts = [f"{NO_DEATH} on this host ({host})"]
    if alive:
        parts.append(_these(alive, "is alive here", "are alive here"))
    if unseen:
        parts.append(
            _these(unseen, "has", "have") + " no record here: on another host (a rank's death is recorded on "
            f"its own host only, in {directory} there), or left after its sharded models were collected"
        )
    return "; ".join(parts)


def looks_like_a_lost_peer(error: BaseException) -> bool:
    """Whether `error` is what a collective raises when a peer is gone or late: a `dist.DistError`,
    or a RuntimeError whose message says timeout / closed connection (gloo's)."""
    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and _PEER_FAILURE.search(str(error)) is not None)


def describe_dead_ranks(ranks: Sequence[int], rank: int, within: float = WAIT) -> str | None:
    """`describe_deaths_in` this job's directory, or None where this process records no deaths
    (it holds no sharded model on a group of several ranks)."""
    if not RANK_DEATHS.watching:
        return None
    return describe_deaths_in(RANK_DEATHS.directory, ranks, rank, within)
