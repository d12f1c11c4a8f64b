"""Benchmark zerocompile's stages against DDP, FSDP2 and ZeroRedundancyOptimizer, side by side.

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
  compile-aot-eager  torch.compile(model, backend="aot_eager"), no data parallelism: AOTAutograd
                   without Inductor, the reference for zero3-eager's compile time
  zero3-eager      stage 3 with options={"compiler": "eager"}: our passes, graphs run op by op
  zero3-offload    zero3 with its optimizer state on disk (offload="disk": a file per rank under
                   --offload-dir, streamed bucket by bucket by each step); its optimizers are built
                   before shard(), which lays out their file
  zero3-offload-cpu  zero3 with its optimizer state in host memory and the update on the CPU
                   (offload="cpu": for parameters on an accelerator; on the CPU the same code
                   copies CPU to CPU); interleave it with zero3 to compare their optimizer steps

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
`_gpt_class_of_its_own`), so what Dynamo decides for one mode's frames cannot change another's.

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
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch._dynamo
import torch._inductor.config
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import compilation_time_metrics as compile_timers
from torch._inductor.runtime.cache_dir_utils import cache_dir, temporary_cache_dir
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

import zerocompile as zc
from zerocompile import offload_files, torch_support
from zerocompile.distributed import default_backend
from zerocompile.hybrid import ranks_per_node
from zerocompile.tools.arguments import positive_int
from zerocompile.tools import gpt as gpt_module
from zerocompile.tools import dispatched, link_budget, netsim, spawn
from zerocompile.tools.gpt import GPT, SIZES, GPTConfig
from zerocompile.tools.rss import reset_peak_rss, status_bytes
from zerocompile.tools.train import add_device_argument, chosen_device

MB = 1e6
LEARNING_RATE = 3e-4
MUON_LEARNING_RATE = 0.02  # modded-nanogpt's
FP32_BYTES = 4
PHASES = ("forward", "backward", "optimizer")
# Columns of the compile-phase table: torch's `dynamo_timed` spans summed per column. A pass of ours
# shows as "zerocompile.<pass>"; the partition wrapped by our eager compiler is the partition's.
COMPILE_PHASES: dict[str, tuple[str, ...]] = {
    "Dynamo": ("bytecode_tracing", "build_guards"),
    "AOT trace": ("aot_collect_metadata", "aot_trace_joint_graph"),
    "partition": ("min_cut_rematerialization_partition", "zerocompile.min_cut_rematerialization_partition"),
    "zerocompile passes": (),  # every other zerocompile.* span
    "Inductor codegen": ("GraphLowering.codegen",),
}
_SPANS_OF_NAMED_COLUMNS = frozenset(span for spans in COMPILE_PHASES.values() for span in spans)
# (model size, timed steps, warm-up steps) of a normal run and of --quick.
DEFAULTS = ("12m", 17, 3)  # 20 steps: the bf16-vs-fp32 loss check runs over 20
DEFAULT_RANKS = 2
DEFAULT_INTERLEAVE = ("ddp-compile", "fsdp2-compile", "zero2", "zero3")  # the acceptance ratios
QUICK = ("tiny", 2, 1)
# What the figures mean under --fake-ranks, where they differ from a real run (see the docstring).
FAKE_METHOD = {
    "fake_ranks": "one process per mode, rank 0 of a world of `ranks` on the fake backend: collectives have "
    "their real shapes but send nothing and leave their outputs uninitialised, so values are garbage",
    "sent": "not measured (null): the fake backend sends nothing",
    "final_loss": "meaningless: computed from uninitialised collective outputs",
    "loss_vs_ddp": "not compared (n/a)",
}
# What the figures of a run over a simulated link mean (tools/link_budget.py).
LINK_METHOD = {
    "waiting": "median over timed steps of the longest any rank's main thread was blocked during the step "
    "(neither on a core nor waiting for one: waiting for collectives)",
    "link_bytes": "median over timed steps of the bytes the shaped interface transmitted, headers included, "
    "per node (one link: loopback, every rank's traffic; two nodes: each node's veth, what leaves it)",
    "predicted": "zerocompile's ledgers for the graphs and optimizer step of one step: one link carries every "
    "byte every rank sends; two nodes, each node's ranks' bytes to the other node; n/a for modes without a ledger",
    "floor": "max(the mode's step on an unlimited link from --floor-from, the busier node's link bytes / the "
    "probe's rate); without --floor-from, the link's part alone",
}
# The speed asked of optimizer state on disk: its optimizer step within this many times max(the same
# step in memory, the disk's floor).
OFFLOAD_BOUND = 1.3
# What the figures of a mode with its optimizer state on disk mean (`_disk_figures`, `_offload_figures`).
OFFLOAD_METHOD = {
    "optimizer_on_disk": "modes with their optimizer state on disk (zc.shard(offload='disk') under --offload-dir): "
    "after the timed steps every rank at once (as in a step: the ranks of a machine share its disk) measures the "
    "directory's bandwidth on a file of its state's size (zerocompile.offload_files.measure_disk_bandwidth: written and "
    "fsync'd, its pages evicted, read back); state = the rank's state in the files; moved = the state read once and "
    "written once per step; floor = state / read bandwidth + state / write bandwidth; the rank with the largest "
    "floor is shown. optimizer = median over steps of the slowest rank's optimizer step; in memory = the same of "
    f"the mode it offloads, where they ran interleaved (n/a otherwise); bound = {OFFLOAD_BOUND} x max(in memory, floor)",
}
# glibc unmaps every freed allocation over 64 kB at once instead of keeping it for reuse.
EXACT_RSS_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": "65536"}


@dataclasses.dataclass
class Prepared:
    """A mode made ready to train: what to call per step, its optimizers, what it holds."""

    runner: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizers: list[torch.optim.Optimizer]
    state_bytes: Callable[[], dict[str, int]]


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of training the model; `build(model, optimizer)` wraps a freshly seeded GPT (in
    place if it likes) and makes its optimizers of kind `optimizer` (see `_optimizers`).

    `offload_of`: for a mode that keeps its optimizer state on disk, the mode it offloads (the same
    training with that state in memory). Its `build` takes the directory for the state as a third
    argument, and its optimizer phase is compared with that mode's (see `_offload_figures`)."""

    name: str
    build: Callable[..., Prepared]
    offload_of: str | None = None

    def prepare(self, model: GPT, settings: Settings) -> Prepared:
        """`build` with what the run chose: the optimizer kind, and the offload directory of a mode
        with its state on disk."""
        if self.offload_of is None:
            return self.build(model, settings.optimizer)
        return self.build(model, settings.optimizer, settings.offload_dir)


OPTIMIZERS = ("adamw", "muon")


def _is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """What Muon optimizes in modded-nanogpt's recipe: the blocks' 2-D weights."""
    return name.startswith("blocks.") and len(zc.full_shape(param)) == 2


def _optimizers(model: nn.Module, kind: str, muon: type[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """fp32 AdamW over every parameter; or ("muon") `muon` over the hidden matrices and AdamW over
    the embeddings, norms and biases."""
    if kind == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)]
    named = list(model.named_parameters())
    return [
        muon([p for n, p in named if _is_hidden_matrix(n, p)], lr=MUON_LEARNING_RATE),
        torch.optim.AdamW([p for n, p in named if not _is_hidden_matrix(n, p)], lr=LEARNING_RATE),
    ]


class _FullTensorMuon(zc.optim.Muon):
    """Muon on FSDP2's DTensor shards as users write it (torch has nothing built in): the
    elementwise parts on the local shards, as `zc.optim.Muon` does, and each update's
    `full_tensor()` all-gathered and orthogonalised on every rank, which keeps its own rows."""

    def _orthogonalise(self, updates: list[tuple[torch.Tensor, torch.Tensor, dict]]) -> list[torch.Tensor]:
        from torch.distributed.tensor import distribute_tensor
        from torch.optim._muon import _zeropower_via_newtonschulz

        return [
            distribute_tensor(
                _zeropower_via_newtonschulz(update.full_tensor(), group["ns_coefficients"], group["ns_steps"], group["eps"]),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            )
            for param, update, group in updates
        ]


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _held_bytes(model: nn.Module, optimizer_states: list[dict[Any, dict[str, Any]]]) -> dict[str, int]:
    """Local parameter, gradient and optimizer-state bytes, counted as zc.model_state_bytes does."""
    params = list({id(p): p for p in model.parameters()}.values())
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            _local_bytes(value)
            for optimizer_state in optimizer_states
            for state in optimizer_state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        ),
    }


