"""The main job, `zerocompile train`, end to end: spawned ranks, the CLI, the printed log."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from ranks import run_on_ranks
from zerocompile.tools.cli import build_parser
from zerocompile.tools.train import printable_sample, train_this_rank

STEP_LINE = re.compile(r"^\[[#.]+\] step\s+(\d+)/(\d+) \| loss (\d+\.\d+) \|", re.MULTILINE)
# Eager graphs and the tiny model: the job's own code path, without Inductor's compile time.
FAST_JOB = ["--compiler", "eager", "--model-size", "tiny", "--batch-size", "16", "--lr", "3e-3"]


def _job_on_rank(rank: int, world_size: int, argv: list[str]) -> list[float]:
    return train_this_rank(build_parser().parse_args(argv))


def _losses(ranks: int, *flags: str) -> list[float]:
    """The loss curve of `zerocompile train --ranks <ranks> <flags>`, run by the test's ranks: the
    job's loop on each rank as torchrun would start it (the CLI's own spawning is tested above)."""
    return run_on_ranks(ranks, _job_on_rank, ["train", *FAST_JOB, "--sample-bytes", "0", *flags])[0]


def test_help_lists_train() -> None:
    result = subprocess.run(["zerocompile", "--help"], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "train" in result.stdout


def test_a_command_imports_only_its_own_module() -> None:
    """`zerocompile plan` (or `dump`) starts without importing the other commands' modules: the
    benchmark's FSDP and chart, the trainer's spawning."""
    probe = (
        "import sys; from zerocompile.tools import cli; assert cli.main(sys.argv[1:]) == 0; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('zerocompile.tools.'))))"
    )
    command = [sys.executable, "-c", probe, "plan", "--params", "1e9", "--ranks", "8"]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    loaded = set(result.stdout.splitlines()[-1].split())
    assert "zerocompile.tools.plan" in loaded, result.stdout
    others = {f"zerocompile.tools.{name}" for name in ("train", "bench", "soak", "capacity", "convert", "dump")}
    assert not loaded & others, sorted(loaded & others)


def test_train_help_documents_the_device_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["train", "--help"])  # what `zerocompile train --help` prints
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    assert re.search(r"--device DEVICE\s+where the model, batches and sampling live", shown), shown
    assert "(cpu: gloo, cuda: nccl; default: cuda:LOCAL_RANK under NCCL, which runs where CUDA exists, else cpu)" in " ".join(
        shown.split()
    ), shown


@pytest.mark.parametrize(
    "flags, settings",
    [
        (["--quant", "int8"], {"gather_quant": "int8", "reduce_quant": "int8"}),
        (["--quant", "int8", "--quant-only", "gathers"], {"gather_quant": "int8", "reduce_quant": None}),
        (["--quant", "int8", "--quant-only", "reductions"], {"gather_quant": None, "reduce_quant": "int8"}),
        ([], {"gather_quant": None, "reduce_quant": None}),
    ],
)
def test_quant_only_picks_which_collectives_are_quantised(flags: list[str], settings: dict) -> None:
    from zerocompile.tools.train import _quantisations

    assert _quantisations(build_parser().parse_args(["train", *flags])) == settings


def test_quant_only_without_quant_is_refused_before_any_rank_starts() -> None:
    from zerocompile.tools.train import train

    with pytest.raises(ValueError, match="--quant-only gathers picks which collectives --quant quantises: add --quant int8"):
        train(build_parser().parse_args(["train", "--quant-only", "gathers"]))


def test_whole_build_lands_on_the_device() -> None:
    from zerocompile.tools.gpt import SIZES
    from zerocompile.tools.train import _build

    model = _build(SIZES["tiny"], "whole", torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_train_runs_on_two_ranks_and_the_loss_falls(tmp_path) -> None:
    command = [sys.executable, "-m", "zerocompile.tools.cli", "train", "--ranks", "2", "--stage", "3"]
    command += [*FAST_JOB, "--steps", "20", "--log-every", "5", "--out", str(tmp_path)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr

    logged = [(int(step), float(loss)) for step, _steps, loss in STEP_LINE.findall(result.stdout)]
    assert [step for step, _loss in logged] == [1, 5, 10, 15, 20], result.stdout
    first_loss, last_loss = logged[0][1], logged[-1][1]
    assert first_loss > last_loss + 0.5, result.stdout
    written = json.loads((tmp_path / "losses.json").read_text())
    assert written["first_step"] == 1 and len(written["losses"]) == 20
    assert [round(written["losses"][step - 1], 4) for step, _loss in logged] == [loss for _step, loss in logged]
    assert "Φ = " in result.stdout and "16Φ/N" in result.stdout
    assert re.search(r"first loss \d+\.\d+ -> last loss \d+\.\d+", result.stdout)
    assert re.search(r"^sample: ['\"]The ", result.stdout, re.MULTILINE), result.stdout  # repr's quotes


@pytest.mark.parametrize(
    "sample, shown",
    [
        (b"The caf\xc3\xa9", "'The café'"),  # UTF-8 reads as text
        (b"The \xff\xfe\x80!", r"'The \xff\xfe\x80!'"),  # bytes that are not UTF-8, each its own escape
        (b"The caf\xc3", r"'The caf\xc3'"),  # a character cut short
        (b"The \x1b[2J\x07\r\n", r"'The \x1b[2J\x07\r\n'"),  # control characters the terminal would obey
        (b"The \xe2\x80\xae", r"'The \u202e'"),  # right-to-left override: valid UTF-8, not printable
        (b"The \\\xff", r"'The \\\xff'"),  # a backslash, then a byte that is not UTF-8
        (b"The \\udcff", r"'The \\udcff'"),  # a backslash, then text that looks like an escape
    ],
    ids=("utf-8", "not-utf-8", "truncated", "control", "bidi-override", "backslash-then-byte", "backslash-then-text"),
)
def test_sample_is_printed_with_every_unprintable_byte_escaped(sample: bytes, shown: str) -> None:
    assert printable_sample(sample) == shown


def test_loss_curve_does_not_depend_on_the_number_of_ranks(tmp_path) -> None:
    """Every rank reads its slice of one global batch, and gradients are averaged over the ranks."""
    losses = {ranks: _losses(ranks, "--steps", "4", "--out", str(tmp_path)) for ranks in (1, 2)}
    assert len(losses[1]) == 4
    assert losses[2] == pytest.approx(losses[1], rel=1e-4)


def test_gradient_accumulation_both_ways_matches_one_batch(tmp_path) -> None:
    """Two micro-batches of half the rows (reducing each, or no_sync then one reduction) follow
    the same loss curve as the whole batch at once; clipping included."""
    plain = _losses(2, "--steps", "4", "--clip", "0.5", "--out", str(tmp_path))
    for accumulate in (["--grad-accum", "2"], ["--grad-accum", "2", "--no-sync"]):
        assert _losses(2, "--steps", "4", "--clip", "0.5", "--out", str(tmp_path), *accumulate) == pytest.approx(
            plain, rel=1e-5
        ), accumulate


def test_resume_at_another_stage_continues_the_uninterrupted_run(tmp_path) -> None:
    """3 steps at stage 3 saved, resumed at stage 2 up to step 6: the same losses as 6 steps in one
    go (batches continue where they stopped); the loss curve is drawn."""
    uninterrupted = _losses(2, "--steps", "6", "--out", str(tmp_path / "a"))
    checkpoint = str(tmp_path / "ckpt")
    _losses(2, "--steps", "3", "--save", checkpoint, "--out", str(tmp_path / "b"))
    resumed = _losses(2, "--steps", "6", "--stage", "2", "--resume", checkpoint, "--out", str(tmp_path / "c"))
    assert resumed == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6)
    assert (tmp_path / "c" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_meta_and_whole_builds_start_from_the_same_weights(tmp_path) -> None:
    """`--build meta` (the default) materialises only each rank's shards; the values, and so the
    loss curve, are those of the model built whole on every rank."""
    meta = _losses(2, "--steps", "2", "--out", str(tmp_path))
    assert _losses(2, "--steps", "2", "--build", "whole", "--out", str(tmp_path)) == meta
    # An explicit --device cpu is what the default picks on a gloo group: the same run.
    assert _losses(2, "--steps", "2", "--build", "whole", "--device", "cpu", "--out", str(tmp_path)) == meta


def test_saved_weights_load_into_another_stage(tmp_path) -> None:
    """--save-weights writes the trained model; --load-weights starts another job (another stage)
    from it: with lr 0 that job saves exactly what it loaded, and its first loss is the trained
    model's, far below a fresh start's."""
    from safetensors.torch import load_file

    trained = _losses(2, "--steps", "6", "--save-weights", str(tmp_path / "a"), "--out", str(tmp_path))
    loaded = _losses(2,
        "--steps", "1", "--stage", "2", "--lr", "0", "--load-weights", str(tmp_path / "a"),
        "--save-weights", str(tmp_path / "b.safetensors"), "--out", str(tmp_path),
    )  # fmt: skip
    first, second = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert loaded[0] < trained[0] - 0.3
