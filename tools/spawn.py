"""Start ranks as new Python processes, each with an environment of its own, and collect their results.

The one way the tools (`train`, `bench`, `check`), the benchmarks/ harnesses and the tests' rank
pool start ranks on this machine. Each rank is `python -m zerocompile.tools.spawn` started by `subprocess`
with its whole environment given (`env=`): the parent's os.environ is never written, so nothing a
rank needs (RANK, MASTER_PORT, LD_PRELOAD, ...) leaks into the caller or into other processes it
starts later. No multiprocessing context either: torch.multiprocessing's queues are semaphores,
which Python's resource tracker reported as "leaked" when `zerocompile train` ended.

A rank reads jobs from a pipe: a module-level function and its arguments, pickled (as
multiprocessing's spawn requires too), runs each, and sends back the pickled return value or the
traceback. When told to stop, a rank whose jobs all succeeded leaves through `exit_spawned_rank`.

The ranks of `train`, `bench` and `check` preload tcmalloc, else jemalloc, where installed (what
`python -m torch.backends.xeon.run_cpu --enable-tcmalloc` sets up for CPU training): a malloc is
chosen when a process starts, so `LD_PRELOAD` goes in the child's environment, never this one's.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import pickle
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NoReturn

RETURNED, RAISED, DIED = "returned", "raised", "died"
GRACE_AFTER_A_FAILURE = 15.0  # seconds the other ranks get to report once one has failed or died
_STOP = b""

# What `--allocator` may name: the libraries tried, in order, and the Debian package of the first.
ALLOCATORS = {
    "tcmalloc": (("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "libtcmalloc-minimal4"),
    "jemalloc": (("libjemalloc.so.2",), "libjemalloc2"),
}
ALLOCATOR_CHOICES = ("auto", *ALLOCATORS, "system")


# ------------------------------------------------------------------------------ the environment


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a rendezvous of ranks this process spawns."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def loopback_rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun would set for `rank` of a single-node job on 127.0.0.1:`port`, and gloo
    kept on loopback (its default interface is the one the host name resolves to, maybe none)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
    }


def _library_directories() -> list[Path]:
    """Where an allocator may be installed: the environment's own lib first (conda, a venv, this
    interpreter's prefix), as run_cpu looks, then the system's, Debian's multiarch directory included."""
    prefixes = [os.environ.get("CONDA_PREFIX"), os.environ.get("VIRTUAL_ENV"), sys.prefix, str(Path.home() / ".local")]
    directories = [Path(prefix, "lib") for prefix in prefixes if prefix]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    for root in ("/usr/local/lib", "/usr/lib"):
        directories += [Path(root, multiarch)] if multiarch else []
        directories += [Path(root), Path(f"{root}64")]
    return directories


def find_allocator(choice: str) -> str | None:
    """The library to preload for `--allocator choice`; None for the C library's malloc (`system`,
    or `auto` where neither tcmalloc nor jemalloc is installed). A named one that is not installed
    is an error: asked for, it must not silently be something else."""
    if choice not in ALLOCATOR_CHOICES:
        raise ValueError(f"unknown allocator {choice!r}: one of {', '.join(ALLOCATOR_CHOICES)}")
    if choice == "system":
        return None
    for name in ALLOCATORS if choice == "auto" else (choice,):
        for directory in _library_directories():
            for library in ALLOCATORS[name][0]:
                if (directory / library).is_file():
                    return str(directory / library)
        if choice != "auto":
            files, package = ALLOCATORS[name]
            raise SystemExit(
                f"--allocator {name}: {' or '.join(files)} is not installed (Debian/Ubuntu: "
                f"apt-get install {package}); or pass --allocator auto or system"
            )
    return None


def allocator_line(preload: str | None) -> str:
    """What a command that starts ranks says first: which malloc they run on, and how to change it."""
    if preload is None:
        return "ranks use the C library's malloc (--allocator auto preloads tcmalloc or jemalloc where installed)"
    return f"ranks preload {preload} (--allocator system to use the C library's malloc)"


def add_allocator_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allocator",
        choices=ALLOCATOR_CHOICES,
        default="auto",
        help="malloc of the ranks this command starts, by LD_PRELOAD in their environment: auto "
        "(default) is tcmalloc, else jemalloc, where installed; system is the C library's",
    )


def child_environment(variables: Mapping[str, str], preload: str | None = None) -> dict[str, str]:
    """A child's whole environment: a copy of this process's, `variables` over it, and `preload`
    after any LD_PRELOAD the user set."""
    environment = {**os.environ, **variables}
    if preload is not None:
        environment["LD_PRELOAD"] = ":".join(filter(None, [environment.get("LD_PRELOAD", ""), preload]))
    return environment


