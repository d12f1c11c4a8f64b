"""How each figure of a `zerocompile bench` run was measured, as bench.json's "method" says and
bench.md lists under its table."""

from __future__ import annotations

from pathlib import Path

from zerocompile.tools.bench.deepspeed_modes import DEEPSPEED_METHOD
from zerocompile.tools.bench.summaries import OFFLOAD_BOUND

# What the figures mean under --fake-ranks, where they differ from a real run (see `zerocompile bench --help`).
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
# What the figures of a mode with its optimizer state on disk mean (rank.py's disk figures, summaries.py's offload figures).
OFFLOAD_METHOD = {
    "optimizer_on_disk": "modes with their optimizer state on disk (zc.shard(offload='disk') under --offload-dir): "
    "after the timed steps every rank at once (as in a step: the ranks of a machine share its disk) measures the "
    "directory's bandwidth on a file of its state's size (zerocompile.offload_files.measure_disk_bandwidth: written and "
    "fsync'd, its pages evicted, read back); state = the rank's state in the files; moved = the state read once and "
    "written once per step; floor = state / read bandwidth + state / write bandwidth; the rank with the largest "
    "floor is shown. optimizer = median over steps of the slowest rank's optimizer step; in memory = the same of "
    f"the mode it offloads, where they ran interleaved (n/a otherwise); bound = {OFFLOAD_BOUND} x max(in memory, floor)",
}


def method(inductor_cache: Path | None, fake: bool, link: bool, offload: bool, deepspeed: bool = False) -> dict[str, str]:
    """What each figure means in a run with `inductor_cache` (--inductor-cache, or None), on a fake
    group (`fake`), over a simulated `link`, with a mode whose optimizer state is on disk (`offload`),
    with DeepSpeed's modes (`deepspeed`)."""
    return {
        "step_time": "median over timed steps of the slowest rank's step; each step starts after a barrier",
        "compile_time": "first warm-up step minus the median step; "
        + (f"the Inductor caches kept in {inductor_cache} (C++ kernels an earlier run compiled are reused; "
           "graphs are compiled afresh, as every recorded compile is)"
           if inductor_cache else "a fresh Inductor cache per mode and rank"),
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
        **(LINK_METHOD if link else {}),
        **(OFFLOAD_METHOD if offload else {}),
        **({"deepspeed": DEEPSPEED_METHOD} if deepspeed else {}),
    }
