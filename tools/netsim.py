"""Simulated networks for benchmarks: one slow link, or two nodes joined by one, made of Linux
network namespaces that this process creates and removes.

On one machine the ranks of a job talk over loopback, where a byte costs one memcpy on the cores
that compute. Real jobs are bandwidth-bound between nodes. `SimulatedNetwork` builds, with `ip`
and `tc` (iproute2; CAP_NET_ADMIN, e.g. root):

- `nodes=1`: one namespace whose loopback is shaped by a token bucket (`tc qdisc ... tbf`) to
  `rate`: every byte between ranks crosses one slow link.
- `nodes=2`: two namespaces joined by a veth pair, shaped to `rate` at both ends, with the
  addresses 127.77.0.1 and 127.77.0.2 (loopback-range, so nothing outside the machine is ever
  addressed; `route_localnet` lets them leave a loopback interface). Ranks of one node talk over
  its own loopback, unlimited; ranks of different nodes cross the link.

Nothing outside the namespaces changes. They are removed on leaving the `with` block, also when
the body raised or the process was sent SIGTERM (inside the block it raises SystemExit, as ^C
raises KeyboardInterrupt, so the nodes' torchruns are killed too), and names carry this process's
id, so a run that was killed outright leaves names that the next run recognises as stale and
removes (`remove_stale`). `probe` measures what a link
really carries, so the rate asked for and the rate got are reported side by side.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from zerocompile.tools.spawn import GRACE_AFTER_A_FAILURE, RanksFailed, die_with_the_parent, leave_rank

PREFIX = "zcnet"  # namespaces are PREFIX{pid}n{node}
NODE_ADDRESSES = ("127.77.0.1", "127.77.0.2")
_RATE = re.compile(r"(\d+(?:\.\d+)?)(k|m|g)bit")
_SCALE = {"k": 1e3, "m": 1e6, "g": 1e9}
UNLIMITED = "unlimited"
# Probe: a sender writes this many bytes of zeros in chunks as fast as the link takes them.
PROBE_CHUNK = 1 << 20


class NetworkError(RuntimeError):
    """The simulated network cannot be built here; the message names the fix."""


def parse_rate(text: str) -> float:
    """'1gbit', '2.5gbit', '100mbit' -> bits per second; 'unlimited' -> inf (nothing shaped: the
    same namespaces and addresses, for the step a link's floor starts from)."""
    if text.strip().lower() == UNLIMITED:
        return math.inf
    match = _RATE.fullmatch(text.strip().lower())
    if match is None:
        raise NetworkError(
            f"a link rate is a number and a unit, e.g. 1gbit, 2.5gbit or 100mbit, or {UNLIMITED}; got {text!r}"
        )
    bits = float(match.group(1)) * _SCALE[match.group(2)]
    if bits <= 0:
        raise NetworkError(f"a link rate must be positive, got {text!r}")
    return bits


def check_can_simulate() -> None:
    """Raise `NetworkError` naming the fix unless `ip`, `tc` and CAP_NET_ADMIN are here."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetworkError(
            f"simulating a network needs {' and '.join(missing)} (iproute2): install it, e.g. apt-get install iproute2"
        )
    if not _has_net_admin():
        raise NetworkError(
            "simulating a network needs CAP_NET_ADMIN to create network namespaces: run as root (e.g. sudo), "
            "or drop --link to bench over plain loopback"
        )


def _has_net_admin() -> bool:
    try:
        status = open("/proc/self/status").read()
    except OSError:
        return os.geteuid() == 0
    effective = re.search(r"^CapEff:\s*([0-9a-f]+)$", status, re.MULTILINE)
    return effective is not None and bool(int(effective.group(1), 16) >> 12 & 1)  # CAP_NET_ADMIN is bit 12


def _run(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise NetworkError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")


def namespaces() -> list[str]:
    """The network namespaces `ip netns` knows, by name."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Remove the namespaces of runs whose process is gone (killed before it could clean up)."""
    removed = []
    for name in namespaces():
        match = re.fullmatch(rf"{PREFIX}(\d+)n\d+", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _run(["ip", "netns", "delete", name])
            removed.append(name)
    return removed


@dataclasses.dataclass(frozen=True)
class Node:
    """One simulated node: its namespace, the address its ranks' rendezvous and gloo use, and the
    interface gloo binds (GLOO_SOCKET_IFNAME)."""

    namespace: str
    address: str
    interface: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class SimulatedNetwork:
    """`with SimulatedNetwork(nodes, rate) as network:` the namespaces exist; `network.nodes`."""

    def __init__(self, nodes: int, rate: str, latency_ms: int = 200) -> None:
        if nodes not in (1, 2):
            raise NetworkError(f"a simulated network has 1 node (one slow link) or 2 (two nodes), not {nodes}")
        self.rate = rate
        self.bits_per_second = parse_rate(rate)
        self.latency_ms = latency_ms
        self.nodes: list[Node] = []
        self._made: list[str] = []
        self._count = nodes
        self._previous_sigterm: Any = None
        self._sigterm_replaced = False

    def __enter__(self) -> SimulatedNetwork:
        check_can_simulate()
        remove_stale()
        self._exit_on_sigterm()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def _exit_on_sigterm(self) -> None:
        """Python's default for SIGTERM (`kill`, a scheduler stopping the job) ends the process
        without running `finally`, leaving the namespaces and the nodes' torchruns behind; while
        this network exists it raises SystemExit(143) in the main thread instead. `close` puts the
        previous handler back. (Signals reach only the main thread: elsewhere, nothing changes.)"""
        if threading.current_thread() is not threading.main_thread():
            return

        def exit_cleanly(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)

        self._previous_sigterm = signal.signal(signal.SIGTERM, exit_cleanly)
        self._sigterm_replaced = True

    def close(self) -> None:
        """Remove every namespace made (the veth pair goes with them); SIGTERM's handler as it was."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        self._made.clear()
        # Restored even when the previous handler was None (one installed outside Python): ours must not stay.
        if self._sigterm_replaced:
            signal.signal(signal.SIGTERM, self._previous_sigterm if self._previous_sigterm is not None else signal.SIG_DFL)
            self._sigterm_replaced = False

    def _namespace(self, node: int) -> str:
        name = f"{PREFIX}{os.getpid()}n{node}"
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        return name

    def _shape(self, namespace: str, interface: str) -> None:
        if math.isinf(self.bits_per_second):
            return
        # A bucket of at least 1 MB, and of 10 ms at the rate, so the shaper can reach its rate
        # with the kernel's timer granularity; packets wait at most latency_ms, then drop.
        burst = max(1 << 20, int(self.bits_per_second / 8 / 100))
        _run(
            ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", interface, "root", "tbf",
             "rate", f"{int(self.bits_per_second)}bit", "burst", str(burst), "latency", f"{self.latency_ms}ms"]
        )  # fmt: skip

    def _build(self) -> None:
        if self._count == 1:
            name = self._namespace(0)
            self._shape(name, "lo")
            self.nodes = [Node(name, "127.0.0.1", "lo")]
            return
        names = [self._namespace(node) for node in range(2)]
        veths = [f"zcv{os.getpid() % 100000}{node}" for node in range(2)]  # interface names: 15 characters at most
        _run(["ip", "link", "add", veths[0], "netns", names[0], "type", "veth", "peer", "name", veths[1], "netns", names[1]])
        for node, (name, veth, address) in enumerate(zip(names, veths, NODE_ADDRESSES)):
            peer = NODE_ADDRESSES[1 - node]
            inside = ["ip", "netns", "exec", name]
            for scope in ("all", veth):
                _run([*inside, "sysctl", "-q", "-w", f"net.ipv4.conf.{scope}.route_localnet=1"])
            _run(["ip", "-n", name, "link", "set", veth, "mtu", "65535", "up"])
            _run(["ip", "-n", name, "addr", "add", f"{address}/32", "dev", veth])
            # Longer than loopback's local 127.0.0.0/8, so the peer's address leaves through the
            # veth (a new namespace has no policy rules: the local and main tables are one lookup).
            _run(["ip", "-n", name, "route", "add", f"{peer}/32", "dev", veth, "src", address])
            self._shape(name, veth)
            self.nodes.append(Node(name, address, veth))

    def probe(self, seconds: float = 1.0) -> float:
        """Bits per second one TCP stream carries across the link (node 0 to the last node)."""
        return probe(self.nodes[0], self.nodes[-1], seconds)

    def run_ranks(
        self,
        fn: Callable[..., Any],
        ranks_per_node: int,
        args: Sequence[Any] = (),
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """`fn(rank, *args)` on `ranks_per_node` ranks in each node, started by torchrun inside the
        node's namespace (`--nnodes`, `--node-rank`, the first node's address as the master's);
        gloo binds each node's interface. Every rank's return value, by rank; `RanksFailed` if a
        node's torchrun failed, with what its ranks said."""
        world_size = ranks_per_node * len(self.nodes)
        with tempfile.TemporaryDirectory(prefix="zerocompile-netsim-") as folder:
            job = Path(folder, "job.pickle")
            # The search path first: unpickling `fn` imports its module (a test's, a script's).
            job.write_bytes(pickle.dumps(sys.path) + pickle.dumps((fn, tuple(args))))
            port = _free_port_in(self.nodes[0])
            launched = []
            for index, node in enumerate(self.nodes):
                torchrun = [
                    sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(self.nodes)}",
                    f"--node-rank={index}", f"--nproc-per-node={ranks_per_node}", f"--master-addr={self.nodes[0].address}",
                    f"--master-port={port}", "-m", "zerocompile.tools.netsim", str(job), folder,
                ]  # fmt: skip
                environment = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": node.interface}
                with open(Path(folder, f"node{index}.log"), "w") as log:
                    launched.append(subprocess.Popen(node.command(torchrun), env=environment, stdout=log, stderr=log))
            codes = _wait_for_nodes(launched, timeout)
            results: dict[int, tuple[str, Any]] = {}
            for rank in range(world_size):
                path = Path(folder, f"rank{rank}.pickle")
                if path.exists():
                    results[rank] = pickle.loads(path.read_bytes())
            failures = {rank: text for rank, (kind, text) in results.items() if kind != "returned"}
            failures.update(
                {
                    rank: f"no result (its node's torchrun exited with {codes[rank // ranks_per_node]}):\n"
                    + Path(folder, f"node{rank // ranks_per_node}.log").read_text()[-4000:]
                    for rank in range(world_size)
                    if rank not in results
                }
            )
            if failures:
                raise RanksFailed(failures)  # those that raised first: the cause, then its casualties
            return [results[rank][1] for rank in range(world_size)]


def _wait_for_nodes(launched: list[subprocess.Popen], timeout: float | None) -> list[int]:
    """Each node's torchrun exit code. Once one has failed, the others get GRACE_AFTER_A_FAILURE
    seconds (their ranks may be stuck in a collective with the failed ones) and are then killed;
    after `timeout` seconds all are killed and TimeoutError raised (their workers die with them:
    `_run_job`)."""
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    give_up = float("inf")
    try:
        while any(process.poll() is None for process in launched):
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"ranks still running after {timeout:.0f} s")
            if now >= give_up:
                break
            if any(process.returncode for process in launched if process.returncode is not None):
                give_up = min(give_up, now + GRACE_AFTER_A_FAILURE)
            time.sleep(0.2)
    finally:  # none outlives the call: not on a timeout, a failure, or an interrupt
        for process in launched:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [process.returncode for process in launched]


