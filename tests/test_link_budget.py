"""tools/link_budget.py: the figures `zerocompile bench --link` adds per mode (waiting, bytes over
the link, the ledgers' prediction, the floor), on made-up inputs; tests/test_netsim.py runs them
over a real simulated link."""

from __future__ import annotations

import time

import pytest

from zerocompile.tools import link_budget
from zerocompile.tools.bench.orchestration import add_floors, unlimited_steps

pytestmark = pytest.mark.fast

# /proc/net/dev as Linux writes it: two header lines, then receive's 8 counters and transmit's 8.
NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:  123456     100    0    0    0     0          0         0   654321     200    0    0    0     0       0          0
zcv123450: 98765432  5000    0    0    0     0          0         0 12345678    4000    0    0    0     0       0          0
"""


def test_transmitted_bytes_are_the_interfaces_ninth_counter() -> None:
    assert link_budget.transmitted_bytes("lo", NET_DEV) == 654321
    assert link_budget.transmitted_bytes("zcv123450", NET_DEV) == 12345678
    with pytest.raises(ValueError, match="no interface 'eth0'"):
        link_budget.transmitted_bytes("eth0", NET_DEV)


def test_this_process_reads_its_own_loopback() -> None:
    assert link_budget.transmitted_bytes("lo") >= 0


def test_one_link_carries_every_byte_two_nodes_what_leaves_each() -> None:
    sent, across = [100, 200, 300, 400], [10, 20, 30, 40]
    assert link_budget.predicted_link_bytes(sent, across, nodes=1) == [1000]
    assert link_budget.predicted_link_bytes(sent, across, nodes=2) == [30, 70]


def test_the_floor_is_the_slower_of_compute_and_the_link() -> None:
    # 125 MB at 1 Gbit/s: 1 s on the wire.
    assert link_budget.floor_seconds(0.4, [125e6, 100e6], 1e9) == pytest.approx(1.0)
    assert link_budget.floor_seconds(2.0, [125e6], 1e9) == 2.0
    assert link_budget.floor_seconds(None, [], 1e9) == 0.0


def test_a_sleeping_thread_is_blocked_a_computing_one_is_not() -> None:
    start, before = time.perf_counter(), link_budget.thread_clock()
    time.sleep(0.2)
    slept = time.perf_counter() - start
    assert link_budget.blocked_seconds(slept, before, link_budget.thread_clock()) >= 0.9 * slept
    start, before = time.perf_counter(), link_budget.thread_clock()
    while time.perf_counter() - start < 0.2:
        pass
    busy = time.perf_counter() - start
    # On a core or waiting for one the whole time (another process may take the core: not blocked).
    assert link_budget.blocked_seconds(busy, before, link_budget.thread_clock()) < 0.5 * busy


def test_floors_come_from_the_unlimited_run_and_the_link(tmp_path) -> None:
    unlimited = {"modes": [{"mode": "zero3", "status": "ok", "step_time_s": 0.5}],
                 "interleaved": {"step_time_s": {"zero3": 0.6}}}  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(__import__("json").dumps(unlimited))
    steps = unlimited_steps(path)
    assert steps == {"zero3": 0.6}  # the interleaved median, as the ratios to quote are
    measured = {"zero3": {"status": "ok", "step_time_s": 1.5, "link_bytes_per_step": [125e6, 50e6]},
                "ddp": {"status": "ok", "step_time_s": 0.3, "link_bytes_per_step": [12.5e6]}}  # fmt: skip
    interleaved = {"step_time_s": {"zero3": 1.2}, "link": {"zero3": {"link_bytes_per_step": [25e6]}}}
    add_floors(measured, interleaved, 1e9, steps)
    assert measured["zero3"]["floor_s"] == pytest.approx(1.0) and measured["zero3"]["step_over_floor"] == pytest.approx(1.5)
    # No unlimited step for ddp: its floor is the link's part alone.
    assert measured["ddp"]["floor_s"] == pytest.approx(0.1) and measured["ddp"]["unlimited_step_s"] is None
    assert interleaved["link"]["zero3"]["floor_s"] == pytest.approx(0.6)
    assert interleaved["link"]["zero3"]["step_over_floor"] == pytest.approx(2.0)
