"""Train a GPT on the bundled prose with ZeRO, on CPU ranks it spawns (or torchrun's or srun's).

Shows the whole library at work in one command: `zc.shard()` at the chosen --stage, the "zero"
torch.compile backend, and the model state each rank holds against ZeRO's 16Φ/N. Without a
launcher it spawns --ranks processes (gloo on 127.0.0.1); under torchrun or srun it runs as the
rank they started. Every rank reads its own slice of the same global batch, so the loss curve
depends on --seed and --batch-size but not on the number of ranks.

The text is tools/data/prose.txt (original prose, CC0; see tools/data/README), read as bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch
import torch._inductor.config
import torch.distributed as dist
import torch.multiprocessing

import zerocompile as zc
from zerocompile.distributed import free_loopback_port, loopback_rank_environment
from zerocompile.tools.gpt import GPT, SIZES

MB = 1e6
BYTES_PER_PARAMETER = 16  # fp32 parameter 4 + gradient 4 + AdamW's exp_avg and exp_avg_sq 8


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `zerocompile train`; the defaults finish in well under 2 minutes on 2 cores."""
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3, help="ZeRO stage (default 3)")
    parser.add_argument(
        "--ranks", type=_positive_int, default=2, help="CPU ranks to spawn (default 2; ignored under torchrun/srun)"
    )
    parser.add_argument("--steps", type=_positive_int, default=200, help="optimizer steps (default 200)")
    parser.add_argument("--model-size", choices=sorted(SIZES), default="tiny", help="GPT size (default tiny)")
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        help="sequences per global batch, split over the ranks (default 64)",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches")
    parser.add_argument(
        "--compiler",
        choices=("inductor", "eager"),
        default="inductor",
        help="inductor generates code; eager runs the rewritten graphs op by op and compiles fast",
    )
    parser.add_argument("--log-every", type=_positive_int, default=10, help="print every this many steps (default 10)")


def run(args: argparse.Namespace) -> int:
    """`zerocompile train`: the exit code of the command."""
    train(args)
    return 0


def train(args: argparse.Namespace) -> list[float]:
    """Run the job; returns the loss of every step (mean over the global batch).

    Under torchrun or srun this process is one rank of theirs; otherwise it spawns --ranks
    processes and waits for them, so tests can call it in-process.
    """
    if _launched_by_torchrun_or_slurm():
        return train_this_rank(args)
    with tempfile.TemporaryDirectory(prefix="zerocompile-train-") as tmp:
        # A file rather than a queue: spawn() joins before we could drain a pipe that filled up.
        losses_file = Path(tmp) / "losses.json"
        port = free_loopback_port()
        torch.multiprocessing.spawn(_spawned_rank, args=(args, port, str(losses_file)), nprocs=args.ranks)
        return json.loads(losses_file.read_text())


def _launched_by_torchrun_or_slurm() -> bool:
    """The same variables `zc.init_distributed()` takes its rank from."""
    env = os.environ
    return ("RANK" in env and "WORLD_SIZE" in env) or ("SLURM_PROCID" in env and "SLURM_NTASKS" in env)


def _spawned_rank(rank: int, args: argparse.Namespace, port: int, losses_file: str) -> None:
    os.environ.update(loopback_rank_environment(rank, args.ranks, port))
    # The ranks share this machine's cores; more threads than cores makes every rank slower.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.ranks))
    losses = train_this_rank(args)
    if rank == 0:
        Path(losses_file).write_text(json.dumps(losses))


def train_this_rank(args: argparse.Namespace) -> list[float]:
    """The training loop of one rank; starts and ends its process group."""
    # One compile worker per rank: the ranks already keep every core busy.
    torch._inductor.config.compile_threads = 1
    rank, world_size = zc.init_distributed()
    losses = _train_loop(args, rank, world_size)
    # Without the barrier a rank may tear gloo down while another is still in a collective, and
    # the job sometimes dies with SIGABRT. Only on success: a rank that raised must exit, not wait.
    dist.barrier()
    dist.destroy_process_group()
    return losses


