"""Simulated networks (zerocompile.tools.netsim): the rate a link is shaped to is the rate a probe
measures, ranks of one node talk unshaped, and no namespace or interface outlives a run, even one
that failed or was killed. Needs iproute2 and CAP_NET_ADMIN (CI runs as root)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from zerocompile.tools import bench, netsim
from zerocompile.tools.bench.orchestration import bench as run_bench
from zerocompile.tools.spawn import RanksFailed

# A rate the shaper holds well below what one core moves over loopback (10-15 Gbit/s here), so a
# busy CI machine still fills the link; the probe's own error is ~1 % (measured, 2026-11-28).
RATE, BITS = "500mbit", 500e6


def _unavailable() -> str:
    """Why no network can be simulated here ('' if one can): no iproute2, no CAP_NET_ADMIN, or a
    kernel or container that refuses namespaces or the shaper (building one link tells)."""
    try:
        netsim.check_can_simulate()
        with netsim.SimulatedNetwork(1, RATE):
            return ""
    except netsim.NetworkError as error:
        return str(error)


# Skipped, not failed, where the machine cannot build a namespace (no root, a container that
# refuses them): that is the machine's limit, not zerocompile's. CI runs as root and installs
# iproute2 (.ci/run), so there these tests run.
UNAVAILABLE = _unavailable()
needs_namespaces = pytest.mark.skipif(bool(UNAVAILABLE), reason=UNAVAILABLE)


def _link_rate(probe: Callable[[], float]) -> float:
    """The best of up to three probes (the first within 10 % of RATE ends it). Under the other test
    worker's ranks a probe's sender can lose its core and leave the link idle (seen: 445 Mbit/s
    through 500mbit during the full suite): starved, it reads low, never high, so the best one is
    the link's; a shaper set to another rate still fails every try."""
    best = 0.0
    for _ in range(3):
        best = max(best, probe())
        if abs(best / BITS - 1) <= 0.10:
            break
    return best


def _ours() -> list[str]:
    return [name for name in netsim.namespaces() if name.startswith(f"{netsim.PREFIX}{os.getpid()}n")]


def _our_interfaces() -> list[str]:
    listed = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return [line for line in listed.splitlines() if f"zcv{os.getpid() % 100000}" in line]


@needs_namespaces
def test_one_link_carries_the_rate_asked_for() -> None:
    with netsim.SimulatedNetwork(1, RATE) as network:
        assert [node.interface for node in network.nodes] == ["lo"]
        measured = _link_rate(network.probe)
    assert abs(measured / BITS - 1) <= 0.10, f"{measured / 1e6:.0f} Mbit/s through a {RATE} link"
    assert _ours() == []


@needs_namespaces
def test_two_nodes_cross_the_link_and_talk_unshaped_inside_a_node() -> None:
    with netsim.SimulatedNetwork(2, RATE) as network:
        assert [node.address for node in network.nodes] == list(netsim.NODE_ADDRESSES)
        across = _link_rate(network.probe)
        node = network.nodes[0]
        within = netsim.probe(node, dataclasses.replace(node, address="127.0.0.1"))  # the node's own loopback
        assert len(_ours()) == 2 and len(_our_interfaces()) == 0  # the veth pair lives in the namespaces
    assert abs(across / BITS - 1) <= 0.10, f"{across / 1e6:.0f} Mbit/s between nodes through a {RATE} link"
    assert within > 2 * BITS, f"ranks of one node talk at {within / 1e6:.0f} Mbit/s, as if shaped"
    assert _ours() == []


@needs_namespaces
def test_nothing_is_left_behind_when_the_run_fails() -> None:
    with pytest.raises(RuntimeError, match="the benchmark failed"):
        with netsim.SimulatedNetwork(2, RATE):
            assert len(_ours()) == 2
            raise RuntimeError("the benchmark failed")
    assert _ours() == [] and _our_interfaces() == []


@needs_namespaces
def test_nothing_is_left_behind_when_building_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(network: netsim.SimulatedNetwork, namespace: str, interface: str) -> None:
        raise netsim.NetworkError("tc refused the shaper")

    monkeypatch.setattr(netsim.SimulatedNetwork, "_shape", refused)
    with pytest.raises(netsim.NetworkError, match="tc refused"):
        with netsim.SimulatedNetwork(2, RATE):
            pass
    assert _ours() == [] and _our_interfaces() == []


