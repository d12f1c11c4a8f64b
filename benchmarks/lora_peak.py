"""Peak memory of a LoRA fine-tune whose base is larger than one rank's share, by route.

`prepare` writes a randomly initialised Llama in bfloat16 with `save_pretrained` (several files).
`run` then fine-tunes a LoRA adapter of it on 2 ranks at stage 3 (bf16 compute, fp32 adapter) for
`--steps` AdamW steps, each route in fresh rank processes:

- `meta`: `zc.from_pretrained(path, stage=3, lora=LoraConfig(...))`: the base built on meta, each
  rank reading its own shards' bytes, the adapter attached on meta;
- `whole`: what the route was before: transformers' `from_pretrained` (the whole base on every
  rank), `get_peft_model`, then `zc.shard`.

Per rank: the rise of VmHWM (after /proc/self/clear_refs) over VmRSS before the model is built, to
the end of the last step, against base bytes / 2 + the adapter's state (parameters, gradients and
AdamW's two moments in fp32, whole) + 1 GiB; and the losses.

    python -m benchmarks.lora_peak prepare --out /tmp/llama-2b
    python -m benchmarks.lora_peak run --base /tmp/llama-2b --route meta --route whole
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from zerocompile.tools import spawn
from zerocompile.tools.measuring import reset_peak_rss, status_bytes

GiB = 2**30
# ~1.9B parameters (28 layers of 2048, GQA 16/8 heads, SwiGLU 8192, untied 32k vocabulary).
LLAMA_2B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=256)  # fmt: skip
LORA = dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)


def prepare(out: str, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_2B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")  # bf16 from the start: never the fp32 model in memory
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
    model.save_pretrained(out, max_shard_size="1GB")
    total = sum(p.numel() for p in model.parameters())
    print(f"wrote {total / 1e9:.2f}B parameters ({total * 2 / GiB:.2f} GiB in bf16) to {out}")


def _rank(rank: int, route: str, base: str, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from peft import LoraConfig
    from torch import nn

    import zerocompile as zc

    zc.init_distributed()
    zc.shard(nn.Linear(4, 4), stage=3)  # imports what the first shard() imports
    before = status_bytes("VmRSS")
    if not reset_peak_rss():
        raise RuntimeError("/proc/self/clear_refs refused: the peak cannot be taken")
    torch.manual_seed(0)
    if route == "meta":
        model = zc.from_pretrained(base, stage=3, lora=LoraConfig(**LORA), param_dtype=torch.bfloat16)
    else:
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM

        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype="auto"), LoraConfig(**LORA))
        zc.shard(model, stage=3, param_dtype=torch.bfloat16)
    built = status_bytes("VmHWM") - before
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    compiled = torch.compile(model, backend="zero", options={"compiler": "eager"})
    # One batch, seen every step: the loss falls if the adapter trains.
    tokens = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _step in range(steps):
        loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}.values()
    result = {
        "rise": status_bytes("VmHWM") - before,
        "built": built,
        "losses": losses,
        "base_bytes": sum(p.numel() * p.element_size() for p in frozen),
        "adapter_state_bytes": 4 * 4 * sum(p.numel() for p in trainable),
        "base_dtype": str(next(iter(frozen)).dtype),
        "adapter_dtype": str(trainable[0].dtype),
    }
    dist.barrier()
    return result


def run(base: str, routes: list[str], steps: int, report: str | None) -> None:
    preload = spawn.find_allocator("auto")
    print(spawn.allocator_line(preload), flush=True)
    results = {}
    for route in routes:
        reports = spawn.spawn_ranks(_rank, 2, (route, base, steps), preload=preload, timeout=3600)
        results[route] = reports
        for rank, one in enumerate(reports):
            bound = one["base_bytes"] / 2 + one["adapter_state_bytes"] + GiB
            print(
                f"{route:5s} rank {rank}: peak rise {one['rise'] / GiB:.2f} GiB (after the build {one['built'] / GiB:.2f}) "
                f"against base/2 + adapter state + 1 GiB = {bound / GiB:.2f} GiB: {'within' if one['rise'] <= bound else 'OVER'}; "
                f"base {one['base_bytes'] / GiB:.2f} GiB {one['base_dtype']}, adapter {one['adapter_dtype']}; "
                f"losses {[round(x, 4) for x in one['losses']]}",
                flush=True,
            )
    if report:
        Path(report).write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("prepare")
    made.add_argument("--out", required=True)
    made.add_argument("--layers", type=int, default=LLAMA_2B["num_hidden_layers"])
    measured = commands.add_parser("run")
    measured.add_argument("--base", required=True)
    measured.add_argument("--route", action="append", choices=("meta", "whole"), required=True)
    measured.add_argument("--steps", type=int, default=3)
    measured.add_argument("--report")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.out, args.layers)
    else:
        run(args.base, args.route, args.steps, args.report)


if __name__ == "__main__":
    from benchmarks.lora_peak import main as main_of_the_module  # the ranks import `_rank` by this name

    main_of_the_module()