def _train_loop(args: argparse.Namespace, rank: int, world_size: int) -> list[float]:
    if args.batch_size % world_size:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the {world_size} ranks")
    config = SIZES[args.model_size]
    text = load_text()
    torch.manual_seed(args.seed)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    zc.shard(model, stage=args.stage)
    compiled = torch.compile(model, backend="zero", options={"compiler": args.compiler})
    if rank == 0:
        _print_header(args, model, world_size)

    batches = GlobalBatches(text, args.batch_size, config.block_size, args.seed)
    per_rank = args.batch_size // world_size
    my_rows = slice(rank * per_rank, (rank + 1) * per_rank)
    losses: list[float] = []
    start = last_log = time.perf_counter()
    last_logged_step = 0
    for step in range(1, args.steps + 1):
        log_this_step = rank == 0 and (step % args.log_every == 0 or step in (1, args.steps))
        inputs, targets = batches.next(my_rows)
        loss = compiled(inputs, targets)
        loss.backward()
        optimizer.step()
        if log_this_step:
            state_bytes = zc.model_state_bytes(model, optimizer)  # before zero_grad() frees the gradients
        optimizer.zero_grad()
        losses.append(_global_mean(loss.detach(), world_size))
        if log_this_step:
            now = time.perf_counter()
            tokens = (step - last_logged_step) * args.batch_size * config.block_size
            _print_step(step, args.steps, losses[-1], tokens / (now - last_log), state_bytes)
            last_log, last_logged_step = now, step
    if rank == 0:
        print(
            f"first loss {losses[0]:.4f} -> last loss {losses[-1]:.4f} "
            f"({args.steps} steps in {time.perf_counter() - start:.1f} s, compile included)",
            flush=True,
        )
    return losses


def load_text() -> torch.Tensor:
    """The bundled prose as byte-level tokens (int64), read from the installed package."""
    data = (resources.files("zerocompile.tools") / "data" / "prose.txt").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class GlobalBatches:
    """Random windows of the text, the same sequence of global batches on every rank for a seed."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, block_size: int, seed: int) -> None:
        self.tokens = tokens
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)

    def next(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows` of the next global batch as (inputs, targets), targets shifted by one token.

        Every rank draws the whole batch's offsets, to stay in step, but reads only its own rows.
        """
        starts = torch.randint(
            len(self.tokens) - self.block_size, (self.batch_size,), generator=self.generator
        ).tolist()[rows]
        inputs = torch.stack([self.tokens[s : s + self.block_size] for s in starts])
        targets = torch.stack([self.tokens[s + 1 : s + 1 + self.block_size] for s in starts])
        return inputs, targets


def _global_mean(value: torch.Tensor, world_size: int) -> float:
    """Mean over the ranks: each rank's loss is over its slice only, the log shows the global batch."""
    total = value.clone()
    dist.all_reduce(total)
    return total.item() / world_size


def _print_header(args: argparse.Namespace, model: GPT, world_size: int) -> None:
    phi = zc.full_numel(model)
    print(
        f"zerocompile train: stage {args.stage}, {world_size} ranks, GPT {args.model_size}, "
        f"global batch {args.batch_size} x {model.config.block_size} tokens, compiler {args.compiler}",
        flush=True,
    )
    print(
        f"Φ = {phi:,} parameters; model state per rank in theory: "
        f"16Φ/N = {BYTES_PER_PARAMETER * phi / world_size / MB:.3f} MB (stages 1-3, N = {world_size}) "
        f"vs 16Φ = {BYTES_PER_PARAMETER * phi / MB:.3f} MB (stage 0)",
        flush=True,
    )


def _print_step(step: int, steps: int, loss: float, tokens_per_second: float, state_bytes: dict[str, int]) -> None:
    held = ", ".join(f"{kind} {count / MB:.3f} MB" for kind, count in state_bytes.items())
    note = " (includes compiling)" if step == 1 else ""
    print(
        f"step {step:>{len(str(steps))}}/{steps} | loss {loss:.4f} | {tokens_per_second:,.0f} tok/s{note} | "
        f"per rank: {held}",
        flush=True,
    )