@needs_namespaces
def test_a_killed_runs_namespaces_are_removed_by_the_next() -> None:
    stale = f"{netsim.PREFIX}{_a_dead_pid()}n0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with netsim.SimulatedNetwork(1, RATE):
            assert stale not in netsim.namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)


def _a_dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.fast
@pytest.mark.parametrize(
    "text, message", [("fast", "a number and a unit, e.g. 1gbit"), ("1gb", "e.g. 1gbit"), ("0gbit", "must be positive")]
)
def test_a_rate_that_is_not_one_names_the_form(text: str, message: str) -> None:
    with pytest.raises(netsim.NetworkError, match=message):
        netsim.SimulatedNetwork(1, text)


@pytest.mark.fast
def test_rates_in_bits_per_second() -> None:
    assert [netsim.parse_rate(text) for text in ("1gbit", "2.5gbit", "100mbit", "10kbit")] == [1e9, 2.5e9, 1e8, 1e4]
    assert netsim.parse_rate("unlimited") == float("inf")


@needs_namespaces
@pytest.mark.parametrize("rate, shaped", [("unlimited", False), (RATE, True)])
def test_an_unlimited_network_is_the_same_network_unshaped(rate: str, shaped: bool) -> None:
    # The floor of a mode over a link starts from its step on the same two nodes without a shaper.
    with netsim.SimulatedNetwork(2, rate) as network:
        for node in network.nodes:
            qdiscs = subprocess.run(
                node.command(["tc", "qdisc", "show", "dev", node.interface]), capture_output=True, text=True, check=True
            ).stdout
            assert ("tbf" in qdiscs) == shaped, qdiscs


@pytest.mark.fast
def test_without_iproute2_or_the_capability_the_error_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netsim.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    with pytest.raises(netsim.NetworkError, match="needs tc .*install it, e.g. apt-get install iproute2"):
        netsim.SimulatedNetwork(1, "1gbit").__enter__()
    monkeypatch.undo()
    monkeypatch.setattr(netsim, "_has_net_admin", lambda: False)
    with pytest.raises(netsim.NetworkError, match="CAP_NET_ADMIN.*run as root"):
        netsim.SimulatedNetwork(2, "1gbit").__enter__()


def _all_reduce_across(rank: int, fail_on: int | None = None) -> dict:
    """A rank of `run_ranks`: joins the group torchrun set up and all-reduces 8 MB."""
    import torch
    import torch.distributed as dist

    if rank == fail_on:
        raise ValueError(f"rank {rank} was told to fail")
    dist.init_process_group("gloo")
    tensor = torch.full((2 << 20,), float(rank + 1))
    dist.all_reduce(tensor)
    return {"world": dist.get_world_size(), "sum": tensor[0].item(), "interface": os.environ["GLOO_SOCKET_IFNAME"]}


@needs_namespaces
def test_torchrun_starts_the_ranks_of_each_node_inside_it() -> None:
    with netsim.SimulatedNetwork(2, "1gbit") as network:
        results = network.run_ranks(_all_reduce_across, 2, timeout=240)
        interfaces = [node.interface for node in network.nodes]
    assert [result["world"] for result in results] == [4] * 4
    assert [result["sum"] for result in results] == [10.0] * 4
    assert [result["interface"] for result in results] == [interfaces[0]] * 2 + [interfaces[1]] * 2


@needs_namespaces
def test_a_failing_rank_reports_its_traceback() -> None:
    with netsim.SimulatedNetwork(1, "1gbit") as network:
        with pytest.raises(RanksFailed, match="rank 1 was told to fail") as failed:
            network.run_ranks(_all_reduce_across, 2, (1,), timeout=240)
    assert 1 in failed.value.failures
    assert _ours() == []


