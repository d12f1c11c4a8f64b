"""Run a function on N gloo ranks in spawned processes and collect what each returns.

Ranks start as the tools' ranks do (`zerocompile.tools.spawn`: the same environment, torchrun's
variables for their rank, and the allocator `ALLOCATOR` preloaded where installed), but their
group meets through a file (no port to race for when a job's group is remade). They bind only
loopback, each get an Inductor cache directory of their own, and are killed if they outlive the
timeout: a test never hangs and never leaves a process behind.

Spawning costs more than most jobs: a rank process imports torch and zerocompile and, at its first
compile, most of Dynamo and AOTAutograd (measured: 3.7 s for 2 ranks, 7.6 s for 4, and ~2.6 s of
imports at the first compile, on 2 cores). So ranks of one world size stay alive for the session
and run job after job, each job starting from what a new process would see: the environment the
test process has now (a change to it starts new ranks: some variables only act at process start),
Dynamo reset, no `record_graphs()` block left open (each job runs in a copy of the context the
rank started with), torch's default seed, dtype and grad mode, and a
process group (remade if a job destroyed it). A job that fails, hangs or kills a rank takes its
ranks with it: the next job gets new ones. `fresh=True` runs in new processes regardless, for
jobs that measure the process itself (peak RSS).

What the ranks write to stderr goes to a file per rank, passed on to the test's stderr after each
job (pytest shows it with the test that ran it). A rank that dies of a signal (a segmentation
fault in C++ code) leaves only its faulthandler stack there, so the failure's message carries the
end of what the dead rank wrote during the job: a CI log that shows only the failures' messages
still says where it died.
"""

from __future__ import annotations

import atexit
import contextvars
import os
import sys
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Hashable, Iterable

from zerocompile.tools import spawn

# `--allocator` of the ranks' processes: auto, so the tests run where the tools' ranks run (tcmalloc
# where installed) and nothing requires it.
ALLOCATOR = "auto"

# How much of a dead rank's stderr its failure message carries: a faulthandler report of a few
# threads' stacks.
STDERR_TAIL_CHARS = 6000


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 600.0,
    launcher_env: Callable[[int], dict[str, str]] | None = None,
    fresh: bool = False,
    allocator: str = ALLOCATOR,
) -> list[Any]:
    """`fn(rank, world_size, *args)` on each rank inside an initialised gloo group; their results.

    With `launcher_env`, each rank instead gets the environment a launcher would set
    (`launcher_env(rank)`) and no group: `fn` is expected to initialise it (always new processes).
    `allocator` is preloaded in the ranks as `zerocompile train --allocator` would.
    """
    if launcher_env is not None or fresh:
        pool = _RankPool(world_size, launcher_env, allocator)
        try:
            return pool.run(fn, args, timeout)
        finally:
            pool.close()
    pool = _POOLS.get(world_size)
    if pool is not None and (pool.environment, pool.allocator) != (_environment(), allocator):
        pool.close()
        pool = None
    if pool is None:
        pool = _POOLS[world_size] = _RankPool(world_size, allocator=allocator)
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        # Whatever state the ranks were left in (a peer mid-collective, a patched module) must not
        # reach the next test.
        pool.close()
        del _POOLS[world_size]
        raise


def run_cases(cases: Iterable[tuple[Hashable, Callable[[], Any]]]) -> dict[Hashable, Any]:
    """Inside a rank: each case's result, or its traceback if it raised, by key.

    One failing case must not cost the report of the others, and a barrier after each keeps the
    ranks in step, so a rank that failed early cannot meet the others' next collectives.
    """
    import torch.distributed as dist

    report: dict[Hashable, Any] = {}
    for key, run in cases:
        try:
            report[key] = run()
        except Exception:
            report[key] = traceback.format_exc()
        dist.barrier()
    return report


def raised(fn: Callable[[], Any]) -> str:
    """`Type: message` of what `fn` raised (the message whole: tests match on its wording), or
    'nothing': an outcome a rank can send back whatever the exception would pickle as."""
    try:
        fn()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "nothing"


