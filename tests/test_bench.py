"""`zerocompile bench --quick` end to end: it completes, writes its three files, and what it measures
is what ZeRO's formulas say, so the benchmark's figures can be trusted on a real run.

Not timed: the quick run's step times mean nothing on a shared CI machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import zerocompile as zc
import zerocompile.offload
from zerocompile.passes.stages import shard_numel
from zerocompile.tools import bench
from zerocompile.tools.bench.modes import MODES as BENCH_MODES, OPTIMIZERS
from zerocompile.tools.bench.orchestration import bench as run_bench
from zerocompile.tools.bench.rank import gpt_class_of_its_own
from zerocompile.tools.bench.settings import Settings
from zerocompile.tools.cli import build_parser
from zerocompile.tools.gpt import GPT, SIZES

MODES = ("ddp", "fsdp2", "zero3-eager")
FIELDS = (
    "step_time_s",
    "compile_time_s",
    "compile_cpu_s",
    "peak_rss_bytes",
    "rss_before_bytes",
    "sent_bytes_per_step",
    "model_state_bytes",
    "final_loss",
)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path]:
    out = tmp_path_factory.mktemp("bench")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        # Interleaved: two uncompiled modes. Stage 3 with the eager compiler: every mode compiles
        # into a fresh Inductor cache of its own, and a cold Inductor compile of even the tiny GPT
        # is ~30 s of CPU per rank here, which no assertion below needs (zero3 and zero3-eager
        # differ only in the compiler option; Inductor runs in test_parity and test_sgd_parity).
        ["--quick", "--ranks", "2", "--modes", ",".join(MODES), "--interleave", "ddp,fsdp2", "--out", str(out)]
    )
    return bench.run(args), out


def test_quick_run_writes_json_table_and_chart(quick_run: tuple[int, Path]) -> None:
    exit_code, out = quick_run
    assert exit_code == 0
    summary = json.loads((out / "bench.json").read_text())
    assert summary["machine"]["node"] and summary["machine"]["torch"]
    assert [mode["mode"] for mode in summary["modes"]] == list(MODES)
    for mode in summary["modes"]:
        assert mode["status"] == "ok", mode
        assert all(field in mode for field in FIELDS), sorted(mode)
        assert set(mode["model_state_bytes"]) == {"params", "grads", "optimizer"}
        assert mode["optimizer_on_disk"] is None
    assert summary["interleaved"]["optimizer_on_disk"] == {} and "optimizer_on_disk" not in summary["method"]
    table = (out / "bench.md").read_text()
    assert summary["machine"]["node"] in table and "Optimizer state on disk" not in table
    assert all(f"| {name} |" in table for name in MODES)
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _modes(quick_run: tuple[int, Path]) -> tuple[dict, dict[str, dict]]:
    summary = json.loads((quick_run[1] / "bench.json").read_text())
    return summary, {mode["mode"]: mode for mode in summary["modes"]}


def test_bytes_sent_per_step_match_zero_formulas(quick_run: tuple[int, Path]) -> None:
    """Stage 3 sends 3Φ·(N−1)/N·4 B per step; DDP's bucketed gloo all-reduce 2Φ·(N−1)/N·4 B.

    Measured at N = 2 on the tiny model: DDP 1.005 x its formula, stage 3 0.99 x (the position
    embedding is not needed by the backward, so it is not gathered again).
    """
    summary, modes = _modes(quick_run)
    theory = summary["theory"]
    # Measured 0.988: the position embedding's share of 3Φ is missing by design (see above).
    assert modes["zero3-eager"]["sent_bytes_per_step"] == pytest.approx(theory["sent_3phi"], rel=0.015)
    # Measured 1.005: wchar also counts gloo's framing and DDP's small broadcasts.
    assert modes["ddp"]["sent_bytes_per_step"] == pytest.approx(theory["sent_2phi"], rel=0.01)


def test_model_state_and_loss_are_what_each_mode_promises(quick_run: tuple[int, Path]) -> None:
    """DDP holds 16Φ, stage 3 and FSDP2 16Φ/N (up to padding or uneven chunks); and the modes saw
    the same initial weights and batches, so they end at the same loss."""
    summary, modes = _modes(quick_run)
    phi, ranks = summary["settings"]["phi"], summary["settings"]["ranks"]
    assert sum(modes["ddp"]["model_state_bytes"].values()) == 16 * phi
    for name in ("zero3-eager", "fsdp2"):
        assert sum(modes[name]["model_state_bytes"].values()) == pytest.approx(16 * phi / ranks, rel=0.02)
    losses = [mode["final_loss"] for mode in modes.values()]
    assert losses == pytest.approx([losses[0]] * len(losses), rel=1e-4)


def test_compile_figures_come_from_the_ranks_that_held_the_others_up(quick_run: tuple[int, Path]) -> None:
    """A mode's step is its slowest rank's in each round, its compile time the slowest first step
    minus the median of those, its compile CPU the largest rank's. Their size is a measurement, not
    asserted here (CI's load moves it); that stage 3 compiled at all is
    test_compile_phases_say_where_the_compile_went's."""
    _, modes = _modes(quick_run)
    for name, mode in modes.items():
        ranks = mode["per_rank"]
        assert mode["step_times_s"] == [max(times) for times in zip(*(rank["step_times"] for rank in ranks))], name
        assert mode["first_step_s"] == max(rank["first_step"] for rank in ranks), name
        assert mode["compile_time_s"] == mode["first_step_s"] - statistics.median(mode["step_times_s"]), name
        assert mode["compile_cpu_s"] == max(rank["compile_cpu"] for rank in ranks), name


def test_every_rank_of_every_mode_compiles_into_a_cache_of_its_own(quick_run: tuple[int, Path]) -> None:
    """Ranks sharing an Inductor cache split the C++ compiles (one compiles a kernel, its peer loads
    it): measured on the 12m GPT, plain compile's ranks took 39.3 and 16.2 s of CPU, so the largest
    rank's compile CPU said more about that race than about the mode."""
    _, modes = _modes(quick_run)
    caches = [rank["inductor_cache"] for mode in modes.values() for rank in mode["per_rank"]]
    assert len(set(caches)) == len(caches) == len(MODES) * 2, caches


def test_compile_phases_say_where_the_compile_went(quick_run: tuple[int, Path]) -> None:
    """Stage 3's compile shows Dynamo, AOTAutograd, the partition and our own passes (each timed as
    zerocompile.*) by torch's compile timers, and no C++ with the eager compiler; uncompiled DDP
    and FSDP2 time nothing and have no row."""
    exit_code, out = quick_run
    _, modes = _modes(quick_run)
    phases = modes["zero3-eager"]["compile_phases_s"]
    for column in ("Dynamo", "AOT trace", "partition", "zerocompile passes"):
        assert phases[column] > 0, (column, phases)
    assert phases["Inductor codegen"] == phases["C++"] == modes["zero3-eager"]["compiled_cpp_files"] == 0
    for name in ("ddp", "fsdp2"):
        assert not any(modes[name]["compile_phases_s"].values()), modes[name]["compile_phases_s"]
    table = (out / "bench.md").read_text().split("Compile phases")[1].split("ZeRO theory")[0]
    assert "| zero3-eager |" in table and "| ddp |" not in table and "| fsdp2 |" not in table


def test_interleaved_modes_are_timed_round_by_round(quick_run: tuple[int, Path]) -> None:
    """Each --interleave mode gets one timed step per round, every step a real (positive) time, split
    into forward, backward and optimizer step."""
    summary, _ = _modes(quick_run)
    interleaved = summary["interleaved"]
    steps = summary["settings"]["steps"]
    assert interleaved["modes"] == ["ddp", "fsdp2"]
    for name in interleaved["modes"]:
        assert len(interleaved["step_times_s"][name]) == steps
        assert all(seconds > 0 for seconds in interleaved["step_times_s"][name])
        times = interleaved["step_times_s"][name]
        assert min(times) <= interleaved["step_time_s"][name] <= max(times)
        phases = interleaved["phase_s"][name]
        assert list(phases) == ["forward", "backward", "optimizer"]
        assert all(0 < seconds < max(times) for seconds in phases.values())
    ddp, fsdp2 = (interleaved["step_times_s"][name] for name in ("ddp", "fsdp2"))
    ratios = sorted(f / d for f, d in zip(fsdp2, ddp))
    quartiles = interleaved["paired_ratio"]["fsdp2"]["ddp"]
    assert ratios[0] <= quartiles["p25"] <= quartiles["median"] <= quartiles["p75"] <= ratios[-1]
    assert quartiles["median"] == pytest.approx(statistics.median(ratios))
    table = (quick_run[1] / "bench.md").read_text().split("Interleaved:")[1]
    assert "| fsdp2 |" in table and "| forward ms | backward ms | optimizer ms |" in table
    assert f"| {quartiles['median']:.2f} ({quartiles['p25']:.2f}-{quartiles['p75']:.2f}) |" in table


OFFLOAD_LAYERS = 1


@pytest.fixture(scope="module")
def offload_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """zero3 and zero3-offload interleaved, on a one-block tiny GPT in the default --offload-dir.
    Both compile with Inductor, into each rank's one cache: 40 s here, 110 s under other load."""
    out = tmp_path_factory.mktemp("offload-bench")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["--quick", "--ranks", "2", "--layers", str(OFFLOAD_LAYERS), "--modes", "none", "--interleave", "zero3,zero3-offload"]
    assert bench.run(parser.parse_args([*argv, "--out", str(out)])) == 0
    return json.loads((out / "bench.json").read_text()) | {"table": (out / "bench.md").read_text()}


def test_offload_mode_steps_as_zero3_does_bit_for_bit(offload_run: dict) -> None:
    """The streamed step from disk is the optimizer's own step on the same values, so every round's
    loss, warm-up included, equals zero3's exactly."""
    losses = offload_run["interleaved"]["losses"]
    settings = offload_run["settings"]
    assert len(losses["zero3"]) == settings["warmup"] + settings["steps"]
    assert losses["zero3-offload"] == losses["zero3"]


def test_offload_mode_records_its_state_on_disk_and_the_disks_floor(offload_run: dict) -> None:
    """Each rank's file holds AdamW's two fp32 moments of its padded 1/N parameter slice (8 bytes
    per shard element: what zero3 holds in memory as "optimizer"); a step reads and writes them
    once; the floor is that at the bandwidth measured in the run; and the bound compares the
    optimizer phase on disk with zero3's in the same rounds."""
    interleaved = offload_run["interleaved"]
    assert list(interleaved["optimizer_on_disk"]) == ["zero3-offload"], "no mode's optimizer state was on disk"
    disk = interleaved["optimizer_on_disk"]["zero3-offload"]
    with torch.device("meta"):
        model = GPT(dataclasses.replace(SIZES["tiny"], n_layer=OFFLOAD_LAYERS))
    ranks = offload_run["settings"]["ranks"]
    shard_elements = sum(shard_numel(p.shape, ranks) for p in {id(p): p for p in model.parameters()}.values())
    assert disk["state_bytes"] == 8 * shard_elements
    assert disk["moved_bytes_per_step"] == 2 * disk["state_bytes"]
    bandwidth = disk["bandwidth_bytes_per_s"]
    assert bandwidth["read"] > 0 and bandwidth["write"] > 0
    assert disk["floor_s"] == disk["state_bytes"] / bandwidth["read"] + disk["state_bytes"] / bandwidth["write"]
    # The default --offload-dir: a directory of the run's own, in its temporary directory.
    assert disk["directory"].startswith(str(Path(tempfile.gettempdir(), "zerocompile-bench-")))
    phases = interleaved["phase_s"]
    assert disk["optimizer_phase_s"] == phases["zero3-offload"]["optimizer"]
    assert (disk["in_memory_mode"], disk["in_memory_optimizer_phase_s"]) == ("zero3", phases["zero3"]["optimizer"])
    assert disk["bound_s"] == 1.3 * max(disk["in_memory_optimizer_phase_s"], disk["floor_s"])
    assert disk["within_bound"] == (disk["optimizer_phase_s"] <= disk["bound_s"])
    assert "optimizer_on_disk" in offload_run["method"]


def test_offload_table_shows_the_bound(offload_run: dict) -> None:
    disk = offload_run["interleaved"]["optimizer_on_disk"]["zero3-offload"]
    table = offload_run["table"].split("Optimizer state on disk, in ")[1]
    (row,) = [line for line in table.splitlines() if line.startswith("| zero3-offload | interleaved |")]
    cells = [cell.strip() for cell in row.strip("| ").split("|")]
    ms = {key: f"{disk[key] * 1e3:.1f}" for key in ("floor_s", "optimizer_phase_s", "in_memory_optimizer_phase_s", "bound_s")}
    verdict = "within" if disk["within_bound"] else "OVER"
    assert cells[2:] == [
        f"{disk['state_bytes'] / 1e6:.2f}",
        f"{disk['bandwidth_bytes_per_s']['write'] / 1e6:.0f} / {disk['bandwidth_bytes_per_s']['read'] / 1e6:.0f}",
        f"{disk['moved_bytes_per_step'] / 1e6:.2f}",
        ms["floor_s"], ms["optimizer_phase_s"], f"{ms['in_memory_optimizer_phase_s']} (zero3)", ms["bound_s"], verdict,
    ]


def test_offload_dir_must_exist_and_its_help_warns_of_tmpfs(tmp_path: Path) -> None:
    """The default lies under $TMPDIR or /tmp, often a tmpfs, where the state "on disk" is in RAM."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert "on a tmpfs the state still uses RAM, and zerocompile warns so" in " ".join(parser.format_help().split())
    assert parser.parse_args(["--offload-dir", str(tmp_path)]).offload_dir == tmp_path.resolve()
    with pytest.raises(SystemExit):
        parser.parse_args(["--offload-dir", str(tmp_path / "missing")])


def test_interleave_needs_two_different_modes() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    for bad in ("zero3", "zero3,zero3", "zero3,nope"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--interleave", bad])
    assert parser.parse_args(["--interleave", "none"]).interleave == []


@pytest.mark.parametrize("mode, share", [("zero3-budget", 0.5), ("zero3-keep", 1.0)])
def test_zero3_budget_modes_keep_their_share_of_the_models_bytes(single_rank, mode: str, share: float) -> None:
    model = GPT(SIZES["tiny"])
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    BENCH_MODES[mode].build(model, "adamw")
    settings = {(info.config.stage, info.config.memory_budget) for info in map(zc.sharded_parameters.shard_info, model.parameters())}
    assert settings == {(3, int(full * share))}


def test_offload_cpu_mode_keeps_its_optimizer_state_in_host_memory(single_rank) -> None:
    """zero3-offload-cpu: its optimizers exist before shard(), which moves their state to host
    memory (HostState); built for muon too (torch's Muon, made zerocompile's by shard())."""
    for kind in OPTIMIZERS:
        model = GPT(SIZES["tiny"])
        prepared = BENCH_MODES["zero3-offload-cpu"].build(model, kind)
        assert {info.config.offload for info in map(zc.sharded_parameters.shard_info, model.parameters())} == {"cpu"}
        assert all(isinstance(zerocompile.offload.offloaded_state(o), zerocompile.offload.HostState) for o in prepared.optimizers)


def test_compile_cost_modes_use_the_eager_compilers_on_a_deeper_gpt(single_rank, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--layers` deepens the size's GPT; compile-aot-eager and zero3-eager train without Inductor."""
    import torch._inductor.compile_fx

    def no_inductor(*args, **kwargs):
        raise AssertionError("Inductor compiled a graph")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", no_inductor)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model-size", "tiny", "--layers", "5", "--modes", "compile-aot-eager,zero3-eager"])
    settings = Settings(
        ranks=1, model_size=args.model_size, layers=args.layers, steps=1, warmup=1, batch_size=1, seed=0,
        modes=tuple(args.modes), interleave=(), cache_root="", device=None,
    )
    assert settings.config.n_layer == 5 and settings.config.n_embd == SIZES["tiny"].n_embd
    batch = torch.randint(0, SIZES["tiny"].vocab_size, (1, 8))
    for name in args.modes:
        torch._dynamo.reset()
        BENCH_MODES[name].build(GPT(settings.config), "adamw").runner(batch, batch).backward()


