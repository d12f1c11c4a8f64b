"""`ZeroConfig`: every setting of a sharded model in one object (OneFlow's `nn.Graph` config).

`shard(model, config)` or `shard(model, stage=3, ...)` fixes the sharding; `torch.compile(model,
backend="zero", options={...})` may override the compile-time fields for one compile.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from torch.distributed.device_mesh import DeviceMesh

from zerocompile.distributed import runs_on_gloo
from zerocompile.hybrid import check_shard_size
from zerocompile.passes.stages import stage_policy

# Fields that only steer the graph passes, so `options=` of one compile may change them.
COMPILE_TIME_FIELDS = ("compiler", "dump_dir", "bucket_bytes", "prefetch", "check_ranks", "memory_budget")
COMPILERS = ("inductor", "eager")
# `bucket_bytes=None` resolves to the default of the backend that runs the group's collectives on
# the parameters' device (see `default_bucket_bytes`).
# gloo, measured side by side (`zerocompile bench --interleave`, 2 gloo CPU ranks, 2026-12-02),
# step against 4 MiB buckets': 12m GPT, stage 3: 8 MiB 0.94x, 16 MiB 0.93x; stage 2, 16 MiB
# 0.96x; GPT 50m cut to 4 layers, stage 3: 8 / 16 / 32 MiB 0.94 / 0.91 / 0.89x; stage 2, 16 MiB
# 0.93x. Fewer collectives, each with gloo's fixed cost; 16 MiB, not 32, for the gathered window
# at stage 3 (two buckets of full tensors). (4 MiB had been chosen from separate processes, where
# the three sizes were within noise.) Through a slow link between nodes, hybrid sharding's
# replica reductions stepped faster in 4 MiB buckets (docs/results/2026-11-28-link-sweep.md).
GLOO_BUCKET_BYTES = 16 * 2**20
# Every other backend (nccl first): DDP's default bucket_cap_mb=25, the size PyTorch tuned its
# gradient buckets to on NCCL. Not measured here (no GPU). On NVLink a collective of a few MiB is
# latency-bound, so small buckets would leave bandwidth unused; at stage 3 this also bounds the
# window of gathered parameters, 25 MiB of full tensors.
ACCELERATOR_BUCKET_BYTES = 25 * 2**20
QUANTISATIONS = (None, "int8")
QUANT_SCOPES = ("all", "cross_node")
OFFLOADS = (None, "disk", "cpu")


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Settings of a ZeRO-sharded model.

    stage: 0 (plain data parallel), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).
    group: the process group parameters are sharded over (default: the whole world).
    compiler: "inductor" generates code; "eager" runs the rewritten graphs op by op (fast to
        compile: tests, debugging).
    dump_dir: write every graph before/after each pass and its ledger there (default: the
        ZEROCOMPILE_DUMP environment variable; read them with `zerocompile dump DIR`).
    bucket_bytes: parameters used one after another share one all-gather, and gradients produced
        one after another one reduce-scatter, up to this many bytes of full tensors (0: one
        collective per parameter). At stage 3 it bounds the gathered window. None (the default):
        the default of the backend that runs the group's collectives on the parameters' device,
        decided by `shard()` (which stores the number in the config it keeps): 16 MiB on gloo
        (measured on CPU ranks), 25 MiB on nccl and any other backend (DDP's default bucket size,
        not measured here).
    prefetch: how many buckets ahead of their use all-gathers start (0: none), i.e. how many are
        in flight at once; reductions then also stay in flight until the next one starts. At
        most 1 on gloo, where one collective runs at a time (see `passes.one_in_flight`).
    param_dtype: mixed precision: parameters are cast to it before the all-gather (fewer bytes)
        and the model computes in it; the shards stay in their own dtype (fp32 master weights).
    reduce_dtype: gradients are reduced in it and land in the shards' dtype (default: the
        dtype they were computed in).
    check_ranks: before a compiled graph first runs, the ranks compare their collective
        schedules (through the process group's store) and all raise on a mismatch instead of
        hanging. Off only for code whose ranks legitimately compile different graphs with the
        same collectives (e.g. rank-local input shapes recompiling on one rank).
    trim_heap: on the CPU with glibc's malloc, hand the heap's free pages back to the system
        every 10 steps of an optimizer that holds this model's shards, so per-step buffers do
        not leave RSS creeping (`zerocompile.heap`). Nothing runs where tcmalloc or jemalloc is
        preloaded (they need no trimming) or on accelerators.
    gather_quant: "int8" sends parameters to the all-gathers block-quantised (ZeRO++'s qwZ):
        each rank quantises its shard in blocks of `quant_block` elements (symmetric int8, one
        fp32 scale per block) and every rank dequantises what it receives into the compute
        dtype. The shards (master weights) and the optimizer never see quantised values. None:
        exact gathers. No effect at stage 0 (nothing is gathered).
    reduce_quant: "int8" reduces gradients block-quantised (ZeRO++'s qgZ): each rank quantises
        the chunk bound for each peer, one all-to-all, and the receiver dequantises and sums in
        fp32, so quantisation error is paid once per rank. Stage 0's all-reduce becomes that
        reduce-scatter plus an all-gather of the quantised result. None: exact reductions.
    quant_block: elements per quantisation block (one scale each) for both quantisations.
    quant_scope: which of those collectives are quantised. "all" (the default): every gather
        (gather_quant) and every reduction (reduce_quant). "cross_node": only those whose bytes
        leave a node, where the link is slow and the bytes decide; collectives inside a node stay
        exact, which saves their quantisation passes and error. It follows the layout: with
        hybrid sharding (shard_size, shard groups being nodes) the replicas' mean of each reduced
        shard is quantised and the reductions inside the shard group are exact (its gathers never
        leave the group, so gather_quant is refused there); with hpZ the backward's re-gathers
        inside the node are exact; plain sharding's collectives span every rank: all quantised.
    memory_budget: stage 3 only: bytes of gathered parameters a rank may keep from the
        forward for the backward instead of gathering them again; chosen statically from each
        compiled graph, identically on every rank. None (or 0): re-gather everything (plain
        stage 3); above the model's size, nothing is re-gathered (stage 2's traffic with stage
        3's sharded state between steps). Kept are parameters the backward reads, those used
        last in the forward first (`passes.recompute_gathers.choose_kept`), so a step's gathered
        peak stays near the budget plus one bucket window. The budget is per compiled graph:
        each graph of a model split by graph breaks (or compiled block by block) chooses within
        the whole budget on its own, so k graphs may keep up to k times it.
    shard_size: hybrid sharding (FSDP2's HSDP, DeepSpeed's MiCS): shard parameters, gradients
        and optimizer state over groups of this many consecutive ranks of `group` and replicate
        across the groups; gathers stay inside a shard group and only the reduced shards are
        all-reduced across replicas (`zerocompile.hybrid`). "node": the ranks of one node (from
        the launcher); a 2-D DeviceMesh ("replicate", "shard") as FSDP2 takes it. None (the
        default): shard over the whole group.
    secondary_shard_size: hpZ (ZeRO++), stage 3 only: after the forward's gather each rank keeps
        a 1/K slice of the parameter (K ranks: a node's) until the backward, which re-gathers it
        from those K ranks instead of from all N, so the backward's gathers stay inside a node;
        costs holding Φ/K instead of Φ/N from forward to backward. An int or "node"; None (the
        default): plain stage 3. Not together with shard_size.
    offload: "disk" (stages 1-3): each rank keeps its optimizer state shaped like the parameters
        (AdamW's moments, momentum) in a file under `offload_dir`, reserved by `shard()`, and the
        optimizer steps bucket by bucket through it (`zerocompile.offload`); pass the optimizer to
        `shard(..., optimizer=)`. "cpu" (stages 1-3; ZeRO-Offload, for parameters on an
        accelerator): the same state in host memory (pinned), and the update on the CPU: per bucket
        the shards and their gradients are copied to the host, stepped there by the optimizer's own
        code, and copied back. None (the default): where the parameters are.
    offload_dir: the directory for `offload="disk"`, ideally on a local NVMe disk.
    offload_masters: with `offload` and a `param_dtype` narrower than the parameters (bf16 on
        fp32): the fp32 master weights go to the offload store too, and the shards kept in memory
        and their gradients are in `param_dtype` (half the bytes); the step updates the masters
        and writes the shards from them. Gradients are then reduced, clipped and accumulated in
        `param_dtype` (a `reduce_dtype` wider than it, int8 reductions and fp16 with a GradScaler
        are refused). False: the masters stay in memory as the shards, as without offload.
    broadcast_buffers: as DDP's (and its default): forwards first take group rank 0's buffers,
        inside the compiled graph, by DDP's rule (the first forward, and each after one that
        prepared a gradient reduction); False leaves each rank's buffers its own after `shard()`'s
        one broadcast. See `zerocompile.buffers`.
    """

    stage: int = 3
    group: dist.ProcessGroup | None = None
    compiler: str = "inductor"
    dump_dir: str | None = None
    bucket_bytes: int | None = None
    prefetch: int = 1
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    check_ranks: bool = True
    trim_heap: bool = True
    broadcast_buffers: bool = True
    gather_quant: str | None = None
    reduce_quant: str | None = None
    quant_block: int = 256
    quant_scope: str = "all"
    memory_budget: int | None = None
    shard_size: int | str | DeviceMesh | None = None
    secondary_shard_size: int | str | None = None
    offload: str | None = None
    offload_dir: str | None = None
    offload_masters: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.stage, int) or isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(
                f"ZeRO stage must be 0, 1, 2 or 3, got {self.stage!r}: 0 = data parallel, "
                "1 = shard optimizer state, 2 = also gradients, 3 = also parameters"
            )
        if self.compiler not in COMPILERS:
            raise ValueError(f"compiler must be one of {COMPILERS}, got {self.compiler!r}")
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"{name} must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")
        for name in ("check_ranks", "trim_heap", "broadcast_buffers", "offload_masters"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("gather_quant", "reduce_quant"):
            if getattr(self, name) not in QUANTISATIONS:
                raise ValueError(f"{name} must be one of {list(QUANTISATIONS)}, got {getattr(self, name)!r}")
        if isinstance(self.quant_block, bool) or not isinstance(self.quant_block, int) or self.quant_block < 1:
            raise ValueError(
                f"quant_block must be an int >= 1 (elements per quantisation scale; default 256), got {self.quant_block!r}"
            )
        if self.quant_scope not in QUANT_SCOPES:
            raise ValueError(f"quant_scope must be one of {list(QUANT_SCOPES)}, got {self.quant_scope!r}")
        if self.quant_scope == "cross_node":
            if not (self.gather_quant or self.reduce_quant):
                raise ValueError(
                    "quant_scope='cross_node' picks which quantised collectives cross nodes, and none is "
                    "quantised: set gather_quant='int8' and/or reduce_quant='int8', or leave quant_scope='all'"
                )
            if self.gather_quant and self.shard_size is not None:
                raise ValueError(
                    "gather_quant='int8' with quant_scope='cross_node' and hybrid sharding (shard_size) "
                    "quantises nothing: hybrid sharding's all-gathers stay inside the shard group (a node). "
                    "Drop gather_quant (reduce_quant='int8' quantises the replicas' mean, which crosses "
                    "nodes), or use quant_scope='all' to quantise inside the node too"
                )
        if self.memory_budget is not None:
            if isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int) or self.memory_budget < 0:
                raise ValueError(
                    f"memory_budget must be None or a number of bytes >= 0 (gathered parameters kept for the "
                    f"backward at stage 3), got {self.memory_budget!r}"
                )
            if self.memory_budget and self.stage != 3:
                raise ValueError(
                    f"memory_budget applies to stage 3 only (stages 1-2 keep every gathered parameter for the "
                    f"backward already), got stage {self.stage}: leave memory_budget=None or use stage=3"
                )
        check_shard_size(self.shard_size)
        if self.secondary_shard_size is not None:
            if isinstance(self.secondary_shard_size, DeviceMesh):
                raise ValueError("secondary_shard_size takes a number of ranks or 'node', not a DeviceMesh")
            check_shard_size(self.secondary_shard_size, "secondary_shard_size")
            if self.stage != 3:
                raise ValueError(
                    f"secondary_shard_size (hpZ) applies to stage 3 only (the backward's re-gathers), got stage "
                    f"{self.stage}: leave secondary_shard_size=None or use stage=3"
                )
            if self.shard_size is not None:
                raise ValueError(
                    "shard_size and secondary_shard_size are two answers to one problem: hybrid sharding keeps "
                    "every gather inside a node, hpZ only the backward's. Give one of them"
                )
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be one of {list(OFFLOADS)}, got {self.offload!r}")
        if self.offload is not None and self.stage == 0:
            raise ValueError(
                f"offload={self.offload!r} moves each rank's shard of the optimizer state, and stage 0 does not "
                "shard it: use stage 1, 2 or 3"
            )
        if self.offload == "disk":
            if not isinstance(self.offload_dir, (str, os.PathLike)):
                raise ValueError(
                    f"offload='disk' needs offload_dir, the directory for the optimizer state files (a local "
                    f"NVMe disk is best), got {self.offload_dir!r}"
                )
        elif self.offload_dir is not None:
            raise ValueError(f"offload_dir={self.offload_dir!r} is only read with offload='disk': set offload='disk' too")
        if (self.bucket_bytes is not None and self.bucket_bytes < 0) or self.prefetch < 0:
            raise ValueError(
                f"bucket_bytes and prefetch must be >= 0, got {self.bucket_bytes} and {self.prefetch}"
            )

    def with_options(self, options: dict[str, Any] | None) -> ZeroConfig:
        """This config with `torch.compile(..., options=...)` overrides applied."""
        if not options:
            return self
        unknown = sorted(set(options) - set(COMPILE_TIME_FIELDS))
        if unknown:
            raise ValueError(
                f"unknown option(s) {unknown} for backend='zero'; valid options: "
                f"{list(COMPILE_TIME_FIELDS)} (the stage and group are set by zerocompile.shard())"
            )
        if "bucket_bytes" in options and options["bucket_bytes"] is None:
            # The backend's default is decided by shard(), which knows the group and device.
            raise ValueError(
                "options={'bucket_bytes': None}: give a number of bytes; the backend's default "
                f"({self.bucket_bytes} for this model) is what applies without the option"
            )
        return dataclasses.replace(self, **options)

    def for_backend(self, backend: str) -> ZeroConfig:
        """This config with `bucket_bytes=None` replaced by `backend`'s default ("gloo", "nccl",
        ...: the backend that runs the group's collectives on the parameters' device)."""
        if self.bucket_bytes is not None:
            return self
        return dataclasses.replace(self, bucket_bytes=default_bucket_bytes(backend))


