"""The optimizer state offloaded to disk or host memory (--offload): what leaves the device and what
a step moves. With --model and a --param-dtype narrower than trainable parameters, their fp32 master
weights go to the store too and their shards and gradients stay in memory in --param-dtype
(ZeroConfig.offload_masters)."""

from __future__ import annotations

import dataclasses
from typing import Any

from zerocompile.passes.stages import padded_numel

from .model import CountedModel
from .records import ELEMENT_BYTES, StagePlan
from .text import format_bytes, table


@dataclasses.dataclass(frozen=True)
class Masters:
    """Per rank at stages 1-3 (alike: each shards every parameter the same way): the master weights
    offload moves into its store, and what that takes off the device's parameter and gradient
    bytes each."""

    stored: float  # the masters' bytes, in the parameters' own dtype
    narrowed: float  # bytes the shards (and, alike, their gradients) lose in memory


def masters(counted: CountedModel, ranks: int, param_dtype: str | None) -> Masters:
    """What offload_masters moves for `counted` at `param_dtype`: every trainable floating-point
    parameter wider than it (the optimizer's; frozen ones keep their own dtype)."""
    narrow = ELEMENT_BYTES[param_dtype] if param_dtype else None
    moved = [
        (padded_numel(param.shape, ranks) // ranks, param.element_bytes)
        for param in counted.trainable
        if narrow is not None and param.dtype.is_floating_point and param.element_bytes > narrow
    ]
    return Masters(sum(numel * size for numel, size in moved), sum(numel * (size - narrow) for numel, size in moved))


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """One stage's optimizer state offloaded (offload="disk" or "cpu"), per rank."""

    stage: int
    offload: str  # "disk" or "cpu"
    offloaded: float  # the optimizer state's bytes (and the masters'), out of the device's memory
    held: float  # what stays in the device's memory between steps: params and grads
    # disk: through the disk each step, the state (and masters) read and written back; cpu: copied
    # between the device and the host, the gradients and the parameter shards without masters to
    # the host and the parameters back
    moved_per_step: float
    floor_seconds: float | None  # moved_per_step at the disk's bandwidth, where given

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def offload_plan(
    plans: list[StagePlan], offload: str, megabytes_per_second: float | None, moved: Masters = Masters(0, 0)
) -> list[OffloadPlan]:
    """Stages 1-3 of `plans` with their optimizer state (and `moved`'s masters) offloaded (stage 0
    cannot offload it)."""
    offloaded = []
    for s in plans:
        if s.stage == 0 or s.memory_budget is not None:
            continue
        params, grads, stored = s.params - moved.narrowed, s.grads - moved.narrowed, s.optimizer + moved.stored
        through = 2 * stored if offload == "disk" else params + grads + (s.params - moved.stored)
        seconds = through / (megabytes_per_second * 1e6) if megabytes_per_second and offload == "disk" else None
        offloaded.append(OffloadPlan(s.stage, offload, stored, params + grads, through, seconds))
    return offloaded


def offload_report(plans: list[OffloadPlan], offload: str, megabytes_per_second: float | None, masters_bytes: float = 0) -> str:
    masters_text = (
        f" With --param-dtype the fp32 master weights ({format_bytes(masters_bytes)}) go with the state, and the "
        "shards and gradients held are in --param-dtype." if masters_bytes else ""
    )
    if offload == "cpu":
        header = ["stage", "in host memory", "held on the device", "copied device <-> host per step"]
        rows = [[str(p.stage), format_bytes(p.offloaded), format_bytes(p.held), format_bytes(p.moved_per_step)] for p in plans]
        intro = (
            "offload='cpu': each rank keeps its optimizer state in host memory and updates on the CPU: per step its "
            "parameter shards and gradients are copied to the host and the parameters back. Gradients and parameters "
            "stay on the device (held)." + masters_text
        )
        return "\n".join([intro, "", table(header, rows)])
    header = ["stage", "on disk", "held in memory", "through the disk per step", "at least"]
    rows = [
        [str(p.stage), format_bytes(p.offloaded), format_bytes(p.held), format_bytes(p.moved_per_step),
         f"{p.floor_seconds:.2f} s" if p.floor_seconds is not None else "-"]
        for p in plans
    ]  # fmt: skip
    speed = (
        f"at {megabytes_per_second:,.0f} MB/s" if megabytes_per_second else "(give --disk-bandwidth, which `zerocompile check --offload-dir DIR` measures)"
    )
    return "\n".join(
        [
            "offload='disk': each rank keeps its optimizer state in a file and streams it through each step, read "
            f"and written back once; the step takes at least that traffic's time {speed}, more where the optimizer "
            "itself is slower. Gradients and parameters stay in memory (held)." + masters_text,
            "",
            table(header, rows),
        ]
    )
