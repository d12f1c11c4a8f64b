"""Run a function on N gloo ranks in spawned processes and collect what each returns.

Ranks rendezvous through a file (no port to race for), bind only loopback, each get an Inductor
cache directory of their own for the run, and are killed if they outlive the timeout: a test
never hangs and never leaves a process behind.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable

import torch.multiprocessing as mp


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 600.0,
    launcher_env: Callable[[int], dict[str, str]] | None = None,
) -> list[Any]:
    """`fn(rank, world_size, *args)` on each rank inside an initialised gloo group; their results.

    With `launcher_env`, each rank instead gets the environment a launcher would set
    (`launcher_env(rank)`) and no group: `fn` is expected to initialise it.
    """
    with tempfile.TemporaryDirectory(prefix="zc-ranks-") as tmp:
        context = mp.start_processes(
            _rank_main,
            args=(world_size, tmp, fn, args, launcher_env),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            _wait(context, tmp, timeout)
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()
        results = []
        for rank in range(world_size):
            path = Path(tmp, f"rank{rank}.pkl")
            if not path.exists():
                failed = sorted(p.stem for p in Path(tmp).glob("*.failed"))
                outcome = pickle.loads(Path(tmp, f"{failed[0]}.pkl").read_bytes()) if failed else None
                detail = outcome.traceback if outcome else "it died without a result"
                raise AssertionError(f"rank {rank} left no result; {failed or 'no rank'} failed:\n{detail}")
            outcome = pickle.loads(path.read_bytes())
            if isinstance(outcome, _RankFailure):
                raise AssertionError(f"rank {rank} failed:\n{outcome.traceback}")
            results.append(outcome)
        return results


def _wait(context: Any, tmp: str, timeout: float) -> None:
    """Until all ranks exit; once one has failed, the others get a short grace, then are killed."""
    waited = 0.0
    grace_left = 15.0
    while not context.join(timeout=1.0):
        waited += 1.0
        if any(Path(tmp).glob("*.failed")):
            grace_left -= 1.0
            if grace_left <= 0:
                return
        if waited >= timeout:
            raise TimeoutError(f"ranks still running after {timeout:.0f} s")


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


def _rank_main(
    rank: int,
    world_size: int,
    tmp: str,
    fn: Callable[..., Any],
    args: tuple,
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

    from zerocompile.distributed import exit_spawned_rank

    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    if launcher_env is None:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size, timeout=timedelta(minutes=5)
        )
    try:
        outcome = fn(rank, world_size, *args)
    except BaseException:
        outcome = _RankFailure(traceback.format_exc())
        Path(tmp, f"rank{rank}.failed").touch()
    Path(tmp, f"rank{rank}.pkl").write_bytes(pickle.dumps(outcome))
    if dist.is_initialized():
        exit_spawned_rank()  # tearing gloo down can deadlock; see its docstring
