"""`exit_spawned_rank()`: how the ranks our tools and tests spawn end without tearing gloo down.

They leave through `os._exit` instead of `destroy_process_group()`, which can deadlock against
gloo's worker threads (see its docstring). What must still hold: every rank exits with status 0,
what it printed is not lost, and no rank leaves while a peer is still on its way to the last
collective.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from zerocompile.distributed import free_loopback_port, loopback_rank_environment

LATE_BY = 1.0  # seconds rank 1 arrives after rank 0: far longer than a process takes to exit


def _rank(rank: int, port: int, tmp: str) -> None:
    import torch.distributed as dist

    from zerocompile.distributed import exit_spawned_rank

    os.environ.update(loopback_rank_environment(rank, 2, port))
    dist.init_process_group("gloo")
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
    exit_spawned_rank()
    Path(tmp, f"rank{rank}-returned").touch()


def test_ranks_exit_zero_after_every_peer_reached_the_barrier(
    tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # the ranks' stdout buffers, as under CI
    context = mp.start_processes(_rank, args=(free_loopback_port(), str(tmp_path)), nprocs=2, join=False)
    try:
        for _ in range(120):  # join() returns False each time one rank exits while another runs
            if context.join(timeout=1):
                break
        else:
            raise AssertionError("the ranks did not exit within 120 s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    assert [process.exitcode for process in context.processes] == [0, 0]
    assert (tmp_path / "rank0-state-when-rank1-arrived").read_text() != "Z", "rank 0 left before its peer arrived"
    assert not list(tmp_path.glob("*-returned")), "exit_spawned_rank() returned"
    printed = capfd.readouterr().out
    assert "rank 0 leaves" in printed and "rank 1 leaves" in printed
