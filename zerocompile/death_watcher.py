"""The watcher of one rank: carries the rank's last words when it dies of a signal.

Run by `zerocompile.rank_deaths` as `python -I -S death_watcher.py FD DIRECTORY RANK PID HOST`,
reading the pipe (FD) that the rank's faulthandler writes its fatal-error report into. A process
dying of SIGSEGV in C code runs no more Python, and one killed by SIGKILL runs nothing: only
another process can tell its peers what happened. So this one copies every byte of the report to
its own stderr (the rank's: users still see the stack in their log, as with plain faulthandler)
and, when the pipe reaches end of file (the rank is gone, or closed the pipe on purpose), writes
a death note for the rank's peers on this host if it saw a report: DIRECTORY/death-RANK.json,
written whole then renamed, so a reader never sees half of one.

Standard library only, no site packages (`-I -S`): it starts in tens of milliseconds and holds a
few MB, and it must not import torch or zerocompile. End of file always ends it, so it never
outlives its rank for long; it writes nothing to the rank, so it can never block it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

# Written by the rank itself when it leaves on an uncaught Python exception, followed by the
# traceback as one line of JSON and a newline (see `zerocompile.rank_deaths`). faulthandler's
# reports never hold a NUL byte.
EXCEPTION_MARK = b"\0zerocompile-exception "

# faulthandler's words for the signals it reports (CPython's Modules/faulthandler.c, checked by
# raising each on 3.11), after "Fatal Python error: ".
FATAL_SIGNALS = {
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
_FATAL = "Fatal Python error: "


def fatal_signal(report: str) -> str | None:
    """The name of the signal a faulthandler report says the process died of ("SIGSEGV"), or None
    when `report` holds no such report."""
    for line in report.splitlines():
        if line.startswith(_FATAL):
            return FATAL_SIGNALS.get(line[len(_FATAL):].strip())
    return None


def death_note(rank: int, pid: int, host: str, report: str, exception: str | None) -> dict | None:
    """What the rank's peers read about its end, or None if it ended without a report (it closed
    the pipe on purpose, or was killed by a signal no handler sees)."""
    if _FATAL in report:  # a crash while leaving on an exception is the end that counts
        kind, name = "signal", fatal_signal(report)
    elif exception is not None:
        kind, name = "exception", None
    else:
        return None
    return {
        "kind": kind, "rank": rank, "pid": pid, "host": host, "time": time.time(),
        "signal": name, "signal_number": int(getattr(signal, name)) if name is not None else None,
        "report": report, "exception": exception,
    }  # fmt: skip


class _Reader:
    """Splits what arrives on the pipe into the report (copied to stderr) and the rank's mark."""

    def __init__(self) -> None:
        self.report = bytearray()
        self.exception: str | None = None
        self._pending = b""

    def feed(self, data: bytes) -> None:
        self._pending += data
        while self._pending:
            start = self._pending.find(EXCEPTION_MARK[:1])
            if start == -1:
                self._emit(self._pending)
                self._pending = b""
                return
            self._emit(self._pending[:start])
            end = self._pending.find(b"\n", start)
            if end == -1:  # the rest of the mark is still on its way
                self._pending = self._pending[start:]
                return
            mark = self._pending[start:end]
            if mark.startswith(EXCEPTION_MARK):
                self.exception = json.loads(mark[len(EXCEPTION_MARK):])
            self._pending = self._pending[end + 1:]

    def close(self) -> None:
        self._emit(self._pending)
        self._pending = b""

    def _emit(self, data: bytes) -> None:
        if not data:
            return
        self.report += data
        try:
            while data:
                data = data[os.write(2, data):]
        except OSError:  # stderr closed: the note still records the report
            pass


def watch(fd: int, directory: str, rank: int, pid: int, host: str) -> None:
    """Read the rank's pipe to its end; then write its death note if it died with a report."""
    reader = _Reader()
    while data := os.read(fd, 65536):
        reader.feed(data)
    reader.close()
    note = death_note(rank, pid, host, reader.report.decode(errors="replace"), reader.exception)
    if note is None:
        return
    path = os.path.join(directory, f"death-{rank}.json")
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as file:
            json.dump(note, file)
        os.replace(partial, path)
    except OSError as error:
        os.write(2, f"zerocompile: could not record how rank {rank} (pid {pid}) died in {directory}: {error}\n".encode())


if __name__ == "__main__":
    # Ctrl-C reaches every process of the terminal's group: this one must outlive the rank's end,
    # not die before it, to record a KeyboardInterrupt the rank leaves on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