def test_interleaved_modes_trace_gpt_code_of_their_own() -> None:
    """Dynamo's per-code state (a frame it gave up on) must not leak between modes of one process:
    FSDP2+compile gives up on GPT.forward, and zero3 sharing that code object ran eagerly."""
    first, second = (gpt_class_of_its_own(name) for name in ("fsdp2-compile", "zero3"))
    codes = [cls.forward.__code__ for cls in (first, second, GPT)]
    assert len({id(code) for code in codes}) == 3
    models = []
    for cls in (first, GPT):
        torch.manual_seed(0)
        models.append(cls(SIZES["tiny"]))
    copy, original = (model.state_dict() for model in models)
    assert copy.keys() == original.keys()
    assert all(torch.equal(copy[key], original[key]) for key in original)


def test_bench_help_documents_the_device_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["bench", "--help"])  # what `zerocompile bench --help` prints
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    documented = (
        "--device DEVICE where every mode's model, batches and loss live, and which backend the ranks start "
        "(cpu: gloo, cuda: nccl; default: cuda:LOCAL_RANK under NCCL, which runs where CUDA exists, else cpu)"
    )
    assert documented in " ".join(shown.split()), shown


def test_by_default_every_rank_trains_on_the_groups_device(quick_run: tuple[int, Path]) -> None:
    """No --device: each rank asks its process group, gloo's is the CPU."""
    summary, modes = _modes(quick_run)
    assert summary["settings"]["device"] is None and summary["settings"]["backend"] == "gloo"
    for mode in modes.values():
        assert [rank["device"] for rank in mode["per_rank"]] == ["cpu"] * summary["settings"]["ranks"], mode["mode"]


