"""The optimizer state offloaded to disk or host memory (--offload): what leaves the device and what
a step moves."""

from __future__ import annotations

import dataclasses
from typing import Any

from .records import StagePlan
from .text import format_bytes, table


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """One stage's optimizer state offloaded (offload="disk" or "cpu"), per rank."""

    stage: int
    offload: str  # "disk" or "cpu"
    offloaded: float  # the optimizer state's bytes, out of the device's memory
    held: float  # what stays in the device's memory between steps: params and grads
    # disk: through the disk each step, the state read and written back; cpu: copied between the
    # device and the host, the parameter shards and gradients to the host and the parameters back
    moved_per_step: float
    floor_seconds: float | None  # moved_per_step at the disk's bandwidth, where given

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def offload_plan(plans: list[StagePlan], offload: str, megabytes_per_second: float | None) -> list[OffloadPlan]:
    """Stages 1-3 of `plans` with their optimizer state offloaded (stage 0 cannot offload it)."""
    return [
        OffloadPlan(
            s.stage, offload, s.optimizer, s.params + s.grads,
            2 * s.optimizer if offload == "disk" else 2 * s.params + s.grads,
            2 * s.optimizer / (megabytes_per_second * 1e6) if megabytes_per_second else None,
        )
        for s in plans
        if s.stage > 0 and s.memory_budget is None
    ]  # fmt: skip


def offload_report(plans: list[OffloadPlan], offload: str, megabytes_per_second: float | None) -> str:
    if offload == "cpu":
        header = ["stage", "in host memory", "held on the device", "copied device <-> host per step"]
        rows = [[str(p.stage), format_bytes(p.offloaded), format_bytes(p.held), format_bytes(p.moved_per_step)] for p in plans]
        intro = (
            "offload='cpu': each rank keeps its optimizer state in host memory and updates on the CPU: per step its "
            "parameter shards and gradients are copied to the host and the parameters back. Gradients and parameters "
            "stay on the device (held)."
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
            "itself is slower. Gradients and parameters stay in memory (held).",
            "",
            table(header, rows),
        ]
    )
