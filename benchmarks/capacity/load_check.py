"""--load-check: the memory bounds of loading and saving weights, meta route against plain route."""

from __future__ import annotations

import shutil
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zerocompile as zc
from zerocompile.tools.gpt import GPT, SIZES

from .job import gather_on_rank_zero, rank_setup
from .measure import GB, MB, Sampler, process_memory, reset_peak
from .parent import EXACT_RSS_ENVIRONMENT, malloc_text, spawn_ranks, wait_for_memory
from .prediction import BASELINE_BYTES, model_facts

SLACK_BYTES = 64 * MB  # the "+ 64 MB" of the load and save bounds (10^6 bytes per MB)


def _prepare_weights_rank(rank: int, size: str, seed: int, path: str) -> None:
    """A one-rank job: the GPT built on meta, sharded over a 1-rank group, its weights saved."""
    zc.init_distributed()  # a one-rank group (the spawner's WORLD_SIZE=1)
    with torch.device("meta"):
        model = GPT(SIZES[size])
    torch.manual_seed(seed)
    zc.shard(model, stage=3, init=GPT._init_weights)
    zc.save_weights(model, path)


def _load_rank(
    rank: int, route: str, size: str, ranks: int, seed: int, path: str, save_path: str
) -> list[dict[str, Any]] | None:
    """One rank of a load-check route (see the module docstring); rises in bytes over the RSS before."""
    rank_setup(ranks)
    measured: dict[str, Any] = {"rank": rank}
    try:
        torch.manual_seed(seed)
        if route == "meta":
            with torch.device("meta"):
                model = GPT(SIZES[size])
            before, kinds_before = reset_peak(), process_memory()
            with Sampler() as during_shard:
                zc.shard(model, stage=3, init=GPT._init_weights)
            shard_peak = process_memory()["VmHWM"]
            reset_peak()
            with Sampler() as during_load:
                zc.load_weights(model, path)
        else:
            before, kinds_before = reset_peak(), process_memory()
            with Sampler() as during_shard:
                model = GPT(SIZES[size])  # whole on the CPU
                zc.shard(model, stage=3)
            shard_peak = process_memory()["VmHWM"]
            reset_peak()
            with Sampler() as during_load:
                zc.load_weights(model, path)
        load_peak = process_memory()["VmHWM"]
        after = process_memory()
        anon = max(during_shard.peaks["RssAnon"], during_load.peaks["RssAnon"])
        file = max(during_shard.peaks["RssFile"], during_load.peaks["RssFile"])
        measured.update(
            rss_before=before,
            anon_before=kinds_before["RssAnon"],
            file_before=kinds_before["RssFile"],
            rise_anon=anon - kinds_before["RssAnon"],
            rise_file=file - kinds_before["RssFile"],
            rise=max(shard_peak, load_peak) - before,
            rise_by_shard=shard_peak - before,
            rise_by_load=load_peak - before,
            rss_after=after["VmRSS"],
            shard_peaks=during_shard.peaks,
            load_peaks=during_load.peaks,
            shard_bytes=sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values()),
        )
        if route == "meta":
            dist.barrier()
            save_before = reset_peak()
            with Sampler() as during_save:
                zc.save_weights(model, save_path)
            measured.update(save_rise=process_memory()["VmHWM"] - save_before, save_peaks=during_save.peaks,
                            save_rss_before=save_before)
    except Exception as error:
        measured.update(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
    return gather_on_rank_zero(measured)


def load_check(size: str, ranks: int, seed: int, wait_seconds: float) -> dict[str, Any]:
    """The load and save memory bounds (module docstring); a dict for the JSON."""
    facts = model_facts(SIZES[size])
    phi = facts.phi
    bounds = {
        "meta": 4 * phi / ranks + facts.largest_module_bytes + SLACK_BYTES,
        "plain": 4 * phi,
        "save": facts.largest_tensor_bytes + SLACK_BYTES,
    }
    result: dict[str, Any] = {
        "size": size, "phi": phi, "ranks": ranks, "stage": 3, "malloc": malloc_text(),
        "largest_module_bytes": facts.largest_module_bytes, "largest_tensor_bytes": facts.largest_tensor_bytes,
        "bounds": bounds,
    }
    # The plain route holds the whole model (4Φ) plus its shards on every rank, with slack.
    needed = ranks * (BASELINE_BYTES + 6 * phi) + 4 * phi
    ok, available = wait_for_memory(needed, wait_seconds)
    if not ok:
        result.update(status="skipped", reason=f"skipped: needs ~{needed / GB:.1f} GB, MemAvailable {available / GB:.1f} GB")
        return result
    tmp = Path(tempfile.mkdtemp(prefix="zerocompile-capacity-weights-"))
    try:
        weights = tmp / "model.safetensors"
        outcome = spawn_ranks(_prepare_weights_rank, 1, (size, seed, str(weights)))
        if outcome["status"] != "ok":
            return {**result, "status": "failed", "reason": f"writing the weights file: {outcome['error']}"}
        result["file_bytes"] = weights.stat().st_size
        for route in ("meta", "plain"):
            outcome = spawn_ranks(
                _load_rank,
                ranks,
                (route, size, ranks, seed, str(weights), str(tmp / "saved.safetensors")),
                EXACT_RSS_ENVIRONMENT,
            )
            if outcome["status"] != "ok":
                return {**result, "status": "failed", "reason": f"{route} route: {outcome['error']}"}
            per_rank = outcome["results"][0]
            errors = [f"rank {m['rank']}: {m['error']}" for m in per_rank if "error" in m]
            if errors:
                return {**result, "status": "failed", "reason": f"{route} route: {'; '.join(errors)}", route: per_rank}
            result[route] = per_rank
        if (tmp / "saved.safetensors").read_bytes() != weights.read_bytes():
            result["saved_file_differs"] = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta_rise = max(m["rise"] for m in result["meta"])
    plain_rise = min(m["rise"] for m in result["plain"])
    save_rise = result["meta"][0]["save_rise"]  # group rank 0 writes
    result.update(
        status="ok",
        meta_rise=meta_rise,
        plain_rise=plain_rise,
        save_rise=save_rise,
        met={"meta": meta_rise <= bounds["meta"], "plain": plain_rise >= bounds["plain"], "save": save_rise <= bounds["save"]},
    )
    if all("rise_anon" in m for m in result["meta"]):
        result.update(
            meta_rise_anon=max(m["rise_anon"] for m in result["meta"]),
            meta_rise_file=max(m["rise_file"] for m in result["meta"]),
        )
    return result


def load_check_table(check: dict[str, Any]) -> str:
    head = (
        f"Load and save check: GPT {check['size']} (Φ = {check['phi']:,}), N = {check['ranks']}, stage 3, "
        f"{check['malloc']} in the ranks (RSS follows live tensors); rise = peak RSS (VmHWM, reset through "
        "/proc/self/clear_refs) above the RSS just before, the largest rank (plain route: the smallest); "
        f"largest module's own parameters {check['largest_module_bytes'] / MB:.1f} MB, largest tensor "
        f"{check['largest_tensor_bytes'] / MB:.1f} MB, 64 MB = 64·10^6 bytes. The rise split into anonymous "
        "memory and file-backed pages (RssAnon, RssFile; peaks of a thread sampling every 2 ms): the "
        "safetensors file's mmap counts in the latter."
    )
    if check["status"] != "ok":
        return f"{head}\n\n{check['status']}: {check.get('reason', '')}\n"
    bounds, met = check["bounds"], check["met"]

    def per_rank(route: str, *keys: str) -> str:
        return " / ".join(" ; ".join(f"{m[key] / MB:.0f}" for key in keys) for m in check[route])

    yes = {True: "yes", False: "**NO**"}
    lines = [
        head,
        "",
        "| measured | rise MB | bound MB | met | per rank: rise by shard ; by load MB | per rank: anonymous ; file-backed MB |",
        "|---|---|---|---|---|---|",
        f"| meta build → shard(init) → load_weights | {check['meta_rise'] / MB:.0f} | ≤ {bounds['meta'] / MB:.0f} "
        f"(4Φ/N + largest module + 64 MB) | {yes[met['meta']]} | {per_rank('meta', 'rise_by_shard', 'rise_by_load')} "
        f"| {per_rank('meta', 'rise_anon', 'rise_file')} |",
        f"| CPU build → shard → load_weights | {check['plain_rise'] / MB:.0f} | ≥ {bounds['plain'] / MB:.0f} (4Φ) | "
        f"{yes[met['plain']]} | {per_rank('plain', 'rise_by_shard', 'rise_by_load')} "
        f"| {per_rank('plain', 'rise_anon', 'rise_file')} |",
        f"| save_weights, writing rank | {check['save_rise'] / MB:.0f} | ≤ {bounds['save'] / MB:.0f} (largest tensor + "
        f"64 MB) | {yes[met['save']]} | other ranks: "
        + " / ".join(f"{m['save_rise'] / MB:.0f}" for m in check["meta"][1:])
        + " | |",
    ]
    if "meta_rise_anon" in check:
        lines += [
            "",
            f"Anonymous memory alone, meta route: {check['meta_rise_anon'] / MB:.0f} MB (largest rank), against the "
            f"same bound {bounds['meta'] / MB:.0f} MB: {yes[check['meta_rise_anon'] <= bounds['meta']]}; file-backed "
            f"pages mapped while load_weights read: up to {check['meta_rise_file'] / MB:.0f} MB per rank, this rank's "
            f"share of the {check['file_bytes'] / MB:.0f} MB file being {check['file_bytes'] / check['ranks'] / MB:.0f} MB.",
        ]
    if check.get("saved_file_differs"):
        lines.append("\nThe saved file differs from the one loaded.")
    return "\n".join(lines) + "\n"
