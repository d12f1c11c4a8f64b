"""Dumps and `zerocompile dump`: what a 2-layer GPT at stage 3 writes, read back and checked against
the bytes the step really sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

import zerocompile as zc
import zerocompile.offload
from ranks import run_on_ranks
from training import train
from zerocompile.tools import dump
from zerocompile.tools.gpt import GPT, GPTConfig

# Large enough (Φ ≈ 0.1M) that gloo's per-message headers stay under 5 % of the bytes sent.
ONE_RANK_SCRIPT = (
    "import torch, zerocompile as zc\n"
    "zc.init_distributed()\n"
    "model = zc.shard(torch.nn.Linear(3, 5), stage=3)\n"
    "torch.compile(model, backend='zero', options={'compiler': 'eager'})(torch.randn(2, 3)).sum().backward()\n"
)
CONFIG = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=64)


def train_with_dump(rank: int, world_size: int, directory: str, stage: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    zc.shard(model, stage=stage)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager", "dump_dir": directory})
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(rank))
    sent, held = [], []

    def measure_held() -> None:
        held.append(zc.model_state_bytes(model, optimizer))

    train(lambda t: compiled(t[:, :-1], t[:, 1:]), optimizer, [tokens] * 2, sent=sent, after_step=measure_held)
    params = {id(p): p for p in model.parameters()}
    return {
        "sent": sent[-1],
        "distinct_params": len(params),
        "trainable": sum(p.requires_grad for p in params.values()),
        "held": held[-1],
    }


@pytest.fixture(scope="module")
def dumped(tmp_path_factory) -> dict:
    runs = {}
    for stage in (2, 3):
        directory = tmp_path_factory.mktemp(f"dump-stage{stage}")
        runs[stage] = (directory, run_on_ranks(2, train_with_dump, str(directory), stage, timeout=300))
    return runs


def test_dump_writes_each_graph_before_and_after_each_pass(dumped) -> None:
    directory, _ = dumped[3]
    names = {path.name.split("-", 1)[1] for path in (directory / "rank1").iterdir()}
    assert names == {
        "dynamo-before-merge_repeated_unshards.py",
        "dynamo-after-merge_repeated_unshards.py",
        "joint-before-tag_gathers_for_recompute.py",
        "joint-after-tag_gathers_for_recompute.py",
        "forward-before-lower_markers.py",
        "forward-after-lower_markers.py",
        "forward-ledger.json",
        "backward-before-lower_markers.py",
        "backward-after-lower_markers.py",
        "backward-ledger.json",
        # The ranks run on gloo, which takes one collective at a time.
        "forward-before-wait_before_each_collective.py",
        "forward-after-wait_before_each_collective.py",
        "backward-before-wait_before_each_collective.py",
        "backward-after-wait_before_each_collective.py",
        "forward-before-hold_until_gloo_releases.py",
        "forward-after-hold_until_gloo_releases.py",
        "backward-before-hold_until_gloo_releases.py",
        "backward-after-hold_until_gloo_releases.py",
    }
    (joint,) = (directory / "rank0").glob("*-joint-after-tag_gathers_for_recompute.py")
    assert "MUST_RECOMPUTE" in joint.read_text()
    (dynamo,) = (directory / "rank0").glob("*-dynamo-before-merge_repeated_unshards.py")
    assert dynamo.read_text().count("'wte.weight'") == 2, "the tied embedding is used twice before merging"


def test_ledger_lists_each_parameter_once_per_direction_and_every_free(dumped) -> None:
    directory, results = dumped[3]
    ledgers = dump.load(str(directory))["rank0"]
    (forward,) = [ledger for name, ledger in ledgers.items() if name.endswith("forward")]
    (backward,) = [ledger for name, ledger in ledgers.items() if name.endswith("backward")]
    gathers = [p for e in forward["entries"] if e["op"] == "all_gather" for p in e["params"]]
    assert sorted(gathers) == sorted(set(gathers)) and len(gathers) == results[0]["distinct_params"]
    reductions = [p for e in backward["entries"] if e["op"] != "all_gather" for p in e["params"]]
    assert sorted(reductions) == sorted(set(reductions)) and len(reductions) == results[0]["trainable"]
    regathered = {p for e in backward["entries"] if e["op"] == "all_gather" for p in e["params"]}
    assert "wte.weight" in regathered and "wpe.weight" not in regathered, "embedding lookups need no weight"
    for entry in forward["entries"] + backward["entries"]:
        if entry["op"] == "all_gather":
            assert entry["freed_after"] and entry["freed_position"] > entry["wait_position"]


@pytest.mark.parametrize("stage", (2, 3))
def test_dump_totals_match_bytes_sent(dumped, stage: int) -> None:
    directory, results = dumped[stage]
    ranks = dump.load(str(directory))
    for rank, result in zip(sorted(ranks), results):
        summary = dump.rank_summary(ranks[rank])
        # The dump's ledger against the bytes the rank wrote (wchar, gloo's framing included):
        # measured 0.9989-0.9990 at both stages.
        assert summary["sent"] == pytest.approx(result["sent"], rel=0.003)
        assert summary["params"] == result["held"]["params"]
        assert summary["grads"] == result["held"]["grads"]
        assert summary["optimizer"] == result["held"]["optimizer"]


def test_dump_command_reports_diffs_and_draws(dumped, tmp_path) -> None:
    (stage3, _), (stage2, _) = dumped[3], dumped[2]
    png = tmp_path / "timeline.png"
    cli = [sys.executable, "-m", "zerocompile.tools.cli", "dump"]
    shown = subprocess.run([*cli, str(stage3), "--png", str(png)], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "wte.weight" in shown.stdout and "freed after" in shown.stdout and "per step: gathered" in shown.stdout
    assert png.stat().st_size > 10_000
    compared = subprocess.run([*cli, str(stage2), "--diff", str(stage3)], capture_output=True, text=True, timeout=120)
    assert compared.returncode == 0, compared.stderr
    assert "+++ " in compared.stdout and "sent" in compared.stdout


def test_dump_lists_the_gathered_parameters_kept_for_the_backward(dumped) -> None:
    """Stage 2 keeps every gathered parameter its backward reads (what the forward saves, the
    backward receives; the position embedding's backward reads no weight); stage 3 without a
    memory budget keeps none. The report says so per graph and per step."""
    for stage in (2, 3):
        ledgers = dump.load(str(dumped[stage][0]))["rank0"]
        (forward,) = [ledger for name, ledger in ledgers.items() if name.endswith("forward")]
        (backward,) = [ledger for name, ledger in ledgers.items() if name.endswith("backward")]
        assert sorted(forward["kept_params"]) == sorted(backward["kept_params"])
        assert forward["kept_bytes"] == backward["kept_bytes"] == dump.rank_summary(ledgers)["kept"]
        text = dump.report({"rank0": ledgers})
        if stage == 2:
            assert "wte.weight" in forward["kept_params"] and "wpe.weight" not in forward["kept_params"]
            assert "saves gathered for the backward" in text and "receives gathered for the backward" in text
        else:
            assert forward["kept_params"] == [] and "gathered for the backward" not in text


def test_dump_report_summarises_parameters_and_verbose_lists_them(dumped) -> None:
    """The 2-layer GPT's single forward bucket reads as one short line; --verbose names all 28."""
    directory, _ = dumped[3]
    cli = [sys.executable, "-m", "zerocompile.tools.cli", "dump", str(directory)]
    shown = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "28 params: wte.weight, wpe.weight, blocks.{0,1}.* (24 params), ln_f.weight, ln_f.bias" in shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) <= 120, shown.stdout

    verbose = subprocess.run([*cli, "--verbose"], capture_output=True, text=True, timeout=120)
    assert verbose.returncode == 0, verbose.stderr
    names = {name for name, _ in GPT(CONFIG).named_parameters()}
    assert len(names) == 28 and all(name in verbose.stdout for name in names)
    assert "blocks.{0,1}" not in verbose.stdout


