"""`python -m benchmarks.offload_capacity`: one real run in spawned ranks (the small GPT, state on
disk), checked for what it must measure; no time or RSS value is asserted against a number (they
depend on the machine), only the figures' consistency with each other and with the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from benchmarks import offload_capacity
from zerocompile.offload import STEP_BUCKET_BYTES
from zerocompile.passes.stages import shard_numel
from zerocompile.tools.gpt import GPT, SIZES

STEPS = 2


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    offload_capacity.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module", params=[None, "bf16"], ids=["fp32", "bf16-masters-on-disk"])
def small_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, Path]:
    root = tmp_path_factory.mktemp("offload-capacity")
    (root / "state").mkdir()
    argv = ["--size", "small", "--offload-dir", str(root / "state"), "--steps", str(STEPS), "--json", str(root / "report.json")]
    code = offload_capacity.run(_args(*argv, *(["--param-dtype", request.param] if request.param else [])))
    return code, json.loads((root / "report.json").read_text()), root / "state"


def test_the_run_reports_each_ranks_state_on_disk_and_what_each_step_moved(small_run) -> None:
    code, report, directory = small_run
    assert report["status"] == "ok", report.get("error")
    with torch.device("meta"):
        params = {id(p): p for p in GPT(SIZES["small"]).parameters()}.values()
    assert report["phi"] == sum(p.numel() for p in params)
    shard_bytes = 4 * sum(shard_numel(p.shape, 2) for p in params)
    masters = report["settings"]["param_dtype"] is not None
    for rank in report["per_rank"]:
        held = rank["held"]
        # fp32 shards and gradients in memory, AdamW's two moments of the same shard on disk; with
        # --param-dtype bf16 the shards and gradients held are bf16 and the fp32 masters join the disk.
        in_memory = shard_bytes // 2 if masters else shard_bytes
        assert held["params"] == held["grads"] == in_memory
        assert held["optimizer"] == 0 and held["optimizer_on_disk"] == (3 if masters else 2) * shard_bytes
        assert rank["bound"] == 2 * in_memory + 2 * STEP_BUCKET_BYTES + offload_capacity.SLACK_BYTES
        assert rank["within_bound"] == (rank["peak_rss"] <= rank["bound"])
        assert len(rank["steps"]) == STEPS
        # Every step writes the whole state back (the page cache may spare the reads).
        assert all(step["disk_write_bytes"] >= held["optimizer_on_disk"] for step in rank["steps"])
    assert code == (0 if report["within_bound"] else 1)
    assert not list(directory.iterdir()), "the ranks' state files outlived them"


def test_exact_rss_needs_glibc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--exact-rss lowers glibc's mmap threshold, meaningless under a preloaded tcmalloc: refused
    before any rank starts (the allocator the ranks would preload is set here, installed or not)."""
    monkeypatch.setattr(offload_capacity.spawn, "find_allocator", lambda choice: "/usr/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(offload_capacity, "spawn_ranks", lambda *args: pytest.fail("ranks started"))
    assert offload_capacity.run(_args("--size", "small", "--offload-dir", str(tmp_path), "--exact-rss")) == 2
