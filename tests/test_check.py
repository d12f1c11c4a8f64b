"""`zerocompile check` (zerocompile/tools/check.py): what a user runs on a new machine to know the
install works there. It must pass on a correct install, fail naming the row on a wrong one, pick
its runs from the device and the GPUs visible, and measure one rank of 8 on the fake group."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ranks import run_on_ranks
from zerocompile.tools import check, check_verdict, cli


def test_cpu_check_passes_on_two_ranks(tmp_path: Path) -> None:
    """Stage 3, the one doing the most (gathers in the forward and again in the backward, 3Φ sent),
    under Inductor, so its C++ kernels and DDP+compile run too. Eager rows pass in the broken-run
    test below and in tests/test_gpu_visit.py; tests/test_parity.py covers every stage with both
    compilers."""
    report_path = tmp_path / "check.json"
    code = cli.main(["check", "--device", "cpu", "--stages", "3", "--compilers", "inductor", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert code == 0, report["problems"]
    assert [(row["stage"], row["compiler"]) for row in report["rows"]] == [(3, "inductor")]
    for row in report["rows"]:
        assert row["ok"] and row["problems"] == [], row
        assert row["param_error"] <= check.TOLERANCE[row["compiler"]] and row["grad_error"] <= row["tolerance"]
        assert row["state_bytes"] == [row["state_expected"]] * 2
        assert all(abs(sent / row["sent_expected"] - 1) <= check_verdict.SENT_TOLERANCE for sent in row["sent_bytes"])
        assert row["step_seconds"] > 0 and row["ddp_compile_seconds"] > 0
    assert report["environment"]["gloo"] == "available"


def _scale_reduce_scatter_by_world_size() -> None:
    """A reduce-scatter that sums instead of averaging (its 1/N lost): stages 1-3 only."""
    from zerocompile.passes import lower_markers

    right = lower_markers.reduce_scatter_bucket

    def summed(grads, shard_numels, marker):
        return [shard * marker.world_size for shard in right(grads, shard_numels, marker)]

    lower_markers.reduce_scatter_bucket = summed


def _broken_rank(rank: int, world_size: int, run: check.Run) -> list[dict]:
    _scale_reduce_scatter_by_world_size()
    return check.measure(run)


def test_a_reduce_scatter_missing_its_one_over_n_fails_naming_the_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The ranks run the check's own `measure` with the bug patched into their lowering; the
    verdict must fail stage 2 (which reduce-scatters) and pass stage 0 (which all-reduces). AdamW's
    update barely moves under a constant gradient factor: the first step's gradients show it."""
    run = check.Run("gloo", 2, "cpu", (0, 2), ("eager",), sent=True, timed=False)
    rows = run_on_ranks(2, _broken_rank, run, fresh=True)[0]
    code = check.conclude({}, [run], rows, tmp_path / "check.json")
    errors = capsys.readouterr().err
    assert code == 1
    assert "stage 2, eager (gloo x2 cpu): max |Δ grad|" in errors, errors
    assert "stage 0" not in errors, errors
    report = json.loads((tmp_path / "check.json").read_text())
    assert [row["ok"] for row in report["rows"]] == [True, False] and not report["ok"]


@pytest.mark.parametrize(
    "device, gpus, ranks, fake_ranks, expected",
    [
        ("cpu", 0, None, None, [("gloo", 2, (0, 1, 2, 3), ("eager", "inductor"))]),
        ("cpu", 4, 4, None, [("gloo", 4, (0, 1, 2, 3), ("eager", "inductor"))]),
        ("cpu", 0, None, 8, [("fake", 8, (3,), ("eager", "inductor"))]),
        ("cuda", 4, None, None, [("nccl", 4, (0, 1, 2, 3), ("eager", "inductor"))]),
        ("cuda", 2, None, None, [("nccl", 2, (0, 1, 2, 3), ("eager", "inductor"))]),
        (
            "cuda", 1, None, None,
            [("nccl", 1, (0, 1, 2, 3), ("eager", "inductor")), ("gloo", 2, (0,), ("eager",)), ("fake", 8, (3,), ("eager", "inductor"))],
        ),
        ("cuda", 1, None, 8, [("fake", 8, (3,), ("eager", "inductor"))]),
    ],
)
def test_runs_follow_from_the_device_and_the_gpus_visible(device, gpus, ranks, fake_ranks, expected) -> None:
    runs = check.plan(device, gpus, ranks, fake_ranks)
    assert [(run.backend, run.ranks, run.stages, run.compilers) for run in runs] == expected
    assert all(run.sent == (run.backend == "gloo") for run in runs)
    # Two gloo ranks sharing one GPU, or a fake group: their step times mean nothing.
    assert [run.timed for run in runs] == [run.backend != "fake" and not (run.device != "cpu" and run.backend == "gloo") for run in runs]