@needs_namespaces
@pytest.mark.parametrize(
    "shape, modes",
    [(["--ranks", "2"], ["ddp"]), (["--nodes", "2", "--ranks", "1"], ["ddp", "zero3-eager"])],
    ids=["one-link", "two-nodes"],
)
def test_bench_runs_its_ranks_through_the_link_and_reports_it(shape: list[str], modes: list[str], tmp_path) -> None:
    """A 2-step bench in each network shape (DDP; on two nodes also stage 3 with the eager compiler:
    the plumbing is what is tested), with what crossed the link beside the ledgers' prediction."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    argv = ["--quick", "--modes", ",".join(modes), "--batch-size", "2", "--link", RATE, *shape, "--out", str(tmp_path)]
    assert bench.run(parser.parse_args(argv)) == 0
    summary = json.loads((tmp_path / "bench.json").read_text())
    link = summary["settings"]["link"]
    assert (link["rate"], link["nodes"], summary["settings"]["ranks"]) == (RATE, 1 if "--nodes" not in shape else 2, 2)
    assert abs(link["probe_bits_per_second"] / BITS - 1) <= 0.10, link
    ddp, *zero3 = summary["modes"]
    assert ddp["status"] == "ok" and ddp["sent_bytes_per_step"] > 0
    assert ddp["link_bytes_predicted"] is None and len(ddp["link_bytes_per_step"]) == link["nodes"]
    assert f"of {RATE} (" in (tmp_path / "bench.md").read_text()
    assert _ours() == [] and _our_interfaces() == []
    if not zero3:
        return
    (zero3,) = zero3
    # Every node's bytes over the link: the ledgers' plus TCP/IP headers, gloo's framing and the
    # barriers (+0.9 to +1.0 % measured on this tiny GPT, whose messages are small).
    assert zero3["status"] == "ok" and len(zero3["link_bytes_predicted"]) == link["nodes"]
    for measured, predicted in zip(zero3["link_bytes_per_step"], zero3["link_bytes_predicted"], strict=True):
        assert predicted <= measured <= 1.03 * predicted, (measured, predicted)
    assert 0 < zero3["waiting_s"] < zero3["step_time_s"]
    assert zero3["floor_s"] == max(zero3["link_bytes_per_step"]) * 8 / link["probe_bits_per_second"]
    assert "| zero3-eager | " in (tmp_path / "bench.md").read_text().split("Over the link")[1]


@pytest.mark.fast
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "2"], "--nodes simulates nodes joined by a link: give its rate, e.g. --link 1gbit"),
        (["--link", "1gbit", "--fake-ranks", "4"], "--fake-ranks sends nothing: leave one out"),
        (["--modes", "none", "--interleave", "none"], "--modes none leaves nothing to run"),
        (["--floor-from", "bench.json"], "--floor-from gives the floors of a run over a simulated link: add --link"),
    ],
)
def test_bench_refuses_a_network_it_cannot_simulate(argv: list[str], message: str, tmp_path) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(SystemExit, match=message):
        run_bench(parser.parse_args(["--quick", *argv, "--out", str(tmp_path)]))
    assert not (tmp_path / "bench.json").exists()


def _sleep(rank: int) -> None:
    import time

    time.sleep(600)


_TERMINATED_RUN = """
import sys, time
from zerocompile.tools import netsim

def sleep(rank):
    time.sleep(600)

if __name__ == "__main__":
    with netsim.SimulatedNetwork(2, sys.argv[1]) as network:
        network.run_ranks(sleep, 1, env={"ZC_TERMINATED_RUN": sys.argv[2]})
"""


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment holds `marker` (the ranks and torchruns of one run)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


@needs_namespaces
def test_sigterm_leaves_no_namespace_and_no_rank_behind(tmp_path: Path) -> None:
    """A bench over a simulated network stopped by `kill` (SIGTERM): Python's default would end it
    on the spot, leaving both nodes' torchruns and ranks running and the namespaces in place."""
    script = tmp_path / "terminated_run.py"
    script.write_text(_TERMINATED_RUN)
    marker = f"zc-terminated-{os.getpid()}-{time.monotonic_ns()}"
    run = subprocess.Popen([sys.executable, str(script), RATE, marker], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_processes_with(marker)) < 4 and time.monotonic() < deadline:  # 2 torchruns, 2 ranks
            time.sleep(0.5)
        assert len(_processes_with(marker)) >= 4, "the ranks never started"
        named = [n for n in netsim.namespaces() if n.startswith(f"{netsim.PREFIX}{run.pid}n")]
        assert len(named) == 2
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 128 + signal.SIGTERM, output
    deadline = time.monotonic() + 10  # the ranks follow their killed torchrun
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in _processes_with(marker)}
    assert left == {}, f"processes left running: {left}"
    assert [n for n in netsim.namespaces() if n.startswith(f"{netsim.PREFIX}{run.pid}n")] == []


@needs_namespaces
def test_a_timeout_kills_every_rank_of_every_node() -> None:
    with netsim.SimulatedNetwork(2, RATE) as network:
        with pytest.raises(TimeoutError, match="still running after 20 s"):
            network.run_ranks(_sleep, 1, timeout=20)
    left = subprocess.run(["pgrep", "-f", "zerocompile-netsim-"], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left running: {left}"
    assert _ours() == []
