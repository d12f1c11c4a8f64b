"""Test-only entry point: `zerocompile train` whose rank $KILL_RANK dies by SIGKILL at step $KILL_AT_STEP.

tests/test_fault_recovery.py starts this under `torchrun --max-restarts=1` in place of the
`zerocompile` command. Only the first attempt (TORCHELASTIC_RESTART_COUNT 0) dies, so the restarted
workers run the job unchanged. The kill is SIGKILL sent by the rank to itself just before it draws
the batch of that step: nothing in the process gets to clean up, as with an OOM kill or a lost node,
while the other rank is left waiting in its step's first collective.
"""

from __future__ import annotations

import functools
import os
import signal
import sys

import torch

from zerocompile import offload
from zerocompile.tools import train as train_module
from zerocompile.tools.cli import main


class BatchesThatKillThisRank(train_module.GlobalBatches):
    """The job's batches, counting the steps (one batch each) of a fresh start to the fatal one.

    With `in_offloaded_step`, the kill comes inside that step's `optimizer.step()` instead, once
    the first bucket of state on disk (`--offload-dir`) has been updated and written."""

    def __init__(self, *args: object, kill_at_step: int, in_offloaded_step: bool, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.kill_at_step = kill_at_step
        self.in_offloaded_step = in_offloaded_step
        self.steps_drawn = 0

    def next(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        self.steps_drawn += 1
        if self.steps_drawn == self.kill_at_step:
            where = "in the optimizer step of" if self.in_offloaded_step else "at"
            print(f"rank {os.environ['RANK']}: killing myself {where} step {self.kill_at_step}", flush=True)
            if not self.in_offloaded_step:
                os.kill(os.getpid(), signal.SIGKILL)
            drop = offload.DiskState._drop

            def drop_then_die(disk: offload.DiskState, bucket: object) -> None:
                drop(disk, bucket)
                os.kill(os.getpid(), signal.SIGKILL)

            offload.DiskState._drop = drop_then_die
        return super().next(rows)


if __name__ == "__main__":
    first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    if first_attempt and os.environ["RANK"] == os.environ["KILL_RANK"]:
        kill_at_step = int(os.environ["KILL_AT_STEP"])
        in_step = os.environ.get("KILL_IN_OFFLOADED_STEP") == "1"
        train_module.GlobalBatches = functools.partial(BatchesThatKillThisRank, kill_at_step=kill_at_step, in_offloaded_step=in_step)
    sys.exit(main(sys.argv[1:]))
