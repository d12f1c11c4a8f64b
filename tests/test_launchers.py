"""Launchers: torchrun on one node and on two "nodes" (two torchrun invocations on 127.0.0.1), and
how `init_distributed()` reads Slurm's environment.

The torchrun runs train examples/gpt2_zero.py (HF GPT-2, stage 3, eager compiler) and save the
result; two nodes of one process must train exactly as one node of two.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zerocompile.distributed import _first_host, launcher_environment, _slurm_master_port
from zerocompile.tools.spawn import free_loopback_port

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpt2_zero.py"
EXAMPLE_ARGS = ["--steps", "6", "--batch-size", "4", "--seq-len", "32", "--compiler", "eager"]
TIMEOUT = 240.0
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss (\d+\.\d+)", re.MULTILINE)


def _torchrun(*launcher_args: str, save: Path, extra: list[str] | None = None) -> subprocess.Popen:
    """torchrun (as `python -m torch.distributed.run`) of the example, in its own process group."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_args, "--master-addr=127.0.0.1"]
    command += [str(EXAMPLE), *EXAMPLE_ARGS, *(extra or []), "--save", str(save)]
    # A session of its own, so a timeout can kill torchrun's workers along with it.
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _finish(processes: list[subprocess.Popen]) -> list[str]:
    """Each process's output once all have exited zero; on a timeout or failure, kill them all."""
    outputs = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=TIMEOUT)
            assert process.returncode == 0, output
            outputs.append(output)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    return outputs


def test_two_nodes_train_like_one_node(tmp_path: Path) -> None:
    """One node of 4 ranks, plain stage 3; two nodes of 2 ranks each, hybrid sharding within each
    node (--shard-size node: LOCAL_WORLD_SIZE), replicated across: each rank sees the same rows
    and draws the same dropout masks, so the same training up to the order gradients are summed in."""
    one_node = tmp_path / "one-node"
    (output,) = _finish([_torchrun("--nproc-per-node=4", f"--master-port={free_loopback_port()}", save=one_node)])
    losses = [float(loss) for _step, loss in STEP_LINE.findall(output)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, output

    two_nodes = tmp_path / "two-nodes"
    port = free_loopback_port()
    node_args = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=static", f"--master-port={port}"]
    hybrid = ["--shard-size", "node"]
    outputs = _finish([_torchrun(*node_args, f"--node-rank={node}", save=two_nodes, extra=hybrid) for node in (0, 1)])
    assert STEP_LINE.findall(outputs[0]) == STEP_LINE.findall(output)  # node 0 holds rank 0

    expected = load_file(one_node / "model.safetensors")
    trained = load_file(two_nodes / "model.safetensors")
    assert trained.keys() == expected.keys()
    # Gradients are averaged in another order (inside each node, then across; not over all 4 at
    # once). AdamW turns that rounding into real updates where a gradient is exactly zero (the
    # attention key bias: softmax ignores a shift shared by all keys): measured at most 9.5e-6
    # (2026-11-26). A wrong average moves weights by far more (test_hybrid's broken variant: > 1e-3).
    differences = {name: (trained[name] - tensor).abs().max().item() for name, tensor in expected.items()}
    worst = max(differences, key=differences.__getitem__)
    assert differences[worst] <= 1e-4, f"{worst} differs by {differences[worst]:.3g}"


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("node[07-09,12],gpu1", "node07"), ("gpu3", "gpu3"), ("r1-n[2-3]-ib,r2-n1", "r1-n2-ib"), ("a[1-2]-[5-6]", "a1-5")],
)
def test_master_is_the_first_host_of_the_node_list(nodelist: str, first: str) -> None:
    assert _first_host(nodelist) == first


def test_srun_environment_gives_rank_and_step_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)  # torchrun's variables would take precedence
    srun = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"}
    for name, value in {**srun, "SLURM_STEP_NUM_TASKS": "6", "SLURM_JOB_ID": "4242"}.items():
        monkeypatch.setenv(name, value)
    assert launcher_environment() == (5, 6, 1)
    assert _slurm_master_port() == 29500 + 242


def test_a_task_srun_started_meets_its_peers_without_writing_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """One task of one: the master is the step's first host, the port 29500 + SLURM_JOB_ID % 1000
    (a job id whose port is free now), and both reach the rendezvous without being written into
    os.environ, where this process's later children would inherit them."""
    import torch.distributed as dist

    import zerocompile as zc

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    job_id = next(job for job in range(1000) if _free(_SLURM_PORT_BASE + job))
    srun = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": str(job_id)}
    for name, value in {**srun, "SLURM_STEP_NODELIST": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    assert zc.init_distributed(backend="gloo") == (0, 1)
    try:
        assert dict(os.environ) == before
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 1.0
    finally:
        dist.destroy_process_group()


_SLURM_PORT_BASE = 29500


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_sbatch_without_srun_is_an_error_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    # What the body of `sbatch --ntasks=4` sees: a rank and a task count, but no step.
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match=r"SLURM_NTASKS=4.*not started by srun.*srun python"):
        launcher_environment()
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task job alone is simply one rank
    assert launcher_environment() is None
