"""How `zerocompile bench` shows what it measured: a line per mode as it finishes, bench.md's
tables and bench.png's chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerocompile.tools.bench.summaries import COMPILE_PHASES, OFFLOAD_BOUND, PHASES

MB = 1e6


def progress_line(mode: dict[str, Any]) -> str:
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


def described(model_size: str, layers: int | None) -> str:
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
        f"{settings['ranks']} {settings['backend']} ranks, GPT {described(settings['model_size'], settings.get('layers'))} "
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
    """Where each compiling mode's compile went (see "compile phases" in `zerocompile bench --help`)."""
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


def plot(summary: dict[str, Any], path: Path) -> None:
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
        f"GPT {described(settings['model_size'], settings.get('layers'))} (Φ = {settings['phi']:,}), {settings['optimizer']}",
        fontsize="medium",
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

