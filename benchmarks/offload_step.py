"""The optimizer step with its state on disk (`offload="disk"`) beside the same step in memory.

One process, a one-rank gloo group: two copies of the bundled GPT built on meta and sharded at
stage 3 with the same seed, one with its AdamW state in memory, one with it on disk under
--offload-dir. Both get the same gradients once (one backward each); then their `optimizer.step()`
calls alternate, --steps each, timed one by one, so machine noise falls on both alike. In the same
run the directory's disk bandwidth is measured on a file of the state's size: written and
fsync'd, evicted from the page cache (its own pages only), and read back.

Reports the median step of each, their ratio, the bytes a step moves through the disk (its
state read and written: 2 x the state) and that floor at the measured bandwidth, and the
issue's criterion: on-disk step <= 1.3 x max(in-memory step, bytes / bandwidth).

    python -m benchmarks.offload_step --model-size 200m --offload-dir /nvme/zc --steps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _model(size: str, settings: dict):
    import torch

    import zerocompile as zc
    from zerocompile.tools.gpt import GPT, SIZES

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(SIZES[size])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    zc.shard(model, stage=3, optimizer=optimizer, init=GPT._init_weights, **settings)
    tokens = torch.randint(model.config.vocab_size, (1, model.config.block_size + 1), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    return model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="50m")
    parser.add_argument("--offload-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import torch

    import zerocompile as zc
    from zerocompile import offload_files

    zc.init_distributed()
    memory_model, in_memory = _model(args.model_size, {})
    disk_model, on_disk = _model(args.model_size, {"offload": "disk", "offload_dir": str(args.offload_dir)})
    times: dict[str, list[float]] = {"memory": [], "disk": []}
    for _ in range(args.steps):
        for name, optimizer in (("memory", in_memory), ("disk", on_disk)):
            started = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - started)
    same = all(torch.equal(a, b) for a, b in zip(memory_model.parameters(), disk_model.parameters()))
    state_bytes = zc.model_state_bytes(disk_model, on_disk)["optimizer_on_disk"]
    bandwidth = offload_files.measure_disk_bandwidth(args.offload_dir, state_bytes)
    memory_step, disk_step = statistics.median(times["memory"]), statistics.median(times["disk"])
    moved = 2 * state_bytes
    floor = state_bytes / bandwidth["read"] + state_bytes / bandwidth["write"]
    bound = 1.3 * max(memory_step, floor)
    result = {
        "model_size": args.model_size,
        "params": zc.full_numel(disk_model),
        "state_bytes": state_bytes,
        "step_s": {"memory": times["memory"], "disk": times["disk"]},
        "median_s": {"memory": memory_step, "disk": disk_step},
        "ratio": disk_step / memory_step,
        "bandwidth_bytes_per_s": bandwidth,
        "moved_bytes": moved,
        "floor_s": floor,
        "bound_s": bound,
        "within_bound": disk_step <= bound,
        "parameters_equal": same,
    }
    print(
        f"GPT {args.model_size} (Φ = {result['params']:,}), AdamW state {state_bytes / 2**20:,.0f} MiB: step in memory "
        f"{memory_step:.3f} s, on disk {disk_step:.3f} s ({result['ratio']:.2f}x); disk {bandwidth['write'] / 2**20:,.0f} MiB/s "
        f"write, {bandwidth['read'] / 2**20:,.0f} MiB/s read: {moved / 2**20:,.0f} MiB moved, floor {floor:.3f} s; "
        f"bound 1.3 x max = {bound:.3f} s: {'within' if result['within_bound'] else 'OVER'}; parameters equal: {same}"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