# ------------------------------------------------------------------------------ the parent's side


class Child:
    """One started rank process and its two pipes: jobs to it, outcomes from it."""

    def __init__(self, environment: Mapping[str, str], stderr: int | None = None) -> None:
        """`stderr`: a file descriptor the child writes its stderr to (the default: ours)."""
        job_read, job_write = os.pipe()
        outcome_read, outcome_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "zerocompile.tools.spawn", str(job_read), str(outcome_write)],
                env=dict(environment),
                stdin=subprocess.DEVNULL,
                stderr=stderr,
                pass_fds=(job_read, outcome_write),
            )
        finally:
            os.close(job_read)
            os.close(outcome_write)
        self.jobs = Connection(job_write, readable=False)
        self.outcomes = Connection(outcome_read, writable=False)
        # The child unpickles functions by module name: it must search where we do (the tests' own
        # directory, a script's), as multiprocessing's spawn passes sys.path along.
        self.jobs.send_bytes(pickle.dumps(sys.path))

    def submit(self, fn: Callable[..., Any], args: Sequence[Any]) -> None:
        """Have the child run `fn(*args)`; its outcome comes through `collect`."""
        if getattr(fn, "__module__", None) == "__main__":
            raise ValueError(f"{fn.__qualname__} is defined in __main__: a rank can only import functions of modules")
        self.jobs.send_bytes(pickle.dumps((fn, tuple(args))))

    def stop(self) -> None:
        """Tell the child to leave after its jobs (a child already gone is no error)."""
        try:
            self.jobs.send_bytes(_STOP)
        except OSError:
            pass

    def reap(self, within: float) -> int:
        """The child's exit status once it has exited, killed first if it has not within `within` s."""
        try:
            self.process.wait(timeout=within)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.jobs.close()
        self.outcomes.close()
        return self.process.returncode


def collect(
    children: Sequence[Child],
    timeout: float | None,
    grace: float = GRACE_AFTER_A_FAILURE,
    watch: Callable[[list[int]], None] | None = None,
) -> dict[int, tuple[str, Any]]:
    """Each child's next outcome by index: (RETURNED, value), (RAISED, traceback) or (DIED, why).

    Once one child has failed or died, the others get `grace` seconds (they may be waiting in a
    collective for it) and those still silent are left out. Raises TimeoutError after `timeout`
    seconds. `watch`, given the children's pids about every second, may raise to give up.
    """
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    give_up = float("inf")
    waiting = {child.outcomes: index for index, child in enumerate(children)}
    outcomes: dict[int, tuple[str, Any]] = {}
    while waiting:
        now = time.monotonic()
        if now >= give_up:
            break
        if now >= deadline:
            raise TimeoutError(f"ranks still running after {timeout:.0f} s")
        for ready in wait(list(waiting), timeout=min(1.0, deadline - now, give_up - now)):
            index = waiting.pop(ready)
            outcomes[index] = _received(ready, children[index])
            if outcomes[index][0] != RETURNED:
                give_up = min(give_up, time.monotonic() + grace)
        if watch is not None:
            watch([child.process.pid for child in children])
    return outcomes


def _received(outcomes: Connection, child: Child) -> tuple[str, Any]:
    try:
        data = outcomes.recv_bytes()
    except (EOFError, OSError):
        try:
            code = child.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return DIED, f"{_end_of(code)} without a result (its process closed its pipe)"
    try:
        return pickle.loads(data)
    except Exception:
        return RAISED, f"its result cannot be unpickled here:\n{traceback.format_exc()}"


def _end_of(code: int | None) -> str:
    """How a child ended, from its exit status (None: not yet); a signal by name, the first thing
    `RanksFailed` says of the rank."""
    if code is None:
        return "was still running 5 s after it closed its pipe"
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"died of {signal.Signals(-code).name} (signal {-code}, exit status {code})"
    except ValueError:  # a real-time signal has no name
        return f"died of signal {-code} (exit status {code})"


