"""Benchmark zerocompile's stages against DDP, FSDP2, ZeroRedundancyOptimizer and DeepSpeed, side by side.

ZeRO's promise is DDP-like speed at a fraction of the memory, and on a shared machine the only
fair comparison is one run: this runs every mode in turn, each in --ranks freshly spawned ranks on
127.0.0.1 (gloo; nccl where CUDA is available, as zc.init_distributed chooses), on the same GPT
(same seed, same initial weights, the same global batches of random tokens, each rank its slice)
with fp32 AdamW (`--optimizer muon`: Muon for the blocks' matrices, AdamW for the rest). Models, batches and losses live on --device (default: the process group's device,
cuda:LOCAL_RANK under NCCL, else cpu); the initial weights and the tokens are drawn on the CPU, so
every device starts from the same ones.

  ddp              DistributedDataParallel, eager
  ddp-compile      torch.compile(DDP(model)), default Inductor
  compile          torch.compile(model) without any data parallelism (each rank trains its own
                   replica, nothing is sent): the reference for compile time
  zero-redundancy  torch.distributed.optim.ZeroRedundancyOptimizer + DDP, eager
  fsdp2            fully_shard on every Block and on the root, eager
  fsdp2-compile    the same, each Block compiled on its own (Module.compile) inside FSDP2's hooks,
                   as torchtitan compiles FSDP2; the embeddings, final norm and head run eagerly
  zero0 .. zero3   zerocompile.shard(model, stage=s) + torch.compile(model, backend="zero")
  zero0-bf16 ..    the same with param_dtype=torch.bfloat16 (fp32 master shards, bf16 on the
  zero3-bf16       wire and in compute)
  zero3-int8       stage 3 with gather_quant="int8" and reduce_quant="int8" (ZeRO++'s qwZ + qgZ:
                   int8 blocks of 256 on the wire, fp32 master shards and compute)
  zero2-int8       the same at stage 2: parameters gathered once, at the forward's start, and
                   kept for the backward (2Φ(N-1)/N int8 bytes a step instead of 3Φ)
  fsdp2-hsdp-compile  FSDP2 with a 2-D mesh (replicate across nodes, shard inside one: HSDP),
                   blocks compiled as fsdp2-compile's; nodes as the launcher counts them (--nodes), one node otherwise
  zero3-hybrid     stage 3 with shard_size="node": sharded inside a node, replicas across nodes
  zero3-hpz        stage 3 with secondary_shard_size="node" (hpZ): the backward gathers inside a node
  zero3-hybrid-int8, zero3-hpz-int8  the same with int8 where bytes cross nodes
                   (quant_scope="cross_node"): hybrid's mean across the replicas; hpZ's forward
                   gathers and its reductions (its backward's gathers inside a node stay exact)
  zero3-budget     stage 3 with memory_budget = half the model's fp32 parameter bytes: the
                   parameters used last in the forward stay gathered for the backward, the others
                   are gathered again (between zero2's and zero3's traffic)
  zero3-keep       stage 3 with memory_budget = all of them: every parameter the backward reads
                   stays gathered from its forward use (stage 2's traffic, 2Φ, sharded between
                   steps)
  compile-aot-eager  torch.compile(model, backend="aot_eager"), no data parallelism: AOTAutograd
                   without Inductor, the reference for zero3-eager's compile time
  zero3-eager      stage 3 with options={"compiler": "eager"}: our passes, graphs run op by op
  zero3-offload    zero3 with its optimizer state on disk (offload="disk": a file per rank under
                   --offload-dir, streamed bucket by bucket by each step); its optimizers are built
                   before shard(), which lays out their file
  zero3-offload-cpu  zero3 with its optimizer state in host memory and the update on the CPU
                   (offload="cpu": for parameters on an accelerator; on the CPU the same code
                   copies CPU to CPU); interleave it with zero3 to compare their optimizer steps

DeepSpeed's ZeRO, the reference ZeRO (`pip install "zerocompile[peers]"`; DS_ACCELERATOR=cpu is set
for CPU ranks), the same fp32 AdamW object as every mode, gradient_clipping 0 (its default 1.0
would clip where no other mode does):
  deepspeed1 .. deepspeed3  deepspeed.initialize(model, optimizer, ZeRO stage s), eager
  deepspeed2-compile, deepspeed3-compile  the same after engine.compile() (its hooks outside the graphs)
  deepspeed3-deepcompile  ZeRO-3 with DeepCompile ("compile": {"deepcompile": true}): CUDA only

Mixed precision, bf16 in compute, fp32 master weights and AdamW state in each (like zero3-bf16):
  compile-bf16     torch.compile(model) as `compile` (fp32 parameters, nothing sharded), its forward
                   and loss run under torch.autocast(device type, torch.bfloat16); the backward
                   outside it, as autocast is meant to be used
  fsdp2-compile-bf16  fsdp2-compile with MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                   reduce_dtype=torch.bfloat16) on every Block and the root: fp32 shards, gathered
                   and computed in bf16, gradients reduce-scattered in bf16 (what zerocompile's
                   stage 3 does with param_dtype=bf16: its reduce_dtype defaults to the dtype the
                   gradients were computed in) and kept in fp32
  zero3-bf16       zerocompile.shard(model, stage=3, param_dtype=torch.bfloat16), as listed above
  deepspeed3-bf16, deepspeed3-compile-bf16, deepspeed3-deepcompile-bf16  DeepSpeed's ZeRO-3 modes with
                   "bf16": {"enabled": true} and communication_data_type bf16: bf16 partitions
                   computed and reduced in bf16, fp32 partitions stepped by the same AdamW

Fake ranks: `--fake-ranks N` measures a mode at N ranks in one process on one device, without the
other N-1. Each mode runs in a process of its own (a fresh Inductor cache, as always) that is rank
0 of a torch.distributed group of world size N on the "fake" backend (FakeStore), with 1/N of
--batch-size on --device (default: the accelerator if there is one, else the CPU). Every
collective has its real shapes (all-gathers return N shards, reduce-scatters take N) and costs its
call and its output's memory, no transfer: the fake backend sends nothing and leaves outputs
uninitialised. So the step times are compute and our overheads with communication free, model
state and peak memory are one rank's of an N-rank run, and the values are garbage: losses are not
compared (vs ddp and final loss say n/a) and bytes sent are not measured (null in the JSON, n/a in
the table). No --interleave: it needs the modes side by side in one set of real ranks. On one GPU:
`--fake-ranks 8 --model-size 1.3b --batch-size 64 --modes compile-bf16,fsdp2-compile-bf16,zero3-bf16`.

Compile cost: `--modes compile,zero3,compile-aot-eager,zero3-eager --layers 48` compares ours with
plain torch.compile and with aot_eager on one deep GPT (each block adds its markers and
collectives to the graphs our passes walk).

How each figure is measured, per mode, after --warmup untimed steps (the first one compiles):
  step time   every step (forward, backward, optimizer step) starts after a barrier; the step
              time is the slowest rank's, and the table shows the median over --steps steps (on
              an accelerator each phase ends when the device has finished its queued work)
  compile     first warm-up step minus the median step; each rank of each mode compiles into a
              fresh Inductor cache of its own, so compile times are cold and comparable across
              modes, ranks and runs (unless --inductor-cache keeps the caches between runs).
              "compile CPU" is the same difference in CPU seconds of the rank and the compilers it
              ran (g++ here): on a shared machine the ranks' concurrent compiles and other load
              stretch the wall clock, the work itself far less (the largest rank's)
  compile     where the warm-up steps' compiling went, by torch's own compile timers
  phases      (`dynamo_timed`, the spans tlparse shows), wall seconds summed over every graph
              the rank compiled, largest rank per column: Dynamo tracing, AOTAutograd's trace,
              the min-cut partition (where torch times it: not inside aot_eager), zerocompile's
              passes (each timed as zerocompile.*), Inductor's code generation, and the C++
              files it compiled (count and seconds; 0 with the eager compilers)
  device peak on an accelerator, max_memory_allocated: "run" from just after the model is built
              (and sharded: building puts the whole fp32 model on the device first, which a
              sharded run would not) to the end, compile included; "steps" over the timed steps
              only (reset before them). Not measured on the CPU, where peak RSS is the figure
  peak RSS    VmHWM over the timed steps (reset through /proc/self/clear_refs before them; where
              that is refused, ru_maxrss since the rank started, and the JSON says so), largest
              rank; "RSS between steps" is VmRSS after the warm-up steps. Every mode runs in its
              own processes, and Inductor is imported before it starts, so all modes start from
              the same baseline. The ranks' malloc (tcmalloc, else jemalloc, where installed;
              --allocator, and the first line printed) keeps freed memory for reuse, as glibc's
              does, so by default RSS is the process's footprint, not its live tensors.
              --exact-rss starts the ranks on glibc's malloc with MALLOC_MMAP_THRESHOLD_=65536,
              so every tensor over 64 kB is unmapped when freed: RSS then follows live tensors,
              but every allocation page-faults and steps run 30-45 % slower, so times from such a
              run are not comparable.
  sent        bytes written by the rank (/proc/self/io wchar) around one step: gloo's socket
              writes, i.e. everything sent, not what we think we send; median over the timed
              steps, largest rank. Host-side, like peak RSS: NCCL's GPU transfers do not pass
              through write()
  model state bytes this rank holds in parameters, gradients and optimizer state after the last
              optimizer step (largest rank): zerocompile.model_state_bytes for ours; for the
              others the local tensors, for FSDP2 the local shards of its DTensors
  final loss  mean over the ranks of the last timed step's loss
  vs ddp      largest relative difference between the mode's and DDP's mean loss over all
              steps, warm-up included (when ddp runs too): the modes see the same weights and
              batches, so fp32 modes agree to rounding and bf16 ones show bf16's error
  optimizer   for a mode with its optimizer state on disk, after its timed steps, every rank at
  on disk     once (as in a step, the ranks of a machine share its disk) measures the bandwidth
              of --offload-dir on a file of its state's size (write, fsync'd; read, its pages
              evicted); a step moves that state twice (read once, written once), so its floor is
              state / read bandwidth + state / write bandwidth, largest rank. Beside it, its
              optimizer step (median of the slowest rank's) and, interleaved with the mode it
              offloads (zero3), that mode's in memory, and whether it is within the bound
              1.3 x max(in memory, floor)

Step times of modes run one after another move with whatever else the machine does meanwhile
(±30 % between runs on a shared 2-core machine). So, after the modes, the --interleave modes
(default: ddp-compile, fsdp2-compile, zero2, zero3) are built again side by side in one set of
ranks, warmed up, and timed in rounds, one step of each mode per round: every mode sees the same
load, and their ratios are the ones to quote: per round, one mode's step time divided by the
other's, then the median and quartiles over rounds. There each step is also split into its forward,
backward and optimizer step (the slowest rank's), which says where one mode loses time against
another, and each round's loss is kept (mean over the ranks). Memory is not measured there (the
modes share processes). Each mode there builds its GPT from its own copy of the model code (see
`gpt_class_of_its_own`), so what Dynamo decides for one mode's frames cannot change another's.

Slow links: on one machine ranks talk over loopback, where a byte costs a memcpy on the cores that
compute. `--link RATE` runs every mode's ranks inside a network namespace whose loopback a token
bucket shapes to RATE (one link between all ranks); `--nodes 2 --link RATE` on two simulated nodes
of --ranks ranks each, joined by a veth pair shaped to RATE, each node's ranks started by torchrun
inside its namespace (zerocompile.tools.netsim; needs iproute2 and CAP_NET_ADMIN). A probe's
measured rate is printed and recorded beside the rate asked for; the namespaces are removed after
the run, also when it fails. Over a link each mode (and each interleaved mode) also gets how long
its ranks waited, the bytes that crossed the link per node beside zerocompile's ledgers'
prediction, and its floor, max(its step on an unlimited link from `--floor-from BENCH_JSON`, the
link bytes at the probe's rate) (zerocompile.tools.link_budget).

Writes bench.json (everything, per rank too), bench.md (the table) and bench.png (step time and
bytes sent per mode) to --out. A mode that fails on every rank is reported as failed with its
error and the others still run. --quick is a smoke run for CI (tiny model, 1 warm-up and 2 timed
steps): it checks that every mode runs and what it sends, its times mean nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from zerocompile.tools import spawn
from zerocompile.tools.arguments import positive_int
from zerocompile.tools.bench.deepspeed_modes import DEEPSPEED_MODES
from zerocompile.tools.bench.modes import MODES, OPTIMIZERS, interleave_list, mode_list
from zerocompile.tools.bench.orchestration import bench
from zerocompile.tools.bench.settings import DEFAULT_INTERLEAVE, DEFAULT_RANKS, DEFAULTS, QUICK, existing_directory, link_rate
from zerocompile.tools.gpt import SIZES
from zerocompile.tools.train import add_device_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `zerocompile bench`; size, steps and warm-up default to --quick's when it is given."""
    world = parser.add_mutually_exclusive_group()
    # Default None (2 is decided in `bench`): argparse lets a mutually exclusive flag through when
    # its value is its default, so `--ranks 2 --fake-ranks 8` would pass.
    world.add_argument("--ranks", type=positive_int, default=None, help=f"ranks to spawn (default {DEFAULT_RANKS})")
    world.add_argument(
        "--fake-ranks",
        type=positive_int,
        default=None,
        metavar="N",
        help="instead, run each mode as rank 0 of N in one process on a fake process group: one rank's "
        "compute and memory at N ranks with communication free, values garbage (see the description)",
    )
    parser.add_argument(
        "--model-size",
        choices=sorted(SIZES),
        default=None,
        help=f"GPT size (default {DEFAULTS[0]}; --quick: {QUICK[0]})",
    )
    parser.add_argument(
        "--layers", type=positive_int, default=None, help="blocks of the GPT (default: the size's own)"
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help=f"timed steps per mode (default {DEFAULTS[1]}; --quick: {QUICK[1]})",
    )
    parser.add_argument(
        "--warmup",
        type=positive_int,
        default=None,
        help=f"untimed steps before them, the first compiles (default {DEFAULTS[2]}; --quick: {QUICK[2]})",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=4,
        help="sequences of the model's block size per global batch, split over the ranks (default 4)",
    )
    parser.add_argument(
        "--modes",
        type=lambda text: [] if text.strip() == "none" else mode_list(text),
        default=[name for name in MODES if name not in DEEPSPEED_MODES],
        help="comma-separated (default all but DeepSpeed's, which need it installed: "
        f"{','.join(MODES)}); 'none' to time only the --interleave modes",
    )
    parser.add_argument(
        "--interleave",
        type=interleave_list,
        default=None,
        help="modes timed again side by side, one step each per round, in one set of ranks "
        f"(default {','.join(DEFAULT_INTERLEAVE)}; --quick: none); 'none' to skip",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="adamw (default); muon: Muon for the blocks' matrices (torch.optim.Muon under DDP, the "
        "full_tensor() recipe under FSDP2, zc.optim.Muon for ours) and AdamW for the rest",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the tokens (default 0)")
    add_device_argument(parser, "every mode's model, batches and loss")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run for CI: tiny model, 2 timed steps, 1 warm-up (times mean nothing)",
    )
    parser.add_argument(
        "--exact-rss",
        action="store_true",
        help="ranks unmap freed tensors at once (MALLOC_MMAP_THRESHOLD_=65536, glibc's malloc: no "
        "allocator preloaded): RSS follows live tensors, steps run 30-45%% slower; a separate run for memory",
    )
    parser.add_argument(
        "--link",
        type=link_rate,
        default=None,
        metavar="RATE",
        help="the ranks talk through one link of RATE (e.g. 1gbit, 2.5gbit; 'unlimited': the same network "
        "unshaped): a network namespace whose loopback is shaped by tc (needs iproute2 and root); a probe's "
        "measured rate is printed beside it",
    )
    parser.add_argument(
        "--floor-from",
        type=Path,
        default=None,
        metavar="BENCH_JSON",
        help="with --link: the bench.json of the same modes on an unlimited link; each mode's floor is then "
        "max(that step, its link bytes / the probe's rate), else the link's part alone",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        choices=(1, 2),
        default=1,
        help="with --link: 2 simulated nodes of --ranks ranks each, joined by the link (ranks of one node talk "
        "unshaped), every rank started by torchrun inside its node (default 1)",
    )
    parser.add_argument(
        "--inductor-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep each mode's and rank's Inductor cache under DIR and reuse it in later runs: in a sweep of "
        "--link rates only the first run compiles C++ kernels, and compile times are then not cold (default: "
        "a fresh cache per run, removed after)",
    )
    parser.add_argument(
        "--offload-dir",
        type=existing_directory,
        default=None,
        metavar="DIR",
        help="where the modes with their optimizer state on disk (zero3-offload) keep it, and whose bandwidth "
        "they measure (default: a directory in the run's temporary directory, under $TMPDIR or /tmp; on a tmpfs "
        "the state still uses RAM, and zerocompile warns so)",
    )
    spawn.add_allocator_argument(parser)
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default ./bench-out)")


def run(args: argparse.Namespace) -> int:
    """`zerocompile bench`: runs the modes, writes --out; 1 if a mode failed, else 0."""
    summary = bench(args)
    return 1 if any(mode["status"] == "failed" for mode in summary["modes"]) else 0
