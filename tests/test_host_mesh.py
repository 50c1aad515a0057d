"""Protects the check made before a gloo group of every rank is created (axon4d.comm.host_mesh, used by
``axon4d.comm.communicator.host_group``, the group checkpoints coordinate on): the open-file limit against
the socket per rank that rank 0 holds, lifted where the hard limit allows and refused with what to set
where not, and the interface gloo binds. (What the group costs the store: tests/test_host_group_scaling.py.) In one process, with the host's limits, interfaces and
addresses injected."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from axon4d.comm import communicator as comm
from axon4d.comm import host_mesh


def _check(world: int, soft: int, hard: int, environ=None, addresses=("10.0.0.5",), lifted=None):
    return host_mesh.check(
        world,
        environ={} if environ is None else environ,
        limits=lambda: host_mesh.Limits(soft, hard),
        set_soft=(lifted.append if lifted is not None else lambda n: pytest.fail(f"lifted to {n}")),
        opened=lambda: 36,
        interfaces=lambda: ["lo", "eth0", "ib0"],
        addresses=lambda: list(addresses),
    )


def test_a_group_within_the_limit_is_described():
    line = _check(512, soft=4096, hard=4096, environ={"GLOO_SOCKET_IFNAME": "ib0"})
    expected = "511 sockets per rank (open-file limit 4096), over interface ib0 (GLOO_SOCKET_IFNAME)"
    assert line == f"a gloo group of 512 ranks: {expected}"


def test_a_soft_limit_too_low_is_lifted_up_to_the_hard_one():
    lifted: list[int] = []
    line = _check(4096, soft=1024, hard=1 << 20, lifted=lifted)
    need = 36 + 4095 + host_mesh.SPARE_FILES
    assert lifted == [need]
    assert f"(open-file limit {need}, lifted from 1024)" in line


def test_a_hard_limit_too_low_is_refused_with_what_to_set():
    with pytest.raises(RuntimeError) as e:
        _check(4096, soft=1024, hard=2048)
    need = 36 + 4095 + host_mesh.SPARE_FILES
    assert "opens 4095 sockets on each rank" in str(e.value)
    assert "may open 1024 (hard limit 2048)" in str(e.value) and f"ulimit -n {need}" in str(e.value)


def test_an_interface_the_host_lacks_is_refused_naming_those_it_has():
    with pytest.raises(RuntimeError, match=r"GLOO_SOCKET_IFNAME='ib1' names ib1, .* \(its interfaces: lo, eth0, ib0\)"):
        _check(8, soft=1024, hard=1024, environ={"GLOO_SOCKET_IFNAME": "ib1"})


def test_loopback_is_refused_only_in_a_job_over_several_nodes():
    loopback = ("127.0.1.1",)
    assert "(127.0.1.1)" in _check(8, 1024, 1024, environ={"LOCAL_WORLD_SIZE": "8"}, addresses=loopback)
    assert "(127.0.1.1)" in _check(8, 1024, 1024, environ={}, addresses=loopback)  # the launcher does not say
    with pytest.raises(RuntimeError, match="resolves only to loopback .* set GLOO_SOCKET_IFNAME"):
        _check(16, 1024, 1024, environ={"LOCAL_WORLD_SIZE": "8"}, addresses=loopback)
    with pytest.raises(RuntimeError, match="resolves only to loopback"):
        _check(16, 1024, 1024, environ={"SLURM_NNODES": "2"}, addresses=loopback)


def test_host_group_checks_before_it_creates_the_group(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 100_000)
    monkeypatch.setattr(host_mesh, "_limits", lambda: host_mesh.Limits(1024, 1024))
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: pytest.fail("the group was created"))
    with pytest.raises(RuntimeError, match="opens 99999 sockets on each rank"):
        comm.host_group(30.0)
