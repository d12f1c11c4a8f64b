"""Where a step's time goes on a slow link: how long a rank waited, how many bytes crossed the
link (counted by the kernel, and predicted by zerocompile's ledgers), and the floor a mode cannot
beat.

  waiting    seconds the rank's main thread was neither running nor waiting for a core
             (/proc/thread-self/schedstat): blocked in the kernel, which in a training step means
             waiting for a collective while gloo's threads move its bytes. The bench gives each
             rank one compute thread, so the main thread is where the rank computes.
  link bytes what the shaped interface transmitted during the step, headers included, read from
             /proc/net/dev in the rank's network namespace: with one link, loopback carries every
             rank's traffic; on two nodes, each node's veth carries what leaves that node (the
             MTU is 64 KiB, so headers are about 0.1 %).
  predicted  from the ledgers of the graphs a step ran (and the optimizer's step): one link
             carries every byte each rank sends; between two nodes, each node sends its ranks'
             bytes to ranks on the other node (`GraphLedger.sent_across_nodes`).
  floor      max(the mode's step on an unlimited link, the busier direction's bytes / the rate
             a probe measured): neither compute nor the link can go faster.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path


def thread_clock() -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for one) of the calling thread so far."""
    on_core, waiting_for_core, _slices = Path("/proc/thread-self/schedstat").read_text().split()
    return int(on_core) / 1e9, int(waiting_for_core) / 1e9


def blocked_seconds(wall: float, before: tuple[float, float], after: tuple[float, float]) -> float:
    """Of `wall` seconds between two `thread_clock()` readings, those the thread was blocked."""
    return max(0.0, wall - (after[0] - before[0]) - (after[1] - before[1]))


def link_interface() -> str | None:
    """The interface a simulated network gave this rank's gloo (netsim sets GLOO_SOCKET_IFNAME)."""
    return os.environ.get("GLOO_SOCKET_IFNAME")


def transmitted_bytes(interface: str, table: str | None = None) -> int:
    """Bytes `interface` has transmitted, from /proc/net/dev of this process's network namespace
    (or from `table`, that file's text)."""
    text = Path("/proc/net/dev").read_text() if table is None else table
    for line in text.splitlines():
        name, _, counters = line.partition(":")
        if counters and name.strip() == interface:
            return int(counters.split()[8])  # receive: 8 counters, then transmit's bytes
    raise ValueError(f"no interface {interface!r} in /proc/net/dev")


def predicted_link_bytes(sent: Sequence[int], across: Sequence[int], nodes: int) -> list[int]:
    """Bytes per step leaving each node over the link, from each rank's ledger figures (`sent`: all
    it sends; `across`: what it sends to other nodes), ranks numbered node by node."""
    if nodes == 1:
        return [sum(sent)]
    per_node = len(across) // nodes
    return [sum(across[node * per_node : (node + 1) * per_node]) for node in range(nodes)]


def floor_seconds(unlimited_step: float | None, link_bytes: Iterable[float], bits_per_second: float) -> float:
    """max(step on an unlimited link, the busiest direction's bytes at the link's rate)."""
    transfer = max(link_bytes, default=0) * 8 / bits_per_second
    return transfer if unlimited_step is None else max(unlimited_step, transfer)