def test_one_gpu_narrowed_to_inductor_drops_the_shared_gloo_run() -> None:
    runs = check.plan("cuda", 1, compilers=("inductor",))
    assert [(run.backend, run.stages) for run in runs] == [("nccl", (0, 1, 2, 3)), ("fake", (3,))]


@pytest.mark.parametrize("gpus, ranks, fix", [(0, None, "--device cpu"), (2, 3, "only 2 cuda devices")])
def test_impossible_runs_are_refused_naming_the_fix(gpus: int, ranks: int | None, fix: str) -> None:
    with pytest.raises(ValueError, match=fix):
        check.plan("cuda", gpus, ranks)


def test_fake_group_of_eight_on_cpu_holds_16_phi_over_8(tmp_path: Path) -> None:
    report_path = tmp_path / "check.json"
    code = cli.main(["check", "--device", "cpu", "--fake-ranks", "8", "--compilers", "eager", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert code == 0, report["problems"]
    (row,) = report["rows"]
    assert (row["backend"], row["ranks"], row["stage"]) == ("fake", 8, 3)
    phi = check.full_numel()
    assert row["state_bytes"] == [check.expected_state_bytes(3, 8)]
    assert row["state_bytes"][0] == pytest.approx(16 * phi / 8, rel=check_verdict.FAKE_STATE_TOLERANCE)
    assert row["device_peak_bytes"] is None and row["sent_bytes"] is None


def test_cpu_without_an_accelerator_checks_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: None)
    assert check.visible_devices("cuda") == 0
    with pytest.raises(ValueError, match="--device cpu"):
        check.plan("cuda", check.visible_devices("cuda"))


def test_check_is_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.subcommand("check") is check
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["check", "--help"])  # what `zerocompile check --help` prints
    assert "--fake-ranks" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["check", "--stages", "0,4"])


def test_cpu_check_with_the_optimizer_state_on_disk(tmp_path: Path) -> None:
    """--offload-dir: stages 1 and 3 train against DDP with their AdamW state on disk (the same
    bounds), and the environment names the directory's measured bandwidth."""
    report_path = tmp_path / "report.json"
    offload_dir = tmp_path / "offload"
    offload_dir.mkdir()
    argv = ["check", "--device", "cpu", "--stages", "1,3", "--compilers", "eager", "--offload-dir", str(offload_dir)]
    code = cli.main([*argv, "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert code == 0, report["problems"]
    assert [run["offload_dir"] for run in report["runs"]] == [str(offload_dir)]
    assert re.search(r"offload.*: write [\d,]+ MB/s \(fsync'd\), read [\d,]+ MB/s", report["environment"]["offload dir"])
    assert [(row["stage"], row["param_error"]) for row in report["rows"]] == [(1, 0.0), (3, 0.0)]
    assert all(on_disk > 0 for row in report["rows"] for on_disk in row["state_offloaded_bytes"])
    assert not list(offload_dir.glob("zerocompile-*")), "the ranks' state files outlived them"


def test_cpu_check_with_the_optimizer_state_in_host_memory(tmp_path: Path) -> None:
    """--offload-cpu: stage 3 trains against DDP with its AdamW state in host memory and the
    update on the CPU (on CPU parameters the copies are CPU to CPU: the same code as on a GPU)."""
    report_path = tmp_path / "report.json"
    argv = ["check", "--device", "cpu", "--stages", "3", "--compilers", "eager", "--offload-cpu"]
    code = cli.main([*argv, "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert code == 0, report["problems"]
    assert [run["offload"] for run in report["runs"]] == ["cpu"]
    assert [(row["stage"], row["param_error"]) for row in report["rows"]] == [(3, 0.0)]
    assert all(offloaded > 0 for row in report["rows"] for offloaded in row["state_offloaded_bytes"])
    with pytest.raises(SystemExit):  # two places for the state: argparse refuses the pair
        cli.build_parser().parse_args(["check", "--offload-cpu", "--offload-dir", str(tmp_path)])