class RanksFailed(RuntimeError):
    """Ranks raised, died or exited with an error; `failures` holds what each said, by rank, in the
    order they said it: the cause first, before its peers' broken connections and their kills."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        first, *others = failures
        also = f" (also {', '.join(f'rank {r}' for r in others)})" if others else ""
        super().__init__(f"rank {first} failed{also}:\n{failures[first]}")


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    env: Mapping[str, str] | None = None,
    preload: str | None = None,
    timeout: float | None = None,
    watch: Callable[[list[int]], None] | None = None,
) -> list[Any]:
    """`fn(rank, *args)` on `world_size` new processes, ranks of a job on 127.0.0.1; their results.

    Each gets torchrun's variables for its rank (`loopback_rank_environment`), then `env`, and
    `preload` (see `find_allocator`) in LD_PRELOAD. A rank that raises or dies has the others
    killed after a short grace and raises `RanksFailed` with its traceback; `timeout` seconds
    without every result kill them all (TimeoutError), as does any exception `watch` raises. No
    rank outlives the call.
    """
    port = free_loopback_port()
    children: list[Child] = []
    try:
        for rank in range(world_size):
            variables = {**loopback_rank_environment(rank, world_size, port), **(env or {})}
            children.append(Child(child_environment(variables, preload)))
        for rank, child in enumerate(children):  # all started first: a job's bytes wait in a pipe until read
            child.submit(fn, (rank, *args))
            child.stop()
        outcomes = collect(children, timeout, watch=watch)
    except BaseException:
        for child in children:
            child.reap(within=0)
        raise
    failures = {rank: text for rank, (kind, text) in outcomes.items() if kind != RETURNED}
    for rank in range(world_size):
        if rank not in outcomes:
            failures[rank] = "no result: still running when the others had failed, killed"
    # Every rank that returned now meets its peers at the barrier of `exit_spawned_rank`.
    codes = [child.reap(within=0 if failures else 60) for child in children]
    for rank, code in enumerate(codes):
        if code and rank not in failures:
            failures[rank] = f"returned, then exited with status {code}"
    if failures:
        raise RanksFailed(failures)
    return [outcomes[rank][1] for rank in range(world_size)]


# ------------------------------------------------------------------------------- the rank's side


def exit_spawned_rank() -> NoReturn:
    """End a rank process that we spawned, once every rank is done with the group's collectives.

    Tearing gloo down can deadlock: the last reference to its backend may be dropped while this
    thread holds the GIL and joins gloo's worker threads, and a worker still releasing a finished
    collective's tensors needs the GIL to drop their Python objects (pytorch/pytorch#56297,
    pytorch/pytorch#75097; seen here as a `zerocompile bench` rank stuck for good in
    `destroy_process_group()` after `all_gather_object`). A rank we spawned has sent its
    results and has nothing left to release, so it leaves without the teardown. The barrier comes
    first: a rank that exits while a peer is still inside a collective would break that peer's
    connection mid-message.
    """
    import torch.distributed as dist

    dist.barrier()
    _leave(0)


def leave_rank(failed: bool) -> NoReturn:
    """After the last job: a rank whose jobs all succeeded waits for its peers (see
    `exit_spawned_rank`); one that failed leaves at once, its peers are about to be killed."""
    dist = sys.modules.get("torch.distributed")
    if not failed and dist is not None and dist.is_available() and dist.is_initialized():
        try:
            exit_spawned_rank()
        except Exception:  # a peer left without the barrier: it failed, and has said so
            failed = True
    _leave(1 if failed else 0)


def _leave(status: int) -> NoReturn:
    """`os._exit(status)`, which runs no finalizer: so first the death watch of a sharded model
    still alive ends here (`zerocompile.rank_deaths`), as a normal end, which leaves no records."""
    deaths = sys.modules.get("zerocompile.rank_deaths")
    if deaths is not None:
        deaths.RANK_DEATHS.stop()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _serve(jobs: Connection, outcomes: Connection) -> NoReturn:
    """Run the jobs the parent sends until it says stop (or is gone)."""
    sys.path[:] = pickle.loads(jobs.recv_bytes())
    failed = False
    while True:
        try:
            job = jobs.recv_bytes()
        except EOFError:
            job = _STOP  # the parent died: nobody is left to run jobs for
        if job == _STOP:
            leave_rank(failed)
        try:
            fn, args = pickle.loads(job)
            outcome = (RETURNED, fn(*args))
        except BaseException:
            outcome = (RAISED, traceback.format_exc())
        try:
            data = pickle.dumps(outcome)
        except Exception:
            outcome = (RAISED, f"its result cannot be pickled:\n{traceback.format_exc()}")
            data = pickle.dumps(outcome)
        failed = failed or outcome[0] != RETURNED
        outcomes.send_bytes(data)


def die_with_the_parent() -> None:
    """Linux: the kernel kills this rank when the process that started it dies (killed, crashed),
    rather than leaving it to run its job to the end as an orphan."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before the request took effect
            os._exit(1)


if __name__ == "__main__":
    # A rank that dies of a signal (a segmentation fault inside gloo or a kernel) prints every
    # thread's Python stack to the stderr it shares with its parent: without it the parent can say
    # only "exited with status -11". This process is ours, so the handler is ours to install.
    faulthandler.enable()
    die_with_the_parent()
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
