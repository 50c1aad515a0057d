"""Protects the exchange under every agreement (axon4d/reliability/agreement.py): each rank's payload comes back
to every rank in rank order, from one all-gather whose table reaches the host in one copy (not one
per rank's row), and a failure on one rank is raised alike on all of them."""

import pytest

from axon4d.reliability.agreement import SLOT


def _exchange(grid):
    """Every rank's payload as this rank reads it, and the shapes of what went to the host."""
    from axon4d.reliability import agreement

    calls = []
    real = agreement.devices.to_host

    def counted(t):
        calls.append(tuple(t.shape))
        return real(t)

    agreement.devices.to_host = counted
    try:
        rows = agreement.exchange(grid, {"rank": grid.rank, "text": "é" * grid.rank})
    finally:
        agreement.devices.to_host = real
    return rows, calls


def test_every_rank_reads_every_payload_in_rank_order_from_one_host_copy(pools):
    for rows, calls in pools(4).run((1, 2, 1, 2), _exchange):
        assert rows == [{"rank": r, "text": "é" * r} for r in range(4)]
        assert calls == [(4, SLOT)]  # the whole table at once


def _agree(grid):
    """The error ``agree`` raises on this rank when ranks 1 and 2 failed."""
    from axon4d.reliability.agreement import agree

    err = ValueError(f"bad value on rank {grid.rank}") if grid.rank in (1, 2) else None
    try:
        agree(grid, err, "checking")
    except ValueError as e:
        return str(e)
    return None


def test_the_lowest_failing_ranks_error_is_raised_on_every_rank(pools):
    for message in pools(4).run((1, 2, 1, 2), _agree):
        assert message == "bad value on rank 1 (rank 1 of 4, checking)"


def test_a_payload_wider_than_its_slot_is_refused():
    from axon4d.reliability.agreement import exchange

    with pytest.raises(AssertionError, match="exceeds its 16-byte slot"):
        exchange(None, {"text": "x" * 16}, 16)  # refused before any communication