# ------------------------------------------------------------------------------- collapse_fqns

GPT2_BLOCK = ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "mlp.c_fc.weight", "mlp.c_fc.bias")
GPT2 = ["wte.weight", "wpe.weight", *(f"h.{i}.{name}" for i in range(12) for name in GPT2_BLOCK), "ln_f.weight"]


def test_whole_blocks_fold_to_a_star_with_their_count() -> None:
    assert dump.collapse_fqns(GPT2, GPT2) == "75 params: wte.weight, wpe.weight, h.{0..11}.* (72 params), ln_f.weight"


def test_names_differing_only_in_an_index_share_braces() -> None:
    fqns = ["h.0.attn.c_attn.weight", "h.1.attn.c_attn.weight"]
    assert dump.collapse_fqns(fqns, GPT2) == "2 params: h.{0,1}.attn.c_attn.weight"


def test_a_block_missing_a_parameter_is_not_a_star() -> None:
    """The backward re-gathers weights, not biases: its blocks are partial and say which names."""
    weights = [f"h.{i}.{name}" for i in (0, 1) for name in ("ln_1.weight", "attn.c_attn.weight")]
    assert dump.collapse_fqns(weights, GPT2) == "4 params: h.{0,1}.ln_1.weight, h.{0,1}.attn.c_attn.weight"
    first_whole = [name for name in GPT2 if name.startswith(("h.0.", "h.1.ln_1."))]
    assert dump.collapse_fqns(first_whole, GPT2) == "8 params: h.0.* (6 params), h.1.ln_1.weight, h.1.ln_1.bias"


