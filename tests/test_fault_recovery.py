"""Fault recovery of the main job: a rank SIGKILLed mid-run under `torchrun --max-restarts=1`.

The job (`zerocompile train --save D --save-every N --resume D`) must be restarted by torchrun from
its last complete checkpoint and end with exactly the parameters, optimizer state and loss curve of
a run that was never interrupted: docs/checkpoints.md's promise for `torchrun --max-restarts=K`.
The same with the optimizer state on disk (`--offload-dir`), killed inside the optimizer step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zerocompile import checkpoint_files
from zerocompile.tools.spawn import free_loopback_port
from zerocompile.tools.convert import convert

KILL_RANK_TRAIN = Path(__file__).resolve().parent / "kill_rank_train.py"
STEPS, SAVE_EVERY, KILL_AT_STEP = 8, 3, 5  # checkpoints after steps 3, 6, 8; the kill loses steps 4-5
TIMEOUT = 240.0


def _torchrun_train(entry: list[str], checkpoint: Path, out: Path, extra_env: dict[str, str], extra_args: list[str]) -> str:
    """`entry train ...` as 2 torchrun workers allowed one restart; its output once it exits zero.

    torchrun runs in a session of its own, so on a timeout or failure its workers die with it.
    """
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **extra_env}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1"]
    # The static rendezvous, as docs/launchers.md launches: one store for the whole job, which
    # init_distributed gives each restart attempt a private view of.
    command += ["--monitor-interval=0.1", "--master-addr=127.0.0.1", f"--master-port={free_loopback_port()}"]
    command += ["--local-addr=127.0.0.1"]
    command += [*entry, "train", "--compiler", "eager", "--model-size", "tiny", "--batch-size", "16"]
    command += ["--steps", str(STEPS), "--log-every", "1", "--sample-bytes", "0", "--out", str(out)]
    command += ["--save", str(checkpoint), "--save-every", str(SAVE_EVERY), "--resume", str(checkpoint), *extra_args]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 0, output
    return output


def _final_state(checkpoint: Path, tmp_path: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The full parameters (through `zerocompile convert`) and the loss curve a job saved last."""
    weights = tmp_path / f"{checkpoint.name}.safetensors"
    convert(checkpoint, weights)
    extra = checkpoint_files.read_extra(checkpoint_files.resolve(checkpoint), rank=0)
    assert extra["step"] == STEPS
    return load_file(weights), extra["losses"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[str, torch.Tensor], list[float]]:
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    output = _torchrun_train(["-m", "zerocompile.tools.cli"], tmp_path / "uninterrupted", tmp_path, {}, [])
    assert "no checkpoint at" in output and "resumed from" not in output
    return _final_state(tmp_path / "uninterrupted", tmp_path)


# "offload": the state on disk (--offload-dir) and the kill inside the optimizer step, after its
# first bucket was written to the file: the restart must not read that file (a new one is made,
# the dead attempt's removed) but the checkpoint, and train as if nothing had happened.
@pytest.mark.parametrize("offload", [False, True], ids=["in-memory", "offload"])
def test_a_rank_killed_mid_run_restarts_from_the_checkpoint_to_the_same_weights(uninterrupted, tmp_path: Path, offload: bool) -> None:
    kill = {"KILL_RANK": "1", "KILL_AT_STEP": str(KILL_AT_STEP), "KILL_IN_OFFLOADED_STEP": "1" if offload else "0"}
    extra = ["--offload-dir", str(tmp_path)] if offload else []
    restarted = _torchrun_train([str(KILL_RANK_TRAIN)], tmp_path / "restarted", tmp_path, kill, extra)
    where = "in the optimizer step of" if offload else "at"
    assert f"rank 1: killing myself {where} step {KILL_AT_STEP}" in restarted, restarted
    assert re.search(r"exitcode\s*:\s*-9|Signal 9 \(SIGKILL\)", restarted), restarted  # torchrun saw the kill
    # The restart began from the last checkpoint before the kill and redid the lost steps.
    assert f"resumed from {tmp_path / 'restarted'} after step {SAVE_EVERY}" in restarted, restarted
    steps_logged = [int(step) for step in re.findall(r"\] step\s+(\d+)/", restarted)]
    assert steps_logged == [*range(1, KILL_AT_STEP), *range(SAVE_EVERY + 1, STEPS + 1)], restarted
    if offload:
        assert "optimizer_on_disk" in restarted
        assert re.search(r"offload='disk': removed .*zerocompile-offload-.*left by process \d+", restarted), restarted
        assert not list(tmp_path.glob("zerocompile-offload-*")), "the job's files outlived it"

    expected_weights, expected_losses = uninterrupted
    weights, losses = _final_state(tmp_path / "restarted", tmp_path)
    assert losses == expected_losses
    assert weights.keys() == expected_weights.keys()
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