def _free_port_in(node: Node) -> int:
    """A TCP port free on the node's address now (inside its namespace), for torchrun's store."""
    script = f"import socket; s = socket.socket(); s.bind(({node.address!r}, 0)); print(s.getsockname()[1])"
    return int(subprocess.run(node.command([sys.executable, "-c", script]), capture_output=True, text=True, check=True).stdout)


def _run_job(job: Path, folder: Path) -> None:
    """A torchrun worker of `run_ranks`: `fn(rank, *args)`, its outcome to folder/rank{RANK}.pickle."""
    die_with_the_parent()  # a killed torchrun takes its workers along
    rank = int(os.environ["RANK"])
    try:
        with open(job, "rb") as pickled:
            sys.path[:] = pickle.load(pickled)
            fn, args = pickle.load(pickled)
        outcome = ("returned", fn(rank, *args))
    except BaseException:
        outcome = ("raised", traceback.format_exc())
    Path(folder, f"rank{rank}.pickle").write_bytes(pickle.dumps(outcome))
    leave_rank(failed=outcome[0] != "returned")


def probe(sender: Node, receiver: Node, seconds: float = 1.0) -> float:
    """Bits per second one TCP stream carries from `sender` to `receiver`'s address, measured where
    it arrives over the last three quarters of about `seconds` (the first quarter lets a token
    bucket's initial burst through)."""
    listening = subprocess.Popen(
        receiver.command([sys.executable, "-c", _RECEIVER, receiver.address, str(seconds / 4)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(listening.stdout.readline())
        sent = subprocess.run(
            sender.command([sys.executable, "-c", _SENDER, receiver.address, str(port), str(seconds)]),
            capture_output=True,
            text=True,
            timeout=seconds * 10 + 30,
        )
        if sent.returncode != 0:
            raise NetworkError(f"the link probe's sender failed: {sent.stderr.strip()}")
        return float(listening.communicate(timeout=seconds * 10 + 30)[0])
    finally:
        listening.kill()
        listening.wait()


# The probe's two ends, run with `python -c` inside the namespaces: the receiver prints its port,
# then, once the sender has closed, the rate at which bytes arrived after the first `skip` seconds.
_RECEIVER = """
import socket, sys, time
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
first = time.perf_counter()
skip = float(sys.argv[2])
counted, start, end = 0, None, None
while True:
    got = len(connection.recv(1 << 20))
    now = time.perf_counter()
    if not got:
        break
    if start is None and now - first >= skip:
        start = now
    elif start is not None:
        counted, end = counted + got, now
print(counted * 8 / (end - start))
"""

_SENDER = f"""
import socket, sys, time
chunk = bytes({PROBE_CHUNK})
link = socket.create_connection((sys.argv[1], int(sys.argv[2])))
end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    link.sendall(chunk)
link.close()
"""


if __name__ == "__main__":
    _run_job(Path(sys.argv[1]), Path(sys.argv[2]))
