"""`benchmarks/gloo_concurrency.py`, the check behind `passes.one_in_flight`, still runs: two
ranks under torchrun, gathers in flight on one gloo worker thread (the safe setting: a smoke run,
not the stress), every value received checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gloo_concurrency_check_runs_on_two_ranks_and_checks_every_value() -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "benchmarks.gloo_concurrency", "--threads", "1", "--in-flight", "3", "--iterations", "4"]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in (0, 1):
        assert (
            f"rank {rank}: 4 iterations of 3 coalesced all-gathers in flight on 1 gloo thread(s): every value right"
            in result.stdout
        ), result.stdout + result.stderr