def test_device_flag_reaches_the_ranks(tmp_path: Path) -> None:
    """--device is where every rank builds its model and batches. The meta device has no data, so
    there each rank's first step fails naming it, where the default (the CPU) would train."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["--quick", "--ranks", "2", "--modes", "ddp", "--interleave", "none", "--device", "meta"]
    args = parser.parse_args([*argv, "--out", str(tmp_path)])
    assert args.device == torch.device("meta")
    summary = run_bench(args)
    assert summary["settings"]["device"] == "meta"
    (mode,) = summary["modes"]
    assert mode["status"] == "failed", mode
    assert [("meta" in rank["error"]) for rank in mode["per_rank"]] == [True, True], mode["error"]


FAKE_MODES = ("compile-bf16", "fsdp2-compile-bf16", "zero3-bf16")
FAKE_RANKS = 8


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The three mixed-precision modes as rank 0 of 8 on a fake group, as on one GPU but on the CPU,
    on a one-block tiny GPT. Each compiles with Inductor (a fresh cache per mode): ~25 s of CPU per mode here."""
    out = tmp_path_factory.mktemp("fake-bench")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["--quick", "--fake-ranks", str(FAKE_RANKS), "--batch-size", str(FAKE_RANKS), "--device", "cpu", "--layers", "1"]
    # --inductor-cache: the caches stay for test_inductor_cache_is_kept_for_the_next_run.
    args = parser.parse_args([*argv, "--modes", ",".join(FAKE_MODES), "--inductor-cache", str(out / "caches"), "--out", str(out)])
    assert bench.run(args) == 0
    return json.loads((out / "bench.json").read_text()) | {"table": (out / "bench.md").read_text(), "out": out}