def _plainly_held(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> Callable[[], dict[str, int]]:
    return lambda: _held_bytes(model, [optimizer.state for optimizer in optimizers])


def _ddp(compiled: bool) -> Callable[[GPT, str], Prepared]:
    def build(model: GPT, optimizer: str) -> Prepared:
        wrapped = DistributedDataParallel(model)
        optimizers = _optimizers(model, optimizer, torch.optim.Muon)
        runner = torch.compile(wrapped) if compiled else wrapped
        return Prepared(runner, optimizers, _plainly_held(model, optimizers))

    return build


def _plain_compile(backend: str, autocast_dtype: torch.dtype | None = None) -> Callable[[GPT, str], Prepared]:
    def build(model: GPT, optimizer: str) -> Prepared:
        optimizers = _optimizers(model, optimizer, torch.optim.Muon)
        compiled = torch.compile(model, backend=backend)
        runner = compiled if autocast_dtype is None else _under_autocast(compiled, autocast_dtype)
        return Prepared(runner, optimizers, _plainly_held(model, optimizers))

    return build


def _under_autocast(
    runner: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`runner` with its forward (and loss) under torch.autocast on the inputs' device; the
    backward, called on the loss afterwards, runs outside it as autocast prescribes."""

    def run(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(inputs.device.type, dtype=dtype):
            return runner(inputs, targets)

    return run


def _zero_redundancy(model: GPT, optimizer: str) -> Prepared:
    if optimizer != "adamw":
        raise ValueError(f"zero-redundancy runs AdamW only (ZeroRedundancyOptimizer partitions whole parameters), not {optimizer}")
    wrapped = DistributedDataParallel(model)
    redundancy = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.AdamW, lr=LEARNING_RATE)
    # `.optim` is the local AdamW over this rank's partition: the state it really holds.
    return Prepared(wrapped, [redundancy], lambda: _held_bytes(model, [redundancy.optim.state]))


def _fsdp2(
    compiled: bool, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), hybrid: bool = False
) -> Callable[[GPT, str], Prepared]:
    """FSDP2 over every rank; `hybrid`: HSDP, sharded inside each node and replicated across nodes
    (a 2-D mesh of the launcher's ranks per node), as zerocompile's shard_size="node"."""

    def build(model: GPT, optimizer: str) -> Prepared:
        device_type = next(model.parameters()).device.type
        if hybrid:
            per_node = ranks_per_node()
            shape = (dist.get_world_size() // per_node, per_node)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device_type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp_policy)
            if compiled:
                # As torchtitan compiles FSDP2: each block on its own, FSDP2's hooks around it. The
                # whole model under torch.compile broke its graph at GPT.forward's loop over the
                # blocks and ran mostly eagerly.
                block.compile()
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        optimizers = _optimizers(model, optimizer, _FullTensorMuon)
        return Prepared(model, optimizers, _plainly_held(model, optimizers))

    return build


def _zero(stage: int, compiler: str = "inductor", **settings: Any) -> Callable[..., Prepared]:
    def build(model: GPT, optimizer: str, offload_dir: str | None = None) -> Prepared:
        """With `offload_dir`, the optimizers' state in files there (offload="disk")."""
        chosen = settings if offload_dir is None else {**settings, "offload": "disk", "offload_dir": offload_dir}
        if "offload" not in chosen:
            zc.shard(model, stage=stage, **chosen)
            optimizers = _optimizers(model, optimizer, zc.optim.Muon)
        else:
            # shard() lays out the offloaded state from the optimizers, so they come first: torch's
            # Muon, which shard() makes zerocompile's in place.
            optimizers = _optimizers(model, optimizer, torch.optim.Muon)
            zc.shard(model, stage=stage, optimizer=optimizers, **chosen)
        runner = torch.compile(model, backend="zero", options={"compiler": compiler})
        return Prepared(runner, optimizers, lambda: zc.model_state_bytes(model, optimizers))

    return build


def _zero3_half_budget(model: GPT, optimizer: str) -> Prepared:
    """Stage 3 with `memory_budget` half the model's gathered (fp32) bytes."""
    return _zero(3, memory_budget=sum(p.numel() * p.element_size() for p in model.parameters()) // 2)(model, optimizer)


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in [
        Mode("ddp", _ddp(compiled=False)),
        Mode("ddp-compile", _ddp(compiled=True)),
        Mode("compile", _plain_compile("inductor")),
        Mode("zero-redundancy", _zero_redundancy),
        Mode("fsdp2", _fsdp2(compiled=False)),
        Mode("fsdp2-compile", _fsdp2(compiled=True)),
        *(Mode(f"zero{stage}", _zero(stage)) for stage in range(4)),
        *(Mode(f"zero{stage}-bf16", _zero(stage, param_dtype=torch.bfloat16)) for stage in range(4)),
        Mode("zero3-int8", _zero(3, gather_quant="int8", reduce_quant="int8")),
        Mode("zero2-int8", _zero(2, gather_quant="int8", reduce_quant="int8")),
        Mode("fsdp2-hsdp-compile", _fsdp2(compiled=True, hybrid=True)),
        Mode("zero3-hybrid", _zero(3, shard_size="node")),
        Mode("zero3-hybrid-int8", _zero(3, shard_size="node", reduce_quant="int8", quant_scope="cross_node")),
        Mode("zero3-hpz", _zero(3, secondary_shard_size="node")),
        Mode(
            "zero3-hpz-int8",
            _zero(3, secondary_shard_size="node", gather_quant="int8", reduce_quant="int8", quant_scope="cross_node"),
        ),
        Mode("zero3-budget", _zero3_half_budget),
        Mode("compile-aot-eager", _plain_compile("aot_eager")),
        Mode("zero3-eager", _zero(3, compiler="eager")),
        Mode("zero3-offload", _zero(3), offload_of="zero3"),
        Mode("zero3-offload-cpu", _zero(3, offload="cpu")),
        Mode("compile-bf16", _plain_compile("inductor", autocast_dtype=torch.bfloat16)),
        # reduce_dtype: what zero3-bf16 reduces in (ZeroConfig.reduce_dtype None: the gradients' bf16).
        Mode(
            "fsdp2-compile-bf16",
            _fsdp2(compiled=True, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
        ),
    ]
}


def _mode_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; valid: {','.join(MODES)}")
    return names


def _link_rate(text: str) -> str:
    try:
        netsim.parse_rate(text)
    except netsim.NetworkError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _existing_directory(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory: create it, or name one that exists")
    return path.resolve()


def _interleave_list(text: str) -> list[str]:
    if text.strip() == "none":
        return []
    names = _mode_list(text)
    if len(names) < 2 or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"needs two or more different modes (or 'none'), got {text!r}")
    return names


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
        type=lambda text: [] if text.strip() == "none" else _mode_list(text),
        default=list(MODES),
        help=f"comma-separated (default all: {','.join(MODES)}); 'none' to time only the --interleave modes",
    )
    parser.add_argument(
        "--interleave",
        type=_interleave_list,
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
        type=_link_rate,
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
        type=_existing_directory,
        default=None,
        metavar="DIR",
        help="where the modes with their optimizer state on disk (zero3-offload) keep it, and whose bandwidth "
        "they measure (default: a directory in the run's temporary directory, under $TMPDIR or /tmp; on a tmpfs "
        "the state still uses RAM, and zerocompile warns so)",
    )
    spawn.add_allocator_argument(parser)
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output directory (default ./bench-out)")


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
        return _gpt_config(self.model_size, self.layers)


def _gpt_config(model_size: str, layers: int | None) -> GPTConfig:
    size = SIZES[model_size]
    return size if layers is None else dataclasses.replace(size, n_layer=layers)


def run(args: argparse.Namespace) -> int:
    """`zerocompile bench`: runs the modes, writes --out; 1 if a mode failed, else 0."""
    summary = bench(args)
    return 1 if any(mode["status"] == "failed" for mode in summary["modes"]) else 0


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Spawn the ranks, run every mode, write bench.json/.md/.png to --out; returns the JSON."""
    size, steps, warmup = QUICK if args.quick else DEFAULTS
    model_size = args.model_size or size
    fake = args.fake_ranks is not None
    ranks = args.fake_ranks if fake else (args.ranks or DEFAULT_RANKS) * args.nodes
    if args.batch_size % ranks:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the {ranks} ranks")
    backend = "fake" if fake else default_backend(args.device)
    if not args.modes and not _interleaved_modes(args):
        raise SystemExit("--modes none leaves nothing to run: give --interleave with two or more modes")
    _check_link(args, backend)
    preload = _preload(args)
    config = _gpt_config(model_size, args.layers)
    phi = _count_parameters(config)
    print(spawn.allocator_line(preload), flush=True)
    machine = {"node": platform.node(), "cpu_count": os.cpu_count(), "torch": torch_support.RELEASE}
    print(
        f"zerocompile bench on {machine['node']} ({machine['cpu_count']} CPUs, torch {machine['torch']}): "
        f"{ranks} {backend} ranks, GPT {_described(model_size, args.layers)} (Φ = {phi:,}), global batch {args.batch_size} x "
        f"{config.block_size} tokens, {_optimizer_description(args.optimizer)}, {args.warmup or warmup} warm-up + "
        f"{args.steps or steps} timed steps per mode",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="zerocompile-bench-") as tmp, _network(args) as network:
        link = _link_line(args, network)
        offload_dir = args.offload_dir or Path(tmp, "offload")
        offload_dir.mkdir(exist_ok=True)
        settings = Settings(
            ranks=ranks,
            model_size=model_size,
            layers=args.layers,
            steps=args.steps or steps,
            warmup=args.warmup or warmup,
            batch_size=args.batch_size,
            seed=args.seed,
            modes=tuple(args.modes),
            interleave=_interleaved_modes(args),
            cache_root=str(args.inductor_cache.resolve()) if args.inductor_cache else tmp,
            device=args.device,
            optimizer=args.optimizer,
            fake=fake,
            nodes=args.nodes,
            link=args.link is not None,
            offload_dir=str(offload_dir),
        )
        measured = {}
        environment = EXACT_RSS_ENVIRONMENT if args.exact_rss else {}

        def launch(fn: Callable[..., Any], fn_args: tuple) -> Any:
            """Rank 0's result of `fn(rank, *fn_args)` on every rank."""
            if network is None:
                return spawn.spawn_ranks(fn, settings.processes, fn_args, env=environment, preload=preload)[0]
            return network.run_ranks(fn, ranks // args.nodes, fn_args, env=spawn.child_environment(environment, preload))[0]

        for name in settings.modes:
            measured[name] = launch(_spawned_rank, (name, settings))
            print(_progress_line(measured[name]), flush=True)
        interleaved = _run_interleaved(settings, launch) if settings.interleave else None
    if link is not None:
        _add_floors(measured, interleaved, link["probe_bits_per_second"], _unlimited_steps(args.floor_from))
    summary = {
        "machine": machine,
        "settings": {
            **{
                k: v
                for k, v in dataclasses.asdict(settings).items()
                if k not in ("modes", "interleave", "cache_root", "device", "offload_dir")
            },
            "device": None if args.device is None else str(args.device),  # None: the process group's
            "backend": backend,
            "phi": phi,
            "block_size": settings.config.block_size,
            "optimizer": _optimizer_description(args.optimizer),
            "quick": args.quick,
            "malloc": " ".join(f"{k}={v}" for k, v in EXACT_RSS_ENVIRONMENT.items()) if args.exact_rss else preload or "default",
            "link": link,
        },
        "method": {
            "step_time": "median over timed steps of the slowest rank's step; each step starts after a barrier",
            "compile_time": "first warm-up step minus the median step; "
            + (f"the Inductor caches kept in {args.inductor_cache} (C++ kernels an earlier run compiled are reused; "
               "graphs are compiled afresh, as every recorded compile is)"
               if args.inductor_cache else "a fresh Inductor cache per mode and rank"),
            "compile_cpu": "the same in CPU seconds of a rank and the compilers it ran, largest rank",
            "compile_phases": "torch's dynamo_timed spans of the warm-up steps, summed per column, largest rank "
            "per column: Dynamo = bytecode_tracing + build_guards; AOT trace = aot_collect_metadata + "
            "aot_trace_joint_graph; partition = min_cut_rematerialization_partition where torch times it (not "
            "inside aot_eager); zerocompile passes = the zerocompile.* spans; Inductor codegen = "
            "GraphLowering.codegen; C++ = compile_file (files compiled)",
            "rss_between_steps": "largest rank's VmRSS after the warm-up steps, before the timed ones",
            "peak_rss": "largest rank; VmHWM after resetting it before the timed steps, unless rss_source says "
            "ru_maxrss; every mode in its own processes",
            "device_peak": "on an accelerator, largest rank's max_memory_allocated: run = from after the model is "
            "built and sharded to the end, compile included; steps = reset before the timed steps; null on the CPU",
            "sent": "largest rank's median over timed steps of the /proc/self/io wchar delta around a step",
            "model_state": "largest rank, after the last optimizer step, gradients still held",
            "ops_per_step": "rank 0's kernel-like ops dispatched by one more step under torch.profiler (operators "
            "and Inductor kernels doing work: no views, allocations or queries; a collective once), the host work a "
            "GPU step of small kernels is bound by; kernels/step: the kernels its device ran (tools/dispatched.py)",
            "final_loss": "mean over ranks of the last timed step's loss",
            "loss_vs_ddp": "largest relative difference from ddp's mean loss over all steps, warm-up included",
            "load": "the machine's 1-minute load average before the timed steps (our own ranks add about N)",
            "interleaved": "the --interleave modes in one set of ranks, one step of each per round after their "
            "warm-up; median over rounds of the slowest rank's step, and of that rank's forward, backward and "
            "optimizer step (medians of their own); losses: each round's, mean over the ranks",
            **(FAKE_METHOD if fake else {}),
            **(LINK_METHOD if link is not None else {}),
            **(OFFLOAD_METHOD if any(MODES[name].offload_of for name in (*settings.modes, *settings.interleave)) else {}),
        },
        "theory": _theory(phi, ranks),
        "modes": [measured[name] for name in args.modes],
        "interleaved": interleaved,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = markdown_table(summary)
    (args.out / "bench.md").write_text(table)
    _plot(summary, args.out / "bench.png")
    print(f"\n{table}\nwrote {args.out}/bench.json, bench.md, bench.png", flush=True)
    return summary


def _check_link(args: argparse.Namespace, backend: str) -> None:
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


def _network(args: argparse.Namespace) -> contextlib.AbstractContextManager[netsim.SimulatedNetwork | None]:
    """The simulated network --link asks for (removed afterwards, also on failure), or none."""
    return netsim.SimulatedNetwork(args.nodes, args.link) if args.link else contextlib.nullcontext()


def _unlimited_steps(path: Path | None) -> dict[str, float]:
    """Each mode's step on an unlimited link, from a bench.json (--floor-from): interleaved
    modes' medians where it has them (their ratios are the ones to quote), else the modes' own."""
    if path is None:
        return {}
    unlimited = json.loads(Path(path).read_text())
    steps = {mode["mode"]: mode["step_time_s"] for mode in unlimited["modes"] if mode["status"] == "ok"}
    return {**steps, **((unlimited.get("interleaved") or {}).get("step_time_s") or {})}


def _add_floors(
    measured: dict[str, dict[str, Any]], interleaved: dict[str, Any] | None, bits_per_second: float,
    unlimited: dict[str, float],
) -> None:  # fmt: skip
    """Each mode's floor (tools/link_budget.py) and its step over it, beside its link figures."""

    def floor(figures: dict[str, Any], name: str, step: float) -> dict[str, Any]:
        seconds = link_budget.floor_seconds(unlimited.get(name), figures["link_bytes_per_step"] or [], bits_per_second)
        return {"floor_s": seconds, "unlimited_step_s": unlimited.get(name), "step_over_floor": step / seconds if seconds else None}

    for name, mode in measured.items():
        if mode["status"] == "ok":
            mode.update(floor(mode, name, mode["step_time_s"]))
    for name, figures in (interleaved or {}).get("link", {}).items():
        figures.update(floor(figures, name, interleaved["step_time_s"][name]))


def _link_line(args: argparse.Namespace, network: netsim.SimulatedNetwork | None) -> dict[str, Any] | None:
    """Print and return what the link is: the rate asked for and the rate a probe measured."""
    if network is None:
        return None
    measured = network.probe()
    shape = "one link between all ranks" if args.nodes == 1 else f"{args.nodes} nodes of {args.ranks or DEFAULT_RANKS} ranks"
    print(f"link             {args.link} asked, {measured / 1e9:.3f} Gbit/s measured by a probe; {shape}", flush=True)
    return {"rate": args.link, "nodes": args.nodes, "probe_bits_per_second": measured}


def _optimizer_description(kind: str) -> str:
    if kind == "adamw":
        return f"fp32 AdamW(lr={LEARNING_RATE})"
    return f"fp32 Muon(lr={MUON_LEARNING_RATE}) for the blocks' matrices + AdamW(lr={LEARNING_RATE})"


def _preload(args: argparse.Namespace) -> str | None:
    """The allocator the ranks preload: --exact-rss tunes glibc's malloc, so it takes none."""
    if args.exact_rss and args.allocator in ("tcmalloc", "jemalloc"):
        raise SystemExit(f"--exact-rss sets glibc's malloc variables, which --allocator {args.allocator} ignores: leave one out")
    return spawn.find_allocator("system" if args.exact_rss else args.allocator)


def _interleaved_modes(args: argparse.Namespace) -> tuple[str, ...]:
    """--interleave resolved: none under --fake-ranks (refused if asked for), and with --quick."""
    if args.fake_ranks is not None:
        if args.interleave:
            raise SystemExit(
                "--interleave times modes side by side in one set of real ranks; --fake-ranks runs each mode "
                "alone as one rank of a fake group: leave --interleave out (or pass --interleave none)"
            )
        return ()
    return tuple(args.interleave if args.interleave is not None else () if args.quick else DEFAULT_INTERLEAVE)


def _count_parameters(config: GPTConfig) -> int:
    """Φ of the model, tied parameters once, without allocating it."""
    with torch.device("meta"):
        return zc.full_numel(GPT(config))


def _theory(phi: int, ranks: int) -> dict[str, float]:
    """ZeRO's fp32 figures per rank (bytes) for comparison with the measured ones."""
    share = (ranks - 1) / ranks
    return {
        "sent_2phi": 2 * phi * share * FP32_BYTES,
        "sent_3phi": 3 * phi * share * FP32_BYTES,
        "state_16phi": 16 * phi,
        "state_16phi_over_n": 16 * phi / ranks,
    }


def _spawned_rank(rank: int, name: str, settings: Settings) -> dict[str, Any] | None:
    """Run mode `name` on this rank; every rank's summarised figures on rank 0."""
    with _rank_session(rank, settings, name):
        measured = _run_mode(MODES[name], settings, rank)
    return _gathered(measured, lambda per_rank: _summarise(name, per_rank, settings.nodes))


def _interleaved_rank(rank: int, settings: Settings) -> dict[str, Any] | None:
    """Time the --interleave modes side by side on this rank (see the module docstring)."""
    with _rank_session(rank, settings, "interleaved"):
        device = chosen_device(settings.device)
        prepared = {}
        for name in settings.interleave:
            torch.manual_seed(settings.seed)
            prepared[name] = MODES[name].prepare(_gpt_class_of_its_own(name)(settings.config).to(device), settings)
        batches = {name: _RandomBatches(settings.config, settings, rank, device) for name in settings.interleave}
        interface = link_budget.link_interface() if settings.link else None
        steps: dict[str, list[Step]] = {name: [] for name in settings.interleave}
        graphs: dict[str, list[Any]] = {name: [] for name in settings.interleave}
        losses: dict[str, list[float]] = {name: [] for name in settings.interleave}
        for round_ in range(settings.warmup + settings.steps):
            for name in settings.interleave:
                with zc.record_graphs() as compiled:
                    step = _one_step(prepared[name], batches[name], interface)
                graphs[name] += compiled
                losses[name].append(step.loss.item())
                if round_ >= settings.warmup:
                    steps[name].append(step)
        measured = {
            "step_times": {name: [step.seconds for step in taken] for name, taken in steps.items()},
            "phases": {name: [step.phases for step in taken] for name, taken in steps.items()},
            "waiting": {name: [step.waiting for step in taken] for name, taken in steps.items()},
            "link_sent": {name: [step.link_sent for step in taken] for name, taken in steps.items()},
            "predicted": {
                name: _predicted_bytes(graphs[name], prepared[name].optimizers, settings) for name in settings.interleave
            },
            "losses": losses,
            "load": os.getloadavg()[0],
            "disk": {
                name: _disk_figures(prepared[name].state_bytes(), settings.offload_dir) for name in settings.interleave
            },
        }
    return _gathered(measured, lambda per_rank: _summarise_interleaved(per_rank, settings.nodes))


def _gpt_class_of_its_own(name: str) -> type[GPT]:
    """The GPT class executed anew from its source, for mode `name` alone.

    Dynamo keeps state per code object: the cache entries and recompile count of each frame, and
    whether it gave up on a frame. FSDP2+compile gives up on `GPT.forward` (a graph break inside
    its loop over blocks), and every mode sharing that code object afterwards ran its forward
    eagerly, block by block: zero3 looked 1.7x slower interleaved than alone. Modes that share a
    process must not share code objects.
    """
    module_name = f"{gpt_module.__name__}_{re.sub(r'[^0-9a-zA-Z]', '_', name)}"
    spec = importlib.util.spec_from_file_location(module_name, gpt_module.__file__)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses resolve the config's annotations through it
    spec.loader.exec_module(module)
    return module.GPT


@contextlib.contextmanager
def _rank_session(rank: int, settings: Settings, cache_name: str) -> Iterator[None]:
    """This rank's process group, threads and a fresh Inductor cache of its own for the run."""
    # The ranks share the machine's cores, and each compiles with one worker: more threads than
    # cores slows every rank down. A process alone (--fake-ranks) keeps Inductor's own workers:
    # serial Triton compiles took 50 s of a 1.3B GPT's compile on an H200.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.processes))
    if settings.processes > 1:
        torch._inductor.config.compile_threads = 1
    # Inductor's modules take tens of MB once imported: import them in every mode, so the eager
    # modes do not look leaner than the compiled ones by that much.
    importlib.import_module("torch._inductor.compile_fx")
    _start_process_group(settings)
    # Per rank too: ranks sharing a cache split the C++ compiles between them (the first to reach a
    # kernel compiles it, its peer loads it), so a rank's compile CPU depended on that race.
    with temporary_cache_dir(os.path.join(settings.cache_root, cache_name, f"rank{rank}")):
        yield


def _start_process_group(settings: Settings) -> None:
    """This rank of the spawned ranks (the spawner gave it torchrun's variables); under
    --fake-ranks, rank 0 of a fake group of `settings.ranks` (no peers, no port), whose collectives
    take tensors on every device."""
    if settings.fake:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=settings.ranks)
        return
    zc.init_distributed(device=settings.device)


def _gathered(measured: dict[str, Any], summarise: Callable[[list[dict]], dict]) -> dict[str, Any] | None:
    """`summarise` of every rank's `measured` on rank 0 (None on the others). A fake group's other
    ranks do not exist (and its all-gathers return garbage): rank 0's alone."""
    if _communicates():
        per_rank: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(per_rank, measured)
    else:
        per_rank = [measured]
    return summarise(per_rank) if dist.get_rank() == 0 else None


def _run_interleaved(settings: Settings, launch: Callable[[Callable[..., Any], tuple], Any]) -> dict[str, Any]:
    print(f"interleaved      {', '.join(settings.interleave)}: {settings.steps} rounds", flush=True)
    interleaved = launch(_interleaved_rank, (settings,))
    first = settings.interleave[0]
    print(
        "interleaved      "
        + " | ".join(
            f"{name} {seconds:.3f} s ({interleaved['paired_ratio'][name][first]['median']:.2f}x {first})"
            for name, seconds in interleaved["step_time_s"].items()
        ),
        flush=True,
    )
    return interleaved


def _run_mode(mode: Mode, settings: Settings, rank: int) -> dict[str, Any]:
    try:
        return _measure_mode(mode, settings, rank)
    except Exception as error:  # a mode that fails must not take the others with it
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}


def _measure_mode(mode: Mode, settings: Settings, rank: int) -> dict[str, Any]:
    device = chosen_device(settings.device)
    torch.manual_seed(settings.seed)
    prepared = mode.prepare(GPT(settings.config).to(device), settings)
    batches = _RandomBatches(settings.config, settings, rank, device)
    interface = link_budget.link_interface() if settings.link else None
    compile_timers.clear()  # a mode has processes of its own: what is timed from here on is its compile
    _reset_device_peak(device)
    # Inductor's C++ kernels record themselves for the profiled step's count (`dispatched`).
    with zc.record_graphs() as graphs, dispatched.kernel_profiling():
        warmup = [_one_step(prepared, batches, interface) for _ in range(settings.warmup)]
    compiled = {name: [len(spans), sum(spans)] for name, spans in compile_timers.items()}
    warmup_device_peak = _device_peak(device)
    _reset_device_peak(device)
    rss_source = "VmHWM" if reset_peak_rss() else "ru_maxrss"
    rss_before = status_bytes("VmRSS")
    load = os.getloadavg()[0]
    timed = [_one_step(prepared, batches, interface) for _ in range(settings.steps)]
    steps_device_peak = _device_peak(device)
    host_work = dispatched.dispatched_per_step(lambda: _training_step(prepared, batches), device)
    held = prepared.state_bytes()  # the last step's gradients are still there
    if rss_source == "VmHWM":
        peak = status_bytes("VmHWM")
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    disk = _disk_figures(held, settings.offload_dir)  # after the peak: its buffers are no step's
    return {
        "step_times": [step.seconds for step in timed],
        "phases": [step.phases for step in timed],
        "first_step": warmup[0].seconds,
        "compile_cpu": warmup[0].cpu_seconds - statistics.median(step.cpu_seconds for step in timed),
        "compile_timers": compiled,
        "inductor_cache": cache_dir(),
        "sent": [step.sent for step in timed] if _communicates() else None,
        "waiting": [step.waiting for step in timed],
        "link_sent": [step.link_sent for step in timed],
        "predicted": _predicted_bytes(graphs, prepared.optimizers, settings),
        "losses": [step.loss.item() for step in warmup + timed],
        "dispatched": host_work,
        "held": held,
        "peak_rss": peak,
        "device_peak_run": None if steps_device_peak is None else max(warmup_device_peak, steps_device_peak),
        "device_peak_steps": steps_device_peak,
        "rss_before": rss_before,
        "rss_source": rss_source,
        "load": load,
        "device": str(device),
        "world_size": dist.get_world_size(),
        "disk": disk,
    }


def _disk_figures(held: dict[str, int], directory: str) -> dict[str, Any] | None:
    """For a mode whose optimizer state is on disk (its model_state_bytes, `held`, count it): this
    rank's state bytes there, the bandwidth of `directory` measured on a file of that size, the
    bytes a step moves through the disk (the state read once and written once) and the seconds
    they take at that bandwidth, the optimizer step's floor. None for a mode with it in memory."""
    if "optimizer_on_disk" not in held:
        return None
    state = held["optimizer_on_disk"]
    # Every rank at once, as they stream their state in a step: the ranks of one machine share its
    # disk, and one rank measuring alone would get all of it, a floor up to N times too low.
    dist.barrier()
    bandwidth = offload_files.measure_disk_bandwidth(directory, state)
    return {
        "directory": offload_files.describe_directory(directory),
        "state_bytes": state,
        "bandwidth_bytes_per_s": bandwidth,
        "moved_bytes_per_step": 2 * state,
        "floor_s": state / bandwidth["read"] + state / bandwidth["write"],
    }


def _predicted_bytes(
    graphs: list[Any], optimizers: list[torch.optim.Optimizer], settings: Settings
) -> dict[str, int] | None:
    """What zerocompile's ledgers say this rank sends per step, in all and to other nodes: the
    graphs compiled in the warm-up (each runs once a step) and the optimizers' steps. None for
    modes that are not zerocompile's (no ledger)."""
    ledgers = [graph.ledger for graph in graphs]
    ledgers += [zc.optim.step_ledger(o) for o in optimizers if isinstance(o, (zc.optim.Muon, zc.optim.Adafactor))]
    if not graphs:
        return None
    per_node = settings.ranks // settings.nodes
    return {
        "sent": sum(ledger.sent_bytes for ledger in ledgers),
        "across_nodes": sum(ledger.sent_across_nodes(per_node) for ledger in ledgers),
    }


def _communicates() -> bool:
    """Whether the world group's collectives send anything (not on the fake backend)."""
    return dist.get_backend() != "fake"


def _on_accelerator(device: torch.device) -> bool:
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return accelerator is not None and device.type == accelerator.type


def _reset_device_peak(device: torch.device) -> None:
    """Start `_device_peak` afresh from the bytes allocated now (on an accelerator)."""
    if _on_accelerator(device):
        torch.accelerator.reset_peak_memory_stats(device)


def _device_peak(device: torch.device) -> int | None:
    """The most bytes allocated at once on `device` since `_reset_device_peak`; None where the
    accelerator's allocator does not serve `device` (the CPU: see peak RSS)."""
    return torch.accelerator.max_memory_allocated(device) if _on_accelerator(device) else None


class Step(NamedTuple):
    """One timed training step on this rank."""

    seconds: float  # forward + backward + optimizer step
    cpu_seconds: float  # CPU time of this rank and of the child processes it waited for (compilers)
    phases: tuple[float, float, float]  # seconds in the forward, the backward, the optimizer step
    sent: int  # bytes written (wchar)
    loss: torch.Tensor
    waiting: float  # seconds the rank was blocked, not computing (link_budget.blocked_seconds)
    link_sent: int | None  # bytes the simulated link's interface transmitted (None without --link)


def _one_step(prepared: Prepared, batches: _RandomBatches, interface: str | None = None) -> Step:
    """One training step; every rank starts it after a barrier. With `interface`, the bytes it
    transmitted during the step are counted too.

    Gradients are cleared at the start, not the end, so the last step's are there to be counted.
    """
    for optimizer in prepared.optimizers:
        optimizer.zero_grad(set_to_none=True)
    inputs, targets = batches.next()
    _finish_queued_work(inputs.device)
    dist.barrier()
    link_before = None if interface is None else link_budget.transmitted_bytes(interface)
    written = _wchar()
    cpu_start = _cpu_seconds()
    clock_start = link_budget.thread_clock()
    start = time.perf_counter()
    loss = prepared.runner(inputs, targets)
    _finish_queued_work(inputs.device)
    forward_done = time.perf_counter()
    loss.backward()
    _finish_queued_work(inputs.device)
    backward_done = time.perf_counter()
    for optimizer in prepared.optimizers:
        optimizer.step()
    _finish_queued_work(inputs.device)
    end = time.perf_counter()
    waiting = link_budget.blocked_seconds(end - start, clock_start, link_budget.thread_clock())
    phases = (forward_done - start, backward_done - forward_done, end - backward_done)
    link_sent = None
    if interface is not None:
        # The node's other ranks may still be sending when this one is done: read the counter once
        # every rank is (the barrier adds a few hundred bytes).
        dist.barrier()
        link_sent = link_budget.transmitted_bytes(interface) - link_before
    return Step(end - start, _cpu_seconds() - cpu_start, phases, _wchar() - written, loss.detach(), waiting, link_sent)


def _training_step(prepared: Prepared, batches: _RandomBatches) -> None:
    """A step as `_one_step` runs it, without its clocks and barriers (what `dispatched` counts)."""
    for optimizer in prepared.optimizers:
        optimizer.zero_grad(set_to_none=True)
    prepared.runner(*batches.next()).backward()
    for optimizer in prepared.optimizers:
        optimizer.step()


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def _finish_queued_work(device: torch.device) -> None:
    """Wait until `device` has run what was queued on it: an accelerator runs kernels after the
    call that launched them returns, and a phase's time must include them. The CPU runs them in
    the call."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


class _RandomBatches:
    """The same global batches of random tokens on every rank and in every mode; this rank's rows,
    on `device` (drawn on the CPU: the same tokens whatever the device)."""

    def __init__(self, config: GPTConfig, settings: Settings, rank: int, device: torch.device) -> None:
        self.generator = torch.Generator().manual_seed(settings.seed)
        self.shape = (settings.batch_size, config.block_size + 1)
        self.vocab_size = config.vocab_size
        per_rank = settings.batch_size // settings.ranks
        self.rows = slice(rank * per_rank, (rank + 1) * per_rank)
        self.device = device

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(self.vocab_size, self.shape, generator=self.generator)[self.rows]
        return tokens[:, :-1].contiguous().to(self.device), tokens[:, 1:].contiguous().to(self.device)


def _wchar() -> int:
    """Bytes this process has passed to write-like system calls, sockets included."""
    match = re.search(r"^wchar:\s+(\d+)", Path("/proc/self/io").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError("no wchar in /proc/self/io: bytes sent are measured on Linux only")
    return int(match.group(1))


def _summarise(name: str, per_rank: list[dict[str, Any]], nodes: int = 1) -> dict[str, Any]:
    """One mode's figures from every rank's measurements (see the module docstring)."""
    errors = [f"rank {rank}: {m['error']}" for rank, m in enumerate(per_rank) if "error" in m]
    if errors:
        return {"mode": name, "status": "failed", "error": "; ".join(errors), "per_rank": per_rank}
    step_times = [max(steps) for steps in zip(*(m["step_times"] for m in per_rank))]
    median_step = statistics.median(step_times)
    first_step = max(m["first_step"] for m in per_rank)
    largest_held = max((m["held"] for m in per_rank), key=lambda held: sum(held.values()))
    return {
        "mode": name,
        "status": "ok",
        "step_time_s": median_step,
        "compile_time_s": first_step - median_step,
        "compile_cpu_s": max(m["compile_cpu"] for m in per_rank),
        "compile_phases_s": _compile_phases(per_rank),
        "compiled_cpp_files": max(m["compile_timers"].get("compile_file", [0, 0.0])[0] for m in per_rank),
        "first_step_s": first_step,
        "step_times_s": step_times,
        "peak_rss_bytes": max(m["peak_rss"] for m in per_rank),
        "rss_before_bytes": max(m["rss_before"] for m in per_rank),
        "rss_source": per_rank[0]["rss_source"],
        "device_peak_run_bytes": _largest(m["device_peak_run"] for m in per_rank),
        "device_peak_steps_bytes": _largest(m["device_peak_steps"] for m in per_rank),
        "load_avg_1min": per_rank[0]["load"],
        "sent_bytes_per_step": _largest(None if m["sent"] is None else statistics.median(m["sent"]) for m in per_rank),
        **_link_figures([m["waiting"] for m in per_rank], [m["link_sent"] for m in per_rank], nodes),
        "link_bytes_predicted": _link_prediction([m["predicted"] for m in per_rank], nodes),
        "model_state_bytes": largest_held,
        "dispatched_ops_per_step": per_rank[0]["dispatched"]["ops"],
        "device_kernels_per_step": per_rank[0]["dispatched"]["kernels"],
        "final_loss": statistics.fmean(m["losses"][-1] for m in per_rank),
        "losses": [statistics.fmean(step) for step in zip(*(m["losses"] for m in per_rank))],
        "optimizer_on_disk": _offload_figures(
            name,
            [m["disk"] for m in per_rank],
            _phase_medians([m["step_times"] for m in per_rank], [m["phases"] for m in per_rank]),
            side_by_side={},
        ),
        "per_rank": per_rank,
    }


def _phase_medians(step_times: list[list[float]], phases: list[list[tuple[float, float, float]]]) -> dict[str, float]:
    """From every rank's steps: per phase, the median over steps of the forward, backward and
    optimizer step of the rank slowest in each step (each phase's median on its own, so they need
    not add up to the step's median exactly)."""
    ranks = range(len(step_times))
    slowest = [max(ranks, key=lambda rank: step_times[rank][step]) for step in range(len(step_times[0]))]
    per_step = [phases[rank][step] for step, rank in enumerate(slowest)]
    return dict(zip(PHASES, (statistics.median(phase) for phase in zip(*per_step))))


def _offload_figures(
    name: str, disk: list[dict[str, Any] | None], phases: dict[str, float], side_by_side: dict[str, dict[str, float]]
) -> dict[str, Any] | None:
    """For mode `name` with its optimizer state on disk (every rank's `_disk_figures`; None
    otherwise): the rank's figures with the largest floor, its optimizer phase (of `phases`, its
    medians) and, where the mode it offloads ran in the same interleave (`side_by_side`: their
    phase medians), that mode's optimizer phase in memory and the bound OFFLOAD_BOUND x
    max(in memory, floor) the phase on disk should be within."""
    if disk[0] is None:
        return None
    in_memory_mode = MODES[name].offload_of
    in_memory = side_by_side[in_memory_mode]["optimizer"] if in_memory_mode in side_by_side else None
    figures = max(disk, key=lambda rank: rank["floor_s"])
    bound = None if in_memory is None else OFFLOAD_BOUND * max(in_memory, figures["floor_s"])
    return {
        **figures,
        "optimizer_phase_s": phases["optimizer"],
        "in_memory_mode": in_memory_mode,
        "in_memory_optimizer_phase_s": in_memory,
        "bound_s": bound,
        "within_bound": None if bound is None else phases["optimizer"] <= bound,
    }


def _largest(values: Iterable[float | None]) -> float | None:
    """The largest rank's figure, or None where it was not measured (the same on every rank)."""
    measured = [value for value in values if value is not None]
    return max(measured) if measured else None


def _compile_phases(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per `COMPILE_PHASES` column and of the C++ compiles ("C++"), largest rank per column."""

    def columns(timers: dict[str, list]) -> dict[str, float]:
        seconds = {column: sum(timers.get(span, [0, 0.0])[1] for span in spans) for column, spans in COMPILE_PHASES.items()}
        seconds["zerocompile passes"] = sum(
            total
            for span, (_count, total) in timers.items()
            if span.startswith("zerocompile.") and span not in _SPANS_OF_NAMED_COLUMNS
        )
        seconds["C++"] = timers.get("compile_file", [0, 0.0])[1]
        return seconds

    each = [columns(m["compile_timers"]) for m in per_rank]
    return {column: max(rank[column] for rank in each) for column in each[0]}


def _link_prediction(predicted: list[dict[str, int] | None], nodes: int) -> list[int] | None:
    """The ledgers' bytes over the link per node from every rank's `_predicted_bytes` (None for a
    mode without a ledger)."""
    if any(figures is None for figures in predicted):
        return None
    return link_budget.predicted_link_bytes(
        [figures["sent"] for figures in predicted], [figures["across_nodes"] for figures in predicted], nodes
    )


def _link_figures(waiting: list[list[float]], link_sent: list[list[int | None]], nodes: int) -> dict[str, Any]:
    """From every rank's steps: the median over steps of the longest any rank waited
    (`waiting_s`), and of the bytes each node sent over the link, as its first rank read them
    (`link_bytes_per_step`, one per node; None without a link)."""
    per_node = len(waiting) // nodes
    readings = [link_sent[node * per_node] for node in range(nodes)]
    return {
        "waiting_s": statistics.median(max(step) for step in zip(*waiting)),
        "link_bytes_per_step": None if readings[0][0] is None else [statistics.median(r) for r in readings],
    }


def _summarise_interleaved(per_rank: list[dict[str, Any]], nodes: int = 1) -> dict[str, Any]:
    """Median over rounds of the slowest rank's step, per interleaved mode; and of that rank's
    forward, backward and optimizer step (`_phase_medians`); the mean loss over the ranks of every
    round; and for a mode with its optimizer state on disk, `_offload_figures`."""
    names = list(per_rank[0]["step_times"])
    rounds = range(len(per_rank[0]["step_times"][names[0]]))
    slowest = {name: [max(m["step_times"][name][i] for m in per_rank) for i in rounds] for name in names}
    phases = {
        name: _phase_medians([m["step_times"][name] for m in per_rank], [m["phases"][name] for m in per_rank])
        for name in names
    }
    disk = {name: _offload_figures(name, [m["disk"][name] for m in per_rank], phases[name], phases) for name in names}
    return {
        "modes": names,
        "step_time_s": {name: statistics.median(times) for name, times in slowest.items()},
        "step_times_s": slowest,
        "paired_ratio": {name: {other: _paired_ratio(slowest[name], slowest[other]) for other in names} for name in names},
        "phase_s": phases,
        "losses": {name: [statistics.fmean(step) for step in zip(*(m["losses"][name] for m in per_rank))] for name in names},
        "optimizer_on_disk": {name: figures for name, figures in disk.items() if figures is not None},
        "link": {
            name: {
                **_link_figures([m["waiting"][name] for m in per_rank], [m["link_sent"][name] for m in per_rank], nodes),
                "link_bytes_predicted": _link_prediction([m["predicted"][name] for m in per_rank], nodes),
            }
            for name in names
        },
        "load_avg_1min": per_rank[0]["load"],
    }


def _paired_ratio(times: list[float], others: list[float]) -> dict[str, float]:
    """Quartiles over rounds of one mode's step time divided by another's in the same round.

    A round's two steps ran back to back, so whatever else the machine did weighs on both: their
    ratio varies much less than either time does, and its spread says how far one run's ratio
    can be trusted.
    """
    ratios = [time / other for time, other in zip(times, others, strict=True)]
    if len(ratios) < 2:
        return {"p25": ratios[0], "median": ratios[0], "p75": ratios[0]}
    p25, median, p75 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"p25": p25, "median": median, "p75": p75}


def _progress_line(mode: dict[str, Any]) -> str:
    if mode["status"] != "ok":
        return f"{mode['mode']:<16} FAILED {mode['error']}"
    held = mode["model_state_bytes"]
    return (
        f"{mode['mode']:<16} step {mode['step_time_s']:.3f} s | compile {mode['compile_time_s']:.1f} s "
        f"({mode['compile_cpu_s']:.1f} s CPU) | "
        f"peak RSS {mode['peak_rss_bytes'] / MB:.0f} MB | "
        + ("" if mode["device_peak_run_bytes"] is None else f"device peak {_device_peaks(mode)} MB | ")
        + f"sent {_megabytes(mode['sent_bytes_per_step'], 2)} MB/step | "
        f"state {sum(held.values()) / MB:.1f} MB | loss {mode['final_loss']:.4f} | load {mode['load_avg_1min']:.1f}"
    )


def _megabytes(value: float | None, decimals: int) -> str:
    return "n/a" if value is None else f"{value / MB:.{decimals}f}"


def _device_peaks(mode: dict[str, Any]) -> str:
    """"run / steps" accelerator peaks of a mode, in MB."""
    return f"{_megabytes(mode['device_peak_run_bytes'], 0)} / {_megabytes(mode['device_peak_steps_bytes'], 0)}"


def _described(model_size: str, layers: int | None) -> str:
    return model_size if layers is None else f"{model_size} with {layers} layers"


def _link_text(link: dict[str, Any]) -> str:
    shape = "through one link" if link["nodes"] == 1 else f"on {link['nodes']} simulated nodes joined by a link"
    return f", {shape} of {link['rate']} ({link['probe_bits_per_second'] / 1e9:.3f} Gbit/s measured)"


def markdown_table(summary: dict[str, Any]) -> str:
    """bench.md: the machine, the settings, one row per mode, the theory and how it was measured."""
    machine, settings, theory = summary["machine"], summary["settings"], summary["theory"]
    fake = settings["fake"]
    ran = [mode for mode in summary["modes"] if mode["status"] == "ok"]
    devices = sorted({rank["device"] for mode in ran for rank in mode["per_rank"]})
    device_peaks = any(mode["device_peak_run_bytes"] is not None for mode in ran)
    columns = [
        "mode", "step s", "compile s (CPU s)", "RSS between steps MB", "peak RSS MB",
        *(["device peak MB run / steps"] if device_peaks else []),
        "sent MB/step/rank", "params / grads / optim MB per rank", "ops/step",
        *(["kernels/step"] if device_peaks else []), "final loss", "vs ddp", "load",
    ]  # fmt: skip
    lines = [
        f"`zerocompile bench` on {machine['node']} ({machine['cpu_count']} CPUs, torch {machine['torch']}), "
        f"{settings['ranks']} {settings['backend']} ranks, GPT {_described(settings['model_size'], settings.get('layers'))} "
        f"(Φ = {settings['phi']:,}, tied embeddings), "
        f"global batch {settings['batch_size']} x {settings['block_size']} tokens, {settings['optimizer']}, "
        f"{settings['warmup']} warm-up + {settings['steps']} timed steps per mode, malloc {settings['malloc']}"
        + (f", on {', '.join(devices)}" if devices else "")
        + (_link_text(settings["link"]) if settings.get("link") else "")
        + (" (--quick: times mean nothing)" if settings["quick"] else "")
        + ".",
        *(
            [
                "",
                f"Fake process group: each mode ran alone as rank 0 of {settings['ranks']}; the collectives had their "
                "real shapes but sent nothing and left their outputs uninitialised. Step times are compute with "
                "communication free, memory one rank's; losses and bytes sent mean nothing (n/a).",
            ]
            if fake
            else []
        ),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    notes = []
    ddp = next((m for m in ran if m["mode"] == "ddp"), None)
    for mode in summary["modes"]:
        if mode["status"] != "ok":
            lines.append(f"| {mode['mode']} | {mode['status']} |" + " |" * (len(columns) - 2))
            notes.append(f"- {mode['mode']} {mode['status']}: {mode['error']}")
            continue
        held = mode["model_state_bytes"]
        lines.append(
            f"| {mode['mode']} | {mode['step_time_s']:.3f} | {mode['compile_time_s']:.1f} ({mode['compile_cpu_s']:.1f}) | "
            f"{mode['rss_before_bytes'] / MB:.0f} | {mode['peak_rss_bytes'] / MB:.0f} | "
            + (f"{_device_peaks(mode)} | " if device_peaks else "")
            + f"{_megabytes(mode['sent_bytes_per_step'], 2)} | "
            f"{held['params'] / MB:.1f} / {held['grads'] / MB:.1f} / {held['optimizer'] / MB:.1f} | "
            f"{mode['dispatched_ops_per_step']} | "
            + (f"{mode['device_kernels_per_step']} | " if device_peaks else "")
            + ("n/a | n/a" if fake else f"{mode['final_loss']:.4f} | {_loss_difference(mode, ddp)}")
            + f" | {mode['load_avg_1min']:.1f} |"
        )
    method = summary["method"]
    lines += _compile_phase_table(summary["modes"])
    lines += _link_table(summary)
    lines += [
        "",
        (
            f"ZeRO theory at N = {settings['ranks']}, fp32: "
            f"sent 2Φ·(N−1)/N·4 B = {theory['sent_2phi'] / MB:.2f} MB (DDP, stages 0-2), "
            f"3Φ·(N−1)/N·4 B = {theory['sent_3phi'] / MB:.2f} MB (stage 3); model state "
            f"16Φ = {theory['state_16phi'] / MB:.1f} MB (DDP, stage 0), "
            f"16Φ/N = {theory['state_16phi_over_n'] / MB:.1f} MB (stages 1-3)."
        ),
        "",
        *(f"- {key.replace('_', ' ')}: {text}" for key, text in method.items()),
        *notes,
        *_interleaved_table(summary["interleaved"]),
        *_offload_table(summary),
    ]
    return "\n".join(lines) + "\n"


def _offload_table(summary: dict[str, Any]) -> list[str]:
    """Each mode with its optimizer state on disk, run on its own and interleaved: its optimizer
    step beside the disk's floor and, interleaved with the mode it offloads, that mode's step in
    memory and the bound."""
    rows = [
        (mode["mode"], "own processes", mode["optimizer_on_disk"])
        for mode in summary["modes"]
        if mode["status"] == "ok" and mode["optimizer_on_disk"]
    ]
    interleaved = summary["interleaved"] or {"optimizer_on_disk": {}}
    rows += [(name, "interleaved", figures) for name, figures in interleaved["optimizer_on_disk"].items()]
    if not rows:
        return []

    def milliseconds(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{seconds * 1e3:.1f}"

    lines = [
        "",
        f"Optimizer state on disk, in {rows[0][2]['directory']}: is the optimizer step within {OFFLOAD_BOUND} x "
        "max(in memory, floor)? (see optimizer on disk above)",
        "",
        "| mode | run | state on disk MB/rank | disk write / read MB/s | moved MB/step | floor ms | optimizer ms "
        "| in memory ms | bound ms | |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run, figures in rows:
        bandwidth, in_memory = figures["bandwidth_bytes_per_s"], figures["in_memory_optimizer_phase_s"]
        verdict = {None: "n/a", True: "within", False: "OVER"}[figures["within_bound"]]
        lines.append(
            f"| {name} | {run} | {figures['state_bytes'] / MB:.2f} | "
            f"{bandwidth['write'] / MB:.0f} / {bandwidth['read'] / MB:.0f} | {figures['moved_bytes_per_step'] / MB:.2f} | "
            f"{milliseconds(figures['floor_s'])} | {milliseconds(figures['optimizer_phase_s'])} | "
            + ("n/a" if in_memory is None else f"{milliseconds(in_memory)} ({figures['in_memory_mode']})")
            + f" | {milliseconds(figures['bound_s'])} | {verdict} |"
        )
    return lines


def _link_table(summary: dict[str, Any]) -> list[str]:
    """Over a simulated link: each mode's waiting, bytes over the link (and the ledgers' prediction),
    floor and step over it; the interleaved modes' too."""
    if not summary["settings"].get("link"):
        return []

    def megabytes(per_node: list[float] | None) -> str:
        return "n/a" if per_node is None else " / ".join(f"{value / MB:.2f}" for value in per_node)

    def row(name: str, step: float, figures: dict[str, Any], predicted: list[int] | None) -> str:
        floor, over = figures.get("floor_s"), figures.get("step_over_floor")
        return (
            f"| {name} | {step:.3f} | {figures['waiting_s']:.3f} | {megabytes(figures['link_bytes_per_step'])} | "
            f"{megabytes(predicted)} | {'n/a' if floor is None else f'{floor:.3f}'} | "
            f"{'n/a' if over is None else f'{over:.2f}'} |"
        )

    header = ["| mode | step s | waiting s | link MB/step (per node) | ledger's prediction MB | floor s | step / floor |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines = ["", "Over the link (see waiting, link bytes, predicted and floor below):", "", *header]
    lines += [
        row(mode["mode"], mode["step_time_s"], mode, mode["link_bytes_predicted"])
        for mode in summary["modes"]
        if mode["status"] == "ok"
    ]
    interleaved = summary.get("interleaved")
    if interleaved and "link" in interleaved:
        lines += ["", "Interleaved, over the link:", "", *header]
        lines += [
            row(name, interleaved["step_time_s"][name], figures, figures["link_bytes_predicted"])
            for name, figures in interleaved["link"].items()
        ]
    return lines


def _compile_phase_table(modes: list[dict[str, Any]]) -> list[str]:
    """Where each compiling mode's compile went (see "compile phases" in the module docstring)."""
    compiled = [mode for mode in modes if mode["status"] == "ok" and any(mode["compile_phases_s"].values())]
    if not compiled:
        return []
    columns = [*COMPILE_PHASES, "C++"]
    lines = [
        "",
        "Compile phases (torch's compile timers, wall s, largest rank per column):",
        "",
        "| mode | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for mode in compiled:
        phases = mode["compile_phases_s"]
        cells = [f"{phases[column]:.1f}" for column in COMPILE_PHASES]
        cells.append(f"{phases['C++']:.1f} ({mode['compiled_cpp_files']} files)")
        lines.append(f"| {mode['mode']} | " + " | ".join(cells) + " |")
    return lines


def _interleaved_table(interleaved: dict[str, Any] | None) -> list[str]:
    if interleaved is None:
        return []
    names = interleaved["modes"]
    step, phase, paired = interleaved["step_time_s"], interleaved["phase_s"], interleaved["paired_ratio"]

    def ratio(name: str, other: str) -> str:
        if name == other:
            return "1.00"
        quartiles = paired[name][other]
        return f"{quartiles['median']:.2f} ({quartiles['p25']:.2f}-{quartiles['p75']:.2f})"

    return [
        "",
        f"Interleaved: {', '.join(names)} side by side in one set of ranks, one step of each per round "
        f"(load {interleaved['load_avg_1min']:.1f}); x other: the median over rounds of the step's time "
        "divided by the other mode's in the same round (quartiles in brackets):",
        "",
        "| mode | step s | "
        + " | ".join(f"x {name}" for name in names)
        + " | "
        + " | ".join(f"{phase_name} ms" for phase_name in PHASES)
        + " |",
        "|---|---|" + "---|" * (len(names) + len(PHASES)),
        *(
            f"| {name} | {step[name]:.3f} | "
            + " | ".join(ratio(name, other) for other in names)
            + " | "
            + " | ".join(f"{phase[name][p] * 1e3:.0f}" for p in PHASES)
            + " |"
            for name in names
        ),
    ]


def _loss_difference(mode: dict[str, Any], ddp: dict[str, Any] | None) -> str:
    if ddp is None or len(ddp["losses"]) != len(mode["losses"]):
        return "-"
    return f"{max(abs(a - b) / abs(b) for a, b in zip(mode['losses'], ddp['losses'])):.1e}"


def _plot(summary: dict[str, Any], path: Path) -> None:
    """bench.png: step time and bytes sent per mode, with ZeRO's 2Φ and 3Φ volumes marked (step
    time alone where nothing was sent: --fake-ranks)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("zerocompile bench draws bench.png with matplotlib: pip install matplotlib") from error
    modes = [mode for mode in summary["modes"] if mode["status"] == "ok"]
    names = [mode["mode"] for mode in modes]
    sent = not summary["settings"]["fake"]
    figure, axes = plt.subplots(1, 1 + sent, figsize=(11, 0.45 * len(names) + 1.8), sharey=True, squeeze=False)
    time_axis = axes[0][0]
    time_axis.barh(names, [mode["step_time_s"] for mode in modes], color="tab:blue")
    time_axis.set_xlabel("median step time (s)")
    if sent:
        sent_axis = axes[0][1]
        sent_axis.barh(names, [mode["sent_bytes_per_step"] / MB for mode in modes], color="tab:orange")
        sent_axis.set_xlabel("sent per step per rank (MB)")
        theory = summary["theory"]
        for key, label, style in (("sent_2phi", "2Φ(N−1)/N", "--"), ("sent_3phi", "3Φ(N−1)/N", ":")):
            sent_axis.axvline(theory[key] / MB, color="black", linestyle=style, linewidth=1, label=label)
        sent_axis.legend(loc="lower right", fontsize="small")
    time_axis.invert_yaxis()
    machine, settings = summary["machine"], summary["settings"]
    figure.suptitle(
        f"{machine['node']}, {machine['cpu_count']} CPUs, torch {machine['torch']}: "
        f"{settings['ranks']} {settings['backend']} ranks, "
        f"GPT {_described(settings['model_size'], settings.get('layers'))} (Φ = {settings['phi']:,}), {settings['optimizer']}",
        fontsize="medium",
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(
        prog="zerocompile bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