def test_runs_of_three_or_more_indices_are_ranges() -> None:
    """a..b includes both ends; runs of two stay listed; indices sort as numbers, whatever the input order."""
    fqns = [f"h.{i}.attn.c_attn.weight" for i in (11, 0, 1, 2, 3, 6, 8, 9)]
    assert dump.collapse_fqns(fqns, GPT2) == "8 params: h.{0..3,6,8,9,11}.attn.c_attn.weight"
    every_block = [f"h.{i}.mlp.c_fc.weight" for i in range(12)]
    assert dump.collapse_fqns(every_block, GPT2) == "12 params: h.{0..11}.mlp.c_fc.weight"


def test_a_single_parameter() -> None:
    assert dump.collapse_fqns(["wte.weight"], GPT2) == "1 param: wte.weight"
    assert dump.collapse_fqns(["h.3.ln_1.bias"], GPT2) == "1 param: h.3.ln_1.bias"


def test_names_without_indices_and_tied_names_are_kept_as_given() -> None:
    """A tied weight's two names are both shown (the ledger lists one); a repeated name counts once."""
    assert dump.collapse_fqns(["ln_f.weight", "ln_f.bias"], GPT2) == "2 params: ln_f.weight, ln_f.bias"
    tied = ["transformer.wte.weight", "lm_head.weight", "transformer.wte.weight"]
    assert dump.collapse_fqns(tied, tied) == "2 params: transformer.wte.weight, lm_head.weight"


def test_nested_indices_and_indexed_leaves() -> None:
    experts = [f"layers.{layer}.experts.{e}.{w}" for layer in (0, 1) for e in range(4) for w in ("w1", "w2")]
    every = [*experts, "layers.0.gate.weight", "layers.1.gate.weight"]
    assert dump.collapse_fqns(experts, every) == "16 params: layers.{0,1}.experts.{0..3}.* (16 params)"
    assert dump.collapse_fqns(every, every) == "18 params: layers.{0,1}.* (18 params)"
    # A block holding one parameter is named, not starred; ParameterList entries are indices too.
    assert dump.collapse_fqns(["0.weight", "1.weight"], ["0.weight", "1.weight"]) == "2 params: {0,1}.weight"
    assert dump.collapse_fqns(["scales.0", "scales.1", "scales.2"], []) == "3 params: scales.{0..2}"


def test_a_long_summary_stops_at_max_chars_and_counts_the_rest() -> None:
    fqns = [f"h.{i}.{name}" for i in (0, 2, 4, 6, 8, 10) for name in GPT2_BLOCK[1:]]  # no block is whole
    line = dump.collapse_fqns(fqns, GPT2, max_chars=100)
    assert len(line) <= 100 and line.startswith("30 params: h.{0,2,4,6,8,10}.ln_1.bias, "), line
    shown = line.count("h.{0,2,4,6,8,10}.")
    assert line.endswith(f", ... +{30 - 6 * shown} more") and shown >= 2, line
    assert dump.collapse_fqns(fqns, GPT2, max_chars=500).count("h.{0,2,4,6,8,10}.") == 5


def test_dump_runs_a_command_with_dumping_on(tmp_path) -> None:
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK_SCRIPT)
    out = tmp_path / "dump"
    cli = [sys.executable, "-m", "zerocompile.tools.cli", "dump", str(out), "--", sys.executable, str(script)]
    shown = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "rank0" in shown.stdout and "weight" in shown.stdout
    assert json.loads(next(Path(out, "rank0").glob("*-forward-ledger.json")).read_text())["entries"]


def test_artifacts_reach_torch_structured_trace(tmp_path) -> None:
    """tlparse shows our graphs beside Dynamo's: they are in the TORCH_TRACE log."""
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK_SCRIPT)
    trace_dir = tmp_path / "trace"
    env = {**os.environ, "TORCH_TRACE": str(trace_dir)}
    subprocess.run([sys.executable, str(script)], check=True, timeout=120, env=env)
    logged = "".join(path.read_text() for path in trace_dir.iterdir())
    for artifact in ("dynamo-after-merge_repeated_unshards", "forward-after-lower_markers", "backward-ledger"):
        assert f"zerocompile_0_0-{artifact}" in logged, artifact