def test_fake_ranks_run_every_mode_in_one_process_of_a_world_of_n(fake_run: dict) -> None:
    """One process per mode, rank 0 of a fake group of 8: nothing is sent, so bytes sent and the
    losses (from uninitialised collective outputs) are reported as not measured, not as numbers."""
    assert fake_run["settings"]["fake"] and fake_run["settings"]["backend"] == "fake"
    assert [mode["mode"] for mode in fake_run["modes"]] == list(FAKE_MODES)
    for mode in fake_run["modes"]:
        assert mode["status"] == "ok", mode
        (rank,) = mode["per_rank"]
        assert (rank["world_size"], rank["device"]) == (FAKE_RANKS, "cpu"), mode["mode"]
        assert mode["sent_bytes_per_step"] is None and mode["device_peak_run_bytes"] is None
        assert f"| {mode['mode']} |" in fake_run["table"]
        assert "| n/a | n/a |" in fake_run["table"].split(f"| {mode['mode']} |")[1].splitlines()[0]
    assert fake_run["interleaved"] is None


def test_fake_ranks_hold_one_ranks_model_state(fake_run: dict) -> None:
    """zero3-bf16 holds fp32 master shards, fp32 gradient shards and AdamW's two fp32 moments of
    each distinct parameter's padded 1/8 slice (`shard_numel`): 16 bytes per shard element, about
    4 % above 16Φ/8 for the tiny GPT's small parameters, so the formula, not 16Φ/8, is what it must
    equal. FSDP2's dim-0 chunks divide the tiny GPT evenly, 16Φ/8; plain compile holds the whole 16Φ.
    A group that ran as world size 1 would show 8x these (checked by breaking it)."""
    modes = {mode["mode"]: mode["model_state_bytes"] for mode in fake_run["modes"]}
    with torch.device("meta"):
        model = GPT(dataclasses.replace(SIZES["tiny"], n_layer=1))
    shard_elements = sum(shard_numel(p.shape, FAKE_RANKS) for p in {id(p): p for p in model.parameters()}.values())
    assert modes["zero3-bf16"] == {"params": 4 * shard_elements, "grads": 4 * shard_elements, "optimizer": 8 * shard_elements}
    phi = fake_run["settings"]["phi"]
    assert sum(modes["fsdp2-compile-bf16"].values()) == pytest.approx(16 * phi / FAKE_RANKS, rel=0.01)
    assert sum(modes["compile-bf16"].values()) == 16 * phi


