"""`exit_spawned_rank()`: how the ranks our tools and tests spawn end without tearing gloo down.

They leave through `os._exit` instead of `destroy_process_group()`, which can deadlock against
gloo's worker threads (see its docstring); the spawner calls it once a rank's jobs are done. What
must still hold: every rank exits with status 0, what it printed is not lost, and no rank leaves
while a peer is still on its way to the last collective.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from zerocompile.tools.spawn import RETURNED, Child, child_environment, collect, free_loopback_port
from zerocompile.tools.spawn import loopback_rank_environment

def _announce_the_barrier(tmp: str) -> None:
    """Make this rank's next `dist.barrier()` (the one `exit_spawned_rank` waits in) write a file
    first, so its peer can see it arrive there."""
    import torch.distributed as dist

    barrier = dist.barrier

    def announcing_barrier(*args, **kwargs):
        Path(tmp, "rank0-at-barrier").write_text("")
        return barrier(*args, **kwargs)

    dist.barrier = announcing_barrier


def _state(pid: str) -> str:
    """The process's state letter, "gone" if it was reaped. A zombie ("Z") has exited: our
    parent has not joined it yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def _rank(rank: int, tmp: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # from the variables the spawner gave this rank
    if rank == 0:
        _announce_the_barrier(tmp)
        # Written whole, then renamed: rank 1 polls for the name, and a file it found before the
        # pid was in it read as "" and sent _state to /proc//stat, which is /proc/stat (an
        # IndexError in rank 1, seen once under load).
        Path(tmp, "rank0.pid.partial").write_text(str(os.getpid()))
        os.replace(Path(tmp, "rank0.pid.partial"), Path(tmp, "rank0.pid"))
    else:
        while not Path(tmp, "rank0.pid").exists():
            time.sleep(0.01)
        rank0 = Path(tmp, "rank0.pid").read_text()
        # Rank 0 has returned its result and been told to stop: it either waits at the barrier
        # (announced) or, if it did not wait for its peers, exits. Whichever comes first decides,
        # not how long this rank waited.
        while not Path(tmp, "rank0-at-barrier").exists() and _state(rank0) not in ("Z", "X", "gone"):
            time.sleep(0.01)
        Path(tmp, "rank0-state-when-rank1-arrived").write_text(_state(rank0))
    print(f"rank {rank} leaves", end="")  # no newline: only an explicit flush writes it out


def test_ranks_exit_zero_after_every_peer_reached_the_barrier(
    tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the ranks' stdout buffers, as under CI
    port = free_loopback_port()
    children = [Child(child_environment(loopback_rank_environment(rank, 2, port))) for rank in range(2)]
    try:
        for rank, child in enumerate(children):
            child.submit(_rank, (rank, str(tmp_path)))
            child.stop()
        outcomes = collect(children, timeout=120)
    finally:
        codes = [child.reap(within=60) for child in children]
    assert outcomes == {0: (RETURNED, None), 1: (RETURNED, None)}, outcomes
    assert codes == [0, 0]
    assert (tmp_path / "rank0-state-when-rank1-arrived").read_text() not in ("Z", "X", "gone"), "rank 0 left before its peer arrived"
    printed = capfd.readouterr().out
    assert "rank 0 leaves" in printed and "rank 1 leaves" in printed