def default_bucket_bytes(backend: str) -> int:
    """`bucket_bytes` when the config leaves it None: gloo's measured 16 MiB, else DDP's 25 MiB."""
    return GLOO_BUCKET_BYTES if backend == "gloo" else ACCELERATOR_BUCKET_BYTES


def refuse_gloo_gathers_on_accelerator(config: ZeroConfig, backend: str, device: torch.device) -> None:
    """Refuse stages 1-3 on gloo for parameters on an accelerator, before anything changes.

    Those stages gather parameters, each bucket with one coalesced all-gather, and gloo's
    coalesced all-gather of accelerator tensors kills the process: SIGSEGV in `gloo::allgather`'s
    memmove, pytorch/pytorch#152645 (open). Seen on an H200 with torch 2.11 (2026-11-27): two gloo
    ranks sharing cuda:0 trained stage 0 (all-reduce) exactly like DDP, and a rank died at stage 1.
    """
    if stage_policy(config.stage).shards_parameters and backend == "gloo" and device.type != "cpu":
        raise ValueError(
            f"stage {config.stage} on a gloo group gathers the parameters on {device} with coalesced "
            "all-gathers, which gloo cannot run on accelerator tensors (the process dies: "
            "pytorch/pytorch#152645): use nccl for the group (or 'cpu:gloo,cuda:nccl'), keep the model "
            "on the CPU, or use stage 0"
        )