def test_inductor_cache_is_kept_for_the_next_run(fake_run: dict) -> None:
    """A sweep of link rates compiles the same graphs once per run: with --inductor-cache each mode
    compiles into its cache under DIR, which outlives the run (without it, a temporary directory
    removed at the end) and holds the compiled kernels a later run loads."""
    caches = fake_run["out"] / "caches"
    for mode in fake_run["modes"]:
        (rank,) = mode["per_rank"]
        assert Path(rank["inductor_cache"]).parent.parent == caches.resolve(), rank["inductor_cache"]
        assert any(Path(rank["inductor_cache"]).rglob("*.so")), f"no compiled kernel kept for {mode['mode']}"
    assert "kept in" in fake_run["method"]["compile_time"]


def test_fake_ranks_refuse_interleaving_and_real_ranks(tmp_path: Path) -> None:
    """--interleave needs real ranks side by side, and --ranks contradicts --fake-ranks, even
    given its default value (argparse would let that through)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--fake-ranks", "2", "--interleave", "ddp,fsdp2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--interleave"):
        run_bench(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["--ranks", "2", "--fake-ranks", "2"])


def test_muon_modes_step_as_torchs_muon_does(single_rank) -> None:
    """`--optimizer muon` on one rank: DDP's torch.optim.Muon, FSDP2's full_tensor() recipe and
    zerocompile's stage 3 take the same two steps (Newton-Schulz in bf16 on the same gradients;
    measured 0.0 apart), and AdamW's would go elsewhere."""
    batch = torch.randint(0, SIZES["tiny"].vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    trained = {}
    for name, optimizer in [("ddp", "muon"), ("fsdp2", "muon"), ("zero3-eager", "muon"), ("ddp", "adamw")]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(SIZES["tiny"])
        prepared = BENCH_MODES[name].build(model, optimizer)
        assert len(prepared.optimizers) == (2 if optimizer == "muon" else 1)
        for _ in range(2):
            prepared.runner(batch[:, :-1], batch[:, 1:]).backward()
            for one in prepared.optimizers:
                one.step()
                one.zero_grad()
        with zc.gathered(model) if name.startswith("zero") else contextlib.nullcontext():
            trained[(name, optimizer)] = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
            }
    reference = trained[("ddp", "muon")]

    def apart(other: dict[str, torch.Tensor]) -> float:
        return max((other[n] - reference[n]).abs().max().item() for n in reference)

    assert apart(trained[("fsdp2", "muon")]) <= 1e-6
    assert apart(trained[("zero3-eager", "muon")]) <= 1e-6
    assert apart(trained[("ddp", "adamw")]) > 1e-3
