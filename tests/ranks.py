"""Run a function on N gloo ranks in spawned processes and collect what each returns.

Ranks rendezvous through a file (no port to race for), bind only loopback, each get an Inductor
cache directory of their own, and are killed if they outlive the timeout: a test never hangs and
never leaves a process behind.

Spawning costs more than most jobs: a rank process imports torch and zerocompile and, at its first
compile, most of Dynamo and AOTAutograd (measured: 3.7 s for 2 ranks, 7.6 s for 4, and ~2.6 s of
imports at the first compile, on 2 cores). So ranks of one world size stay alive for the session
and run job after job, each job starting from what a new process would see: the environment the
test process has now (a change to it starts new ranks: some variables only act at process start),
Dynamo reset, no compiled graphs on record, torch's default seed, dtype and grad mode, and a
process group (remade if a job destroyed it). A job that fails, hangs or kills a rank takes its
ranks with it: the next job gets new ones. `fresh=True` runs in new processes regardless, for
jobs that measure the process itself (peak RSS).
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Hashable, Iterable

import torch.multiprocessing as mp

_GRACE_AFTER_A_FAILURE = 15.0


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 600.0,
    launcher_env: Callable[[int], dict[str, str]] | None = None,
    fresh: bool = False,
) -> list[Any]:
    """`fn(rank, world_size, *args)` on each rank inside an initialised gloo group; their results.

    With `launcher_env`, each rank instead gets the environment a launcher would set
    (`launcher_env(rank)`) and no group: `fn` is expected to initialise it (always new processes).
    """
    if launcher_env is not None or fresh:
        pool = _RankPool(world_size, launcher_env)
        try:
            return pool.run(fn, args, timeout)
        finally:
            pool.close()
    pool = _POOLS.get(world_size)
    if pool is not None and pool.environment != _environment():
        pool.close()
        pool = None
    if pool is None:
        pool = _POOLS[world_size] = _RankPool(world_size)
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


class _RankFailure:
    def __init__(self, text: str) -> None:
        self.traceback = text


class _RankPool:
    """`world_size` rank processes waiting for jobs, until closed (or the session ends)."""

    def __init__(self, world_size: int, launcher_env: Callable[[int], dict[str, str]] | None = None) -> None:
        self.world_size = world_size
        self.environment = _environment()
        self._directory = tempfile.TemporaryDirectory(prefix="zc-ranks-")
        context = mp.get_context("spawn")
        self._jobs = [context.SimpleQueue() for _ in range(world_size)]
        self._results = context.Queue()
        self._next_job = 0
        self._processes = mp.start_processes(
            _rank_main,
            args=(world_size, self._directory.name, self._jobs, self._results, launcher_env),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        ).processes

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        job = self._next_job
        self._next_job += 1
        payload = pickle.dumps((fn, args))
        for jobs in self._jobs:
            jobs.put((job, payload))
        outcomes = self._collect(job, timeout)
        for rank in range(self.world_size):
            if rank not in outcomes:
                failed = sorted(r for r, o in outcomes.items() if isinstance(o, _RankFailure))
                detail = outcomes[failed[0]].traceback if failed else "it died without a result"
                raise AssertionError(f"rank {rank} left no result; {[f'rank{r}' for r in failed] or 'no rank'} failed:\n{detail}")
            if isinstance(outcomes[rank], _RankFailure):
                raise AssertionError(f"rank {rank} failed:\n{outcomes[rank].traceback}")
        return [outcomes[rank] for rank in range(self.world_size)]

    def _collect(self, job: int, timeout: float) -> dict[int, Any]:
        """Each rank's outcome, until all are in; once one has failed, the others get a short grace."""
        outcomes: dict[int, Any] = {}
        waited = 0.0
        grace_left = _GRACE_AFTER_A_FAILURE
        while len(outcomes) < self.world_size:
            try:
                finished, rank, data = self._results.get(timeout=1.0)
                assert finished == job, f"a result of job {finished} arrived during job {job}"
                outcomes[rank] = pickle.loads(data)
                continue
            except queue.Empty:
                waited += 1.0
            if any(isinstance(o, _RankFailure) for o in outcomes.values()) or any(
                p.exitcode is not None for p in self._processes
            ):
                grace_left -= 1.0
                if grace_left <= 0:
                    break
            if waited >= timeout:
                raise TimeoutError(f"ranks still running after {timeout:.0f} s")
        return outcomes

    def close(self) -> None:
        """Ask the ranks to leave; kill any that do not within a few seconds."""
        for jobs, process in zip(self._jobs, self._processes):
            if process.is_alive():
                jobs.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
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


def _rank_main(
    rank: int,
    world_size: int,
    tmp: str,
    jobs: list,
    results: Any,
    launcher_env: Callable[[int], dict[str, str]] | None,
) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if launcher_env is not None:
        os.environ.update(launcher_env(rank))
    # One cache per rank: with a shared one, a rank may load the graph its peer just compiled, skip
    # our passes and leave no record of the graph in `compiled_graphs`, which tests count. Assigned,
    # not defaulted: the parent's cache (the conftest's, or CI's) is in the inherited environment.
    # Inside the parent's cache, one directory per rank index: rank 0 of the next test reuses the
    # C++ kernels rank 0 compiled before (as the in-process tests share the session's cache), but
    # never a peer's. Triton reads its own variable before falling back to one inside Inductor's.
    cache = os.path.join(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tmp, f"rank{rank}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    import torch
    import torch.distributed as dist

    from zerocompile import backend, hybrid
    from zerocompile.distributed import exit_spawned_rank

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    environment = dict(os.environ)
    default_seed = torch.initial_seed()
    while (job := jobs[rank].get()) is not None:
        number, payload = job
        if launcher_env is None and not dist.is_initialized():
            hybrid._GROUPS.clear()  # subgroups of a destroyed world
            dist.init_process_group(
                "gloo",
                init_method=f"file://{tmp}/rendezvous{number}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(minutes=5),
            )
        torch.manual_seed(default_seed)
        try:
            fn, args = pickle.loads(payload)
            outcome = fn(rank, world_size, *args)
        except BaseException:
            outcome = _RankFailure(traceback.format_exc())
        os.environ.clear()
        os.environ.update(environment)
        torch._dynamo.reset()
        backend.compiled_graphs.clear()
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            data = pickle.dumps(outcome)
        except Exception:
            data = pickle.dumps(_RankFailure(f"its result cannot be pickled:\n{traceback.format_exc()}"))
        results.put((number, rank, data))
    if dist.is_initialized():
        exit_spawned_rank()  # tearing gloo down can deadlock; see its docstring
