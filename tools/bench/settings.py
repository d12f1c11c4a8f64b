"""What a `zerocompile bench` run is: its defaults, the types of its flags that are not modes, and
the flags resolved into the Settings every rank receives (refusing combinations that cannot run)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from zerocompile.tools import netsim, spawn
from zerocompile.tools.gpt import SIZES, GPTConfig

# (model size, timed steps, warm-up steps) of a normal run and of --quick.
DEFAULTS = ("12m", 17, 3)  # 20 steps: the bf16-vs-fp32 loss check runs over 20
DEFAULT_RANKS = 2
DEFAULT_INTERLEAVE = ("ddp-compile", "fsdp2-compile", "zero2", "zero3")  # the acceptance ratios
QUICK = ("tiny", 2, 1)
# glibc unmaps every freed allocation over 64 kB at once instead of keeping it for reuse.
EXACT_RSS_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "65536"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved run settings every rank receives."""

    ranks: int
    model_size: str
    steps: int
    warmup: int
    batch_size: int
    seed: int
    modes: tuple[str, ...]
    interleave: tuple[str, ...]
    cache_root: str
    device: torch.device | None  # None: each rank's process group device
    layers: int | None = None  # None: the size's own
    optimizer: str = "adamw"  # OPTIMIZERS
    fake: bool = False  # one process, rank 0 of `ranks` on the fake backend (--fake-ranks)
    nodes: int = 1  # simulated nodes (--nodes), ranks numbered node by node
    link: bool = False  # the ranks talk over a simulated link (--link): count its bytes per step
    offload_dir: str | None = None  # where modes with their optimizer state on disk keep it (--offload-dir)

    @property
    def processes(self) -> int:
        """Processes spawned per mode (they share the machine's cores)."""
        return 1 if self.fake else self.ranks

    @property
    def config(self) -> GPTConfig:
        return gpt_config(self.model_size, self.layers)


def gpt_config(model_size: str, layers: int | None) -> GPTConfig:
    size = SIZES[model_size]
    return size if layers is None else dataclasses.replace(size, n_layer=layers)


def link_rate(text: str) -> str:
    """--link's RATE as given, once netsim can read it (1gbit, 2.5gbit, unlimited, ...)."""
    try:
        netsim.parse_rate(text)
    except netsim.NetworkError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def existing_directory(text: str) -> Path:
    """--offload-dir: a directory that exists, made absolute."""
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory: create it, or name one that exists")
    return path.resolve()


def check_link(args: argparse.Namespace, backend: str) -> None:
    """--link and --nodes make sense together, on real gloo ranks; refused before anything starts."""
    if args.nodes > 1 and args.link is None:
        raise SystemExit("--nodes simulates nodes joined by a link: give its rate, e.g. --link 1gbit")
    if args.link is None:
        if args.floor_from is not None:
            raise SystemExit("--floor-from gives the floors of a run over a simulated link: add --link RATE")
        return
    if args.floor_from is not None and not args.floor_from.is_file():
        raise SystemExit(f"--floor-from {args.floor_from}: no such file (a bench.json of a run without --link)")
    if args.fake_ranks is not None:
        raise SystemExit("--link shapes the traffic between real ranks, and --fake-ranks sends nothing: leave one out")
    if backend != "gloo":
        raise SystemExit(f"--link shapes gloo's TCP traffic, and these ranks would use {backend}: add --device cpu")
    try:
        netsim.check_can_simulate()
    except netsim.NetworkError as error:
        raise SystemExit(f"zerocompile bench --link: {error}") from None


def preloaded_allocator(args: argparse.Namespace) -> str | None:
    """The allocator the ranks preload: --exact-rss tunes glibc's malloc, so it takes none."""
    if args.exact_rss and args.allocator in ("tcmalloc", "jemalloc"):
        raise SystemExit(f"--exact-rss sets glibc's malloc variables, which --allocator {args.allocator} ignores: leave one out")
    return spawn.find_allocator("system" if args.exact_rss else args.allocator)


def interleaved_modes(args: argparse.Namespace) -> tuple[str, ...]:
    """--interleave resolved: none under --fake-ranks (refused if asked for), and with --quick."""
    if args.fake_ranks is not None:
        if args.interleave:
            raise SystemExit(
                "--interleave times modes side by side in one set of real ranks; --fake-ranks runs each mode "
                "alone as one rank of a fake group: leave --interleave out (or pass --interleave none)"
            )
        return ()
    return tuple(args.interleave if args.interleave is not None else () if args.quick else DEFAULT_INTERLEAVE)

