"""An emulated cluster on one machine: one network namespace per rank, links capped with tc tbf.

On loopback, communication costs CPU rather than wall time, so overlap cannot show (docs/design.md
§7). Here every rank runs in its own network namespace ``ax4-r<i>`` whose ``eth0`` (a veth) is
plugged into a bridge living in a switch namespace ``ax4-sw``; both directions of every rank's
link are capped with ``tc qdisc ... tbf rate LINK``. With ``--nodes N`` the ranks are grouped into
N "nodes": each node has its own bridge with fast rank links (``--intra``), and node bridges are
joined through a core bridge by uplinks capped at the (slower) ``--link`` rate, so traffic
between nodes shares one slow uplink per node, as on a real cluster. Addresses are
10.213.0.<rank+1>/24, present only inside these namespaces; nothing is routed to the host.

Needs root and iproute2 (``apt-get install -y iproute2``). Namespaces are removed when the
``Cluster`` context exits — also when a rank fails, on Ctrl-C and on SIGTERM.

    python bench/cluster.py run --ranks 8 --link 1gbit -- python my_script.py   # up, run, down
    python bench/cluster.py up --ranks 8 --link 1gbit --nodes 2 --intra 10gbit  # leave it up
    python bench/cluster.py down                                                # remove it

``run`` starts each rank with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and ``GLOO_SOCKET_IFNAME=eth0``, so ``axon4d.init()`` joins without changes.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

PREFIX = "ax4"
SUBNET = "10.213.0"
SWITCH = f"{PREFIX}-sw"
LOCK = "/tmp/axon4d_cluster.lock"
#: MTU of every emulated link. The kernel's work per packet (bridge, veth, tc, TCP) runs on the
#: cores the ranks compute on; large frames cut it ~an order of magnitude, so the emulation
#: itself takes little CPU from the ranks. The cap being emulated is the link *rate*.
MTU = 65000
SWITCH_QUEUE = "500ms"  # tbf queue of switch ports (see _tbf)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _sw(*args: str) -> None:
    _ip("-n", SWITCH, *args)


def _tbf(ns: str, dev: str, rate: str | None, queue: str = "50ms") -> None:
    """Cap egress of ``dev`` in namespace ``ns`` at ``rate`` (None: leave the veth uncapped).

    ``queue`` is how long a packet may wait before tbf drops it. A rank's own link pushes back on
    its sockets, so 50 ms is plenty; switch ports that several senders feed at once (incast: a
    rank receiving on x, y and z together) get a deep buffer like a switch's, or drops and TCP's
    200 ms retransmission timeouts would dominate every step."""
    if rate:
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                queue,
            ],
            check=True,
            capture_output=True,
        )


def rank_ns(rank: int) -> str:
    return f"{PREFIX}-r{rank}"


def address(rank: int) -> str:
    return f"{SUBNET}.{rank + 1}"


def existing() -> list[str]:
    """Names of this tool's namespaces that exist now."""
    out = _ip("netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in out if line.startswith(f"{PREFIX}-")]


def teardown() -> None:
    """Remove every namespace this tool made (their veths and bridges go with them)."""
    for ns in existing():
        _ip("netns", "del", ns, check=False)


class Cluster:
    """``with Cluster(8, "1gbit") as c: c.run([...])`` — namespaces exist only inside the block."""

    def __init__(self, ranks: int, link: str | None, nodes: int = 1, intra: str | None = None, mtu: int = MTU):
        if ranks < 1 or ranks > 250:
            raise ValueError(f"ranks = {ranks}: the emulated cluster holds 1 to 250 ranks")
        if nodes < 1 or ranks % nodes:
            raise ValueError(f"nodes = {nodes} must divide ranks = {ranks} (ranks are grouped into equal nodes)")
        if os.geteuid() != 0:
            raise RuntimeError("the emulated cluster needs root (ip netns, tc); run as root")
        if not 1280 <= mtu <= 65535:
            raise ValueError(f"mtu = {mtu}: veth MTUs range from 1280 to 65535 bytes")
        self.ranks, self.link, self.nodes, self.intra, self.mtu = ranks, link, nodes, intra, mtu
        self.procs: list[subprocess.Popen] = []
        self._lock = None

    def describe(self) -> dict:
        if self.nodes == 1:
            return {"ranks": self.ranks, "nodes": 1, "link": self.link or "uncapped", "mtu": self.mtu}
        return {
            "ranks": self.ranks,
            "nodes": self.nodes,
            "inter_node_link": self.link or "uncapped",
            "intra_node_link": self.intra or "uncapped",
            "mtu": self.mtu,
        }

    def up(self) -> None:
        self._lock = open(LOCK, "w")
        try:  # one emulated cluster at a time: the namespace names are fixed
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise RuntimeError(
                f"another emulated cluster is running (lock {LOCK} is held); wait for it to finish"
            ) from None
        teardown()  # leftovers of a run that was killed hard
        _ip("netns", "add", SWITCH)
        _sw("link", "set", "lo", "up")
        # bridged frames skip netfilter (a real switch does not run the host's firewall on them)
        for table in ("iptables", "ip6tables", "arptables"):
            subprocess.run(
                ["ip", "netns", "exec", SWITCH, "sysctl", "-qw", f"net.bridge.bridge-nf-call-{table}=0"],
                capture_output=True,
            )
        per_node = self.ranks // self.nodes
        rank_rate = self.link if self.nodes == 1 else self.intra
        for n in range(self.nodes):
            _sw("link", "add", f"br{n}", "mtu", str(self.mtu), "type", "bridge")
            _sw("link", "set", f"br{n}", "up")
        if self.nodes > 1:
            _sw("link", "add", "core", "mtu", str(self.mtu), "type", "bridge")
            _sw("link", "set", "core", "up")
            for n in range(self.nodes):  # node uplink: u<n>a in the node bridge, u<n>b in the core
                _sw(
                    "link",
                    "add",
                    f"u{n}a",
                    "mtu",
                    str(self.mtu),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    f"u{n}b",
                    "mtu",
                    str(self.mtu),
                )
                _sw("link", "set", f"u{n}a", "master", f"br{n}", "up")
                _sw("link", "set", f"u{n}b", "master", "core", "up")
                _tbf(SWITCH, f"u{n}a", self.link, SWITCH_QUEUE)
                _tbf(SWITCH, f"u{n}b", self.link, SWITCH_QUEUE)
        for r in range(self.ranks):
            ns = rank_ns(r)
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip(
                "-n",
                ns,
                "link",
                "add",
                "eth0",
                "mtu",
                str(self.mtu),
                "type",
                "veth",
                "peer",
                "name",
                f"p{r}",
                "mtu",
                str(self.mtu),
                "netns",
                SWITCH,
            )
            _ip("-n", ns, "addr", "add", f"{address(r)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _sw("link", "set", f"p{r}", "master", f"br{r // per_node}", "up")
            _tbf(ns, "eth0", rank_rate)
            _tbf(SWITCH, f"p{r}", rank_rate, SWITCH_QUEUE)

    def launch(self, cmd: Sequence[str], env: dict[str, str] | None = None, port: int = 29611) -> None:
        """Start ``cmd`` once per rank inside its namespace with torchrun's environment."""
        per_node = self.ranks // self.nodes
        for r in range(self.ranks):
            rank_env = dict(os.environ, **(env or {}))
            rank_env.update(
                RANK=str(r),
                WORLD_SIZE=str(self.ranks),
                LOCAL_RANK=str(r % per_node),
                LOCAL_WORLD_SIZE=str(per_node),
                MASTER_ADDR=address(0),
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="eth0",
            )
            rank_env.setdefault("OMP_NUM_THREADS", "1")
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", rank_ns(r), *cmd], env=rank_env))

    def wait(self, timeout: float = 3600.0) -> int:
        """Wait for every rank; if one fails or time runs out, stop the others. Returns the worst code."""
        deadline = time.monotonic() + timeout
        codes: dict[int, int] = {}
        while len(codes) < len(self.procs):
            for i, p in enumerate(self.procs):
                if i not in codes and p.poll() is not None:
                    codes[i] = p.returncode
            if any(c != 0 for c in codes.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.stop()
        return max([abs(p.returncode) if p.returncode is not None else 1 for p in self.procs] or [0])

    def run(self, cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 3600.0) -> int:
        self.launch(cmd, env)
        return self.wait(timeout)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> Cluster:
        self._old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
        for s in self._old:  # make SIGTERM/SIGHUP unwind through __exit__ like Ctrl-C does
            signal.signal(s, _raise_exit)
        try:
            self.up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self._lock is not None:  # only the holder of the lock may remove the namespaces
                teardown()
                self._lock.close()
                self._lock = None
            for s, h in self._old.items():
                signal.signal(s, h)


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument(
        "--link", default="1gbit", help="rank link rate (one level) or inter-node uplink rate; 'none' = uncapped"
    )
    p.add_argument("--nodes", type=int, default=1, help="group ranks into this many nodes (two levels)")
    p.add_argument("--intra", default="none", help="rank link rate inside a node when --nodes > 1")
    p.add_argument("--mtu", type=int, default=MTU, help="MTU of every emulated link (bytes)")


def _rate(s: str) -> str | None:
    return None if s in ("none", "", "0") else s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["up", "down", "run", "status"])
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    cmd: list[str] = []
    if "--" in argv:
        cmd, argv = argv[argv.index("--") + 1 :], argv[: argv.index("--")]
    args = parser.parse_args(argv)
    if args.action == "down":
        teardown()
        return 0
    if args.action == "status":
        print("\n".join(existing()) or "no emulated cluster")
        return 0
    cluster = Cluster(args.ranks, _rate(args.link), args.nodes, _rate(args.intra), args.mtu)
    if args.action == "up":
        cluster.up()
        print(f"up: {cluster.describe()}; remove with: python bench/cluster.py down")
        return 0
    if not cmd:
        parser.error("run needs a command after --")
    with cluster:
        return cluster.run(cmd)


if __name__ == "__main__":
    raise SystemExit(main())
