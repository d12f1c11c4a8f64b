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

LATE_BY = 1.0  # seconds rank 1 arrives after rank 0: far longer than a process takes to exit


def _rank(rank: int, tmp: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # from the variables the spawner gave this rank
    if rank == 0:
        Path(tmp, "rank0.pid").write_text(str(os.getpid()))
    else:
        while not Path(tmp, "rank0.pid").exists():
            time.sleep(0.01)
        time.sleep(LATE_BY)
        rank0 = Path(tmp, "rank0.pid").read_text()
        # A zombie ("Z") has exited: our parent has not joined it yet.
        state = Path(f"/proc/{rank0}/stat").read_text().rsplit(")", 1)[1].split()[0]
        Path(tmp, "rank0-state-when-rank1-arrived").write_text(state)
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
    assert (tmp_path / "rank0-state-when-rank1-arrived").read_text() != "Z", "rank 0 left before its peer arrived"
    printed = capfd.readouterr().out
    assert "rank 0 leaves" in printed and "rank 1 leaves" in printed
