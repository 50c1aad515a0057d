"""Protects what the host group checkpoints coordinate on costs the one TCPStore as the world grows
(``axon4d.comm.communicator.host_group``; ``axon4d.comm.host_mesh.lazy_connections``): making it
costs each rank one store request whatever the world, and a DCP save and load over it read one
address per peer a rank talks to — every rank for rank 0, a few for the others — O(world) per
rank, where gloo's full mesh reads every rank's record of ≈ 8·world bytes on every rank, O(world²).

Real ranks (forked processes, ``bench/host_group_scaling.py``'s ``run_world``) meet at one TCPStore
through a counting store; start here if the group is ever made another way.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest

from axon4d.comm import host_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import host_group_scaling as scaling  # noqa: E402  (bench/ is not a package)

#: the most one rank's address record under lazy connections can take in the store, key included:
#: two lengths (16 B), a sockaddr_storage (128 B), the host name, and ≤ 32 B of key; a full mesh's
#: record adds 8 B per rank of the world (one pair identifier each)
RECORD_BYTES = 16 + 128 + len(socket.gethostname()) + 32


def _run_world(world: int) -> list[dict]:
    """``run_world`` in a fresh interpreter: its ranks are forked, and a fork of this test process would
    inherit the default process group an in-process test's ``axon4d.init`` leaves (``runtime.shutdown``
    keeps it, as torchrun needs)."""
    code = (
        f"import json, host_group_scaling as s; print(json.dumps(s.run_world({world}, 'host_group', timeout_s=60.0)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=os.path.join(ROOT, "bench"), capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_the_host_group_is_no_full_mesh(world):
    rows = _run_world(world)
    # Made: one request per rank (its own address), whatever the world. A full mesh makes 2·W + 1
    # (its record, then a wait and a get of each rank's record): 9 at W = 4, 17 at W = 8.
    for row in rows:
        assert row["create"]["requests"] == 1, row
        assert row["create"]["bytes"] <= RECORD_BYTES, row
    # Used (DCP save, then load): a rank reads the address of each peer it talks to, once. Rank 0,
    # which DCP gathers to and scatters and broadcasts from, reads W − 1; every other rank, those
    # of its ring neighbours, rank 0 and its broadcast tree's: at most 3 + 2·log2(W).
    few = 3 + 2 * math.ceil(math.log2(world))
    for row in rows:
        read = row["save"]["keys_read"] + row["load"]["keys_read"]
        assert read <= (world - 1 if row["rank"] == 0 else min(world - 1, few)), row
    # Bytes, O(W) per rank: with r the record (≈ 170 B here), rank 0 moves r + (W − 1)·(r + 14)
    # (its record; a wait and a get per peer) < W·(RECORD_BYTES + 32). Every rank of a full mesh
    # moves (W + 1)·(r + 8·W) + 14·W, which exceeds that bound by r + 8·W² − 20·W > 0 (W ≥ 3):
    # 1056 B against 840 B at W = 4, 2200 B against 1680 B at W = 8 on a host named "vm".
    for row in rows:
        moved = sum(row[phase]["bytes"] for phase in scaling.PHASES)
        assert moved <= world * (RECORD_BYTES + 32), row


def test_lazy_connections_are_set_only_within_the_block():
    environ = {"OTHER": "x"}
    with host_mesh.lazy_connections(environ):
        assert environ[host_mesh.LAZY_ENV] == "1"
    assert environ == {"OTHER": "x"}
    environ = {host_mesh.LAZY_ENV: "0"}
    with pytest.raises(ValueError), host_mesh.lazy_connections(environ):
        assert environ[host_mesh.LAZY_ENV] == "1"
        raise ValueError("inside")
    assert environ == {host_mesh.LAZY_ENV: "0"}


def test_this_torch_connects_gloo_lazily():
    # torch 2.8 and later (TORCH_GLOO_LAZY_INIT); an older torch would make the full mesh above
    assert host_mesh.lazy_supported()
