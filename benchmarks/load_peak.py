"""Peak memory of building a GPT on meta and loading its weights into shards, against the bound.

Each of 2 ranks: a warm-up `shard()` of a tiny model (the first call imports ~76 MB of modules),
then VmHWM reset (/proc/self/clear_refs), then `with torch.device("meta"): GPT(...)`,
`zc.shard(model, stage=3)` and `zc.load_weights(model, file)`; the rise of VmHWM over VmRSS
before the build is compared with this rank's shards + the largest module's full parameters
+ 64 MB (materialising goes one module at a time).

    python -m benchmarks.load_peak --model-size 200m --layers 8      # ~101M parameters
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from zerocompile.tools import spawn
from zerocompile.tools.gpt import SIZES
from zerocompile.tools.measuring import reset_peak_rss, status_bytes

MB = 2**20


def _rank(rank: int, size: str, layers: int, path: str) -> dict:
    import torch
    from torch import nn

    import zerocompile as zc
    from zerocompile.tools.gpt import GPT

    zc.init_distributed()
    zc.shard(nn.Linear(4, 4), stage=3)  # imports what the first shard() imports
    config = dataclasses.replace(SIZES[size], n_layer=layers)
    before = status_bytes("VmRSS")
    if not reset_peak_rss():
        raise RuntimeError("/proc/self/clear_refs refused: the peak of the build and the load cannot be taken")
    torch.manual_seed(0)  # shard() materialises the same initial values on every rank
    with torch.device("meta"):
        model = GPT(config)
    largest = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules())
    zc.shard(model, stage=3)
    built = {"rise": status_bytes("VmHWM") - before, "after": status_bytes("VmRSS") - before}
    zc.load_weights(model, path)
    shards = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    return {"rise": status_bytes("VmHWM") - before, "shards": shards, "largest": largest, "after": status_bytes("VmRSS") - before, "built": built}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", choices=sorted(SIZES), default="200m")
    parser.add_argument("--layers", type=int, default=8)
    spawn.add_allocator_argument(parser)
    args = parser.parse_args()
    preload = spawn.find_allocator(args.allocator)
    print(spawn.allocator_line(preload), flush=True)

    import torch
    from safetensors.torch import save_file

    from zerocompile.tools.gpt import GPT

    torch.manual_seed(0)
    model = GPT(dataclasses.replace(SIZES[args.model_size], n_layer=args.layers))
    phi = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "model.safetensors")
        save_file({name: value.contiguous() for name, value in model.state_dict().items() if name != "lm_head.weight"}, path)
        del model
        reports = spawn.spawn_ranks(_rank, 2, (args.model_size, args.layers, path), preload=preload, timeout=1200)
    for rank, report in enumerate(reports):
        bound = report["shards"] + report["largest"] + 64 * MB
        print(
            f"rank {rank}: Φ={phi / 1e6:.1f}M, peak rise {report['rise'] / MB:.0f} MB against bound {bound / MB:.0f} MB "
            f"(shards {report['shards'] / MB:.0f} + largest module {report['largest'] / MB:.0f} + 64): "
            f"{'within' if report['rise'] <= bound else 'OVER'}; held after {report['after'] / MB:.0f} MB; after shard() alone: peak rise {report['built']['rise'] / MB:.0f}, held {report['built']['after'] / MB:.0f} MB"
        )


if __name__ == "__main__":
    from benchmarks.load_peak import main as main_of_the_module  # the ranks import `_rank` by this name

    main_of_the_module()
