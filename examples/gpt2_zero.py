"""ZeRO stage 3 for a Hugging Face GPT-2, inside torch.compile: a tutorial you can run.

## 0. Launch

    torchrun --nproc_per_node=2 examples/gpt2_zero.py                  # one machine, 2 ranks
    torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=HOST0 --master_port=29500 \\
        examples/gpt2_zero.py                                          # on HOST0; node_rank=1 on HOST1
    srun --ntasks=2 python examples/gpt2_zero.py                       # inside a Slurm allocation
    python examples/gpt2_zero.py                                       # alone: one rank

Needs `pip install -e ".[hf]"` (transformers). Nothing is downloaded: the model is a tiny GPT-2 with
random weights and the text is the prose shipped with zerocompile, read as bytes (vocabulary 256),
so no tokenizer is needed either. `--save DIR` writes the trained model in Hugging Face's layout
(`zc.save_weights` beside `config.save_pretrained`): `GPT2LMHeadModel.from_pretrained(DIR)` loads
it with no zerocompile installed, and `--load DIR` starts from such a directory.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import zerocompile as zc
from zerocompile.tools.train import GlobalBatches, load_text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over the ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "eager"))
    parser.add_argument(
        "--device", type=torch.device, default=None,
        help="where batches go (default: the process group's device, cuda:LOCAL_RANK under NCCL, else cpu)",
    )  # fmt: skip
    parser.add_argument(
        "--shard-size", type=lambda text: text if text == "node" else int(text), default=None,
        help="hybrid sharding: shard within groups of this many ranks ('node': each node's), replicate across",
    )  # fmt: skip
    parser.add_argument("--save", metavar="DIR", help="write the trained model here (from_pretrained reads it)")
    parser.add_argument("--load", metavar="DIR", help="start from these weights (what save_pretrained wrote)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()

    # 1.1 Start torch.distributed from torchrun's or srun's environment (alone: a one-rank group).
    rank, world_size = zc.init_distributed(device=args.device)
    if args.batch_size % world_size:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {world_size} ranks")
    rows = slice(rank * args.batch_size // world_size, (rank + 1) * args.batch_size // world_size)
    # shard() materialises the meta-built model on the process group's device; batches go there too.
    device = args.device if args.device is not None else zc.distributed.group_device(torch.distributed.group.WORLD)

    # 1.2 Create the model on the meta device: shapes only, no memory, however large the model.
    config = GPT2Config(
        vocab_size=256, n_positions=args.seq_len, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)  # its input and output embeddings are one tied Parameter
    # HF chooses the loss by class name and "GPT2LMHeadModel" matches none, so every forward would
    # log a warning, which is a graph break under torch.compile. Name the loss instead.
    model.loss_type = "ForCausalLM"

    # 1.3 Shard it: each rank allocates only its 1/world_size of every parameter and fills it with
    # HF's own initialisation (the same seed on every rank, so they agree without communicating),
    # then optionally with pretrained weights, reading only its own bytes of the files. The
    # compiled graphs gather each layer just before use and free it after; gradients and the
    # AdamW state are 1/world_size too.
    torch.manual_seed(0)
    zc.shard(model, stage=args.stage, init=model._init_weights, shard_size=args.shard_size)
    if args.load:
        zc.load_weights(model, args.load)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    compiled = torch.compile(model, backend="zero", options={"compiler": args.compiler})

    # 1.4 Data: each rank reads its rows of the same global batch (a DistributedSampler's job).
    batches = GlobalBatches(load_text(), args.batch_size, args.seq_len, seed=0)

    # 1.5 Train as usual. HF shifts the labels by one token itself.
    for step in range(1, args.steps + 1):
        input_ids, _next_tokens = batches.next(rows)
        input_ids = input_ids.to(device)
        loss = compiled(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step:3d} | loss {loss.item():.4f} (rank 0's rows)", flush=True)
    if rank == 0:
        held = zc.model_state_bytes(model, optimizer)
        print(f"model state on this rank: {sum(held.values()) / 2**20:.2f} MiB ({held})", flush=True)

    # 1.6 Save an ordinary HF checkpoint: every rank takes part, rank 0 writes one tensor at a time.
    if args.save:
        if rank == 0:
            config.save_pretrained(args.save)
        zc.save_weights(model, args.save)
        if rank == 0:
            print(f"saved to {args.save}", flush=True)
    torch.distributed.barrier()  # no rank tears the group down while another still uses it
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