def refuse_concurrent_gloo_gathers(config: ZeroConfig, group: dist.ProcessGroup) -> None:
    """Refuse `prefetch` > 1 on a gloo group: it could not keep more than one gather in flight.

    On gloo the compiled graphs run one collective at a time (`passes.one_in_flight`): torch's gloo
    corrupts its heap or hangs when two run at once on its two worker threads (pytorch/pytorch#65231;
    measured 2026-11-28 with torch 2.13, see that module). A deeper prefetch would change nothing
    there, so it is refused rather than silently ignored; NCCL takes any depth.
    """
    if stage_policy(config.stage).shards_parameters and config.prefetch > 1 and runs_on_gloo(group):
        raise ValueError(
            f"prefetch={config.prefetch} asks for {config.prefetch} all-gathers in flight, but on gloo "
            "zerocompile runs one collective at a time (torch's gloo corrupts memory when two run at once: "
            "pytorch/pytorch#65231), so it would change nothing: on a gloo group use prefetch=1 (the "
            "default) or 0"
        )


def config_from_kwargs(config: ZeroConfig | None, stage: int | None, kwargs: dict[str, Any]) -> ZeroConfig:
    """Merge `shard(model, config, stage=..., **kwargs)` into one validated `ZeroConfig`."""
    valid = {f.name for f in dataclasses.fields(ZeroConfig)}
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise TypeError(f"unknown ZeroConfig setting(s) {unknown}; valid: {sorted(valid)}")
    base = config if config is not None else ZeroConfig()
    if stage is not None:
        kwargs = {**kwargs, "stage": stage}
    return dataclasses.replace(base, **kwargs)