class _RankPool:
    """`world_size` rank processes waiting for jobs, until closed (or the session ends)."""

    def __init__(
        self, world_size: int, launcher_env: Callable[[int], dict[str, str]] | None = None, allocator: str = ALLOCATOR
    ) -> None:
        self.world_size = world_size
        self.environment = _environment()
        self.allocator = allocator
        self._directory = tempfile.TemporaryDirectory(prefix="zc-ranks-")
        # Without a launcher's variables the pool makes the group, through a file per job.
        self._rendezvous = None if launcher_env is not None else os.path.join(self._directory.name, "rendezvous")
        self._next_job = 0
        port = spawn.free_loopback_port()
        preload = spawn.find_allocator(allocator)
        self._stderr = [os.path.join(self._directory.name, f"rank{rank}.stderr") for rank in range(world_size)]
        self._stderr_passed_on = [0] * world_size
        self._ranks = []
        for rank in range(world_size):
            with open(self._stderr[rank], "wb") as stderr:  # the child holds its own descriptor
                environment = spawn.child_environment(self._variables(rank, port, launcher_env), preload)
                self._ranks.append(spawn.Child(environment, stderr=stderr.fileno()))

    def _variables(self, rank: int, port: int, launcher_env: Callable[[int], dict[str, str]] | None) -> dict[str, str]:
        launcher = (
            launcher_env(rank) if launcher_env is not None else spawn.loopback_rank_environment(rank, self.world_size, port)
        )
        # One cache per rank: with a shared one, a rank may load the graph its peer just compiled, so
        # what (and how long) one rank compiles would depend on its peers' timing. Assigned,
        # not defaulted: the parent's cache (the conftest's, or CI's) is in the inherited environment.
        # Inside the parent's cache, one directory per rank index: rank 0 of the next test reuses the
        # C++ kernels rank 0 compiled before (as the in-process tests share the session's cache), but
        # never a peer's. Triton reads its own variable before falling back to one inside Inductor's.
        cache = os.path.join(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or self._directory.name, f"rank{rank}")
        return {
            "GLOO_SOCKET_IFNAME": "lo",
            **launcher,
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
        }

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        job = self._next_job
        self._next_job += 1
        rendezvous = None if self._rendezvous is None else f"{self._rendezvous}{job}"
        for rank, child in enumerate(self._ranks):
            child.submit(_run_job, (rank, self.world_size, rendezvous, fn, args))
        try:
            outcomes = spawn.collect(self._ranks, timeout)
        finally:
            said = self._pass_on_stderr()
        # In the order they came: the cause first, then peers that lost it mid-collective.
        failed = [rank for rank, (kind, _) in outcomes.items() if kind != spawn.RETURNED]
        if failed:
            silent = [f"rank {rank}" for rank in range(self.world_size) if rank not in outcomes]
            also = f" (no result from {', '.join(silent)})" if silent else ""
            kind, why = outcomes[failed[0]]
            if kind == spawn.DIED and said[failed[0]]:
                why += f"\nits stderr in this job ended with:\n{said[failed[0]][-STDERR_TAIL_CHARS:]}"
            raise AssertionError(f"rank {failed[0]} failed{also}:\n{why}")
        return [outcomes[rank][1] for rank in range(self.world_size)]

    def _pass_on_stderr(self) -> list[str]:
        """What each rank wrote to stderr since the last call, also written to ours."""
        said = []
        for rank, path in enumerate(self._stderr):
            with open(path, "rb") as stderr:
                stderr.seek(self._stderr_passed_on[rank])
                text = stderr.read().decode(errors="replace")
                self._stderr_passed_on[rank] = stderr.tell()
            sys.stderr.write(text)
            said.append(text)
        sys.stderr.flush()
        return said

    def close(self) -> None:
        """Ask the ranks to leave; kill any that do not within a few seconds."""
        for child in self._ranks:
            child.stop()
        for child in self._ranks:
            child.reap(within=10)
        self._directory.cleanup()


_POOLS: dict[int, _RankPool] = {}


def _environment() -> dict[str, str]:
    """What ranks started now would inherit, but for the variable pytest changes at every test."""
    return {key: value for key, value in os.environ.items() if key != "PYTEST_CURRENT_TEST"}


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


# In a rank: what a new process would see, taken before its first job.
_AT_START: tuple[dict[str, str], int, contextvars.Context] | None = None


def _run_job(
    rank: int, world_size: int, rendezvous: str | None, fn: Callable[..., Any], args: tuple
) -> Any:
    """Inside a rank: `fn(rank, world_size, *args)`, started and cleaned up after as the module
    docstring says."""
    import torch
    import torch.distributed as dist

    global _AT_START
    if _AT_START is None:
        torch.set_num_threads(1)
        torch._inductor.config.compile_threads = 1
        starting_context = contextvars.copy_context()  # each job gets a copy: no ContextVar leaks into the next
        _AT_START = (dict(os.environ), torch.initial_seed(), starting_context)
    environment, default_seed, starting_context = _AT_START
    if rendezvous is not None and not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size, timeout=timedelta(minutes=5)
        )
    torch.manual_seed(default_seed)
    try:
        return starting_context.copy().run(fn, rank, world_size, *args)
    finally:
        os.environ.clear()
        os.environ.update(environment)
        torch._dynamo.reset()
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