@pytest.mark.fast
def test_dump_adds_the_optimizer_steps_collectives_to_the_graphs(fake_two_ranks, tmp_path) -> None:
    """A Muon step's exchange goes to the dump after the compiled graphs' ledgers, and counts in
    the rank's bytes sent per step (on a fake group of 2 ranks: shapes and ledgers, no data)."""
    model = zc.shard(nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8)), stage=3, dump_dir=str(tmp_path))
    muon = zc.optim.Muon([p for p in model.parameters() if len(zc.full_shape(p)) == 2])
    torch.compile(model, backend="zero", options={"compiler": "eager"})(torch.randn(2, 8)).sum().backward()
    muon.step()
    graphs = dump.load(str(tmp_path))["rank0"]
    assert [ledger["kind"] for ledger in graphs.values()] == ["forward", "backward", "optimizer"]
    assert list(graphs)[-1] == "optimizer-muon@0.weight"
    exchange = graphs["optimizer-muon@0.weight"]
    assert [entry["op"] for entry in exchange["entries"]] == ["all_to_all", "all_to_all"]
    # Both 128-element matrices cost the same: 0.weight is rank 0's and 1.weight rank 1's. Rank 0
    # sends its 64-element bf16 slice of 1.weight, then rank 1's slice of 0.weight back.
    assert [entry["sent_bytes"] for entry in exchange["entries"]] == [128, 128]
    summary = dump.rank_summary(graphs)
    assert summary["sent"] == sum(ledger["sent_bytes"] for ledger in graphs.values()) > exchange["sent_bytes"] == 256
    report = dump.report({"rank0": graphs})
    assert "optimizer-muon@0.weight  (N=2, the optimizer's step)" in report
    assert "Muon: the orthogonalised slices back from their owners" in report


@pytest.mark.fast
def test_an_offloaded_optimizers_step_is_dumped_once_for_all_its_parameters(fake_two_ranks, tmp_path) -> None:
    """With offload the step's own code runs one bucket of parameters at a time; the ledger is
    still the whole step's (one bucket per parameter here), written once; beside it, what the
    offloaded state holds and moves per step."""
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))
    muon = torch.optim.Muon(model.parameters())
    with mock.patch.object(zerocompile.offload, "STEP_BUCKET_BYTES", 1):
        zc.shard(model, stage=3, optimizer=muon, offload="cpu", dump_dir=str(tmp_path))
    for _ in range(2):
        torch.compile(model, backend="zero", options={"compiler": "eager"})(torch.randn(2, 8)).sum().backward()
        muon.step()
    graphs = dump.load(str(tmp_path))["rank0"]
    optimizer_ledgers = [name for name, ledger in graphs.items() if ledger["kind"] == "optimizer"]
    assert optimizer_ledgers == ["optimizer-muon@0.weight"]
    assert [entry["params"] for entry in graphs["optimizer-muon@0.weight"]["entries"]] == [["0.weight", "1.weight"]] * 2
    # What the store holds and moves: Muon's momentum of two 64-element fp32 shards in host memory;
    # a step copies both shards and their gradients to the host and the shards back.
    (store,) = dump.load_offloads(str(tmp_path))["rank0"].values()
    assert (store["where"], store["state_bytes"], store["moved_bytes_per_step"], store["buckets"]) == ("in host memory", 512, 1536, 2)
    assert "optimizer-muon@0.weight: optimizer state in host memory, 512 B; per step 1.54 kB moved" in dump.report(
        {"rank0": graphs}, offloads=dump.load_offloads(str(tmp_path))
    )


def test_the_dump_counts_master_weights_in_the_store(fake_two_ranks, tmp_path) -> None:
    """With param_dtype the fp32 masters join the store: the two 64-element shards' 512 bytes; a
    step copies only their bf16 gradients to the host (256 B) and the bf16 shards back (256 B)."""
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))
    muon = torch.optim.Muon(model.parameters())
    zc.shard(model, stage=3, optimizer=muon, offload="cpu", param_dtype=torch.bfloat16, dump_dir=str(tmp_path))
    (store,) = dump.load_offloads(str(tmp_path))["rank0"].values()
    assert (store["state_bytes"], store["master_bytes"], store["moved_bytes_per_step"]) == (512, 512, 512)
    graphs = dump.load(str(tmp_path))["rank0"]
    assert "in host memory, 512 B and master weights 512 B; per step 512 B moved" in dump.report(
        {"rank0": graphs}, offloads=dump.load_offloads(str(tmp_path))
    )
