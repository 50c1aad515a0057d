"""Protects the offload pool (axon4d/memory/host_pool.py): buffers at aligned offsets that never overlap
while held, ranges that merge again when given back in any order, and — once every buffer has come
back — one allocation of their total, which a repeated step fits exactly as ``carve`` lays it out."""

import torch

from axon4d.device import HOST
from axon4d.device.pinned import ALIGN, carve
from axon4d.memory.host_pool import HostPool

#: the sizes of one step's buffers, as offload asks for them (some not multiples of ALIGN)
STEP = [3 * ALIGN, 100, ALIGN, 5000, 1]


def _fill(pool, sizes):
    """Take a buffer per size and write a distinct byte into each: (ids, views)."""
    ids, views = [], []
    for k, n in enumerate(sizes):
        i, v = pool.take(n)
        assert v.dtype == torch.uint8 and v.shape == (n,) and v.device == HOST
        v.fill_(k + 1)
        ids.append(i)
        views.append(v)
    return ids, views


def test_held_buffers_are_aligned_and_disjoint():
    pool = HostPool(HOST)
    ids, views = _fill(pool, STEP)
    base = [v.untyped_storage().data_ptr() for v in views]
    assert all(v.storage_offset() % ALIGN == 0 for v in views)
    for k, v in enumerate(views):  # no buffer was written over by another
        assert torch.all(v == k + 1), k
    assert pool.reserved() == carve(STEP)[1]
    assert len(set(base)) == len(STEP)  # the first step: an allocation per buffer, each its aligned size
    assert pool.footprint() == carve(STEP)[1]


def test_after_a_step_the_pool_is_one_allocation_that_the_next_step_fits():
    pool = HostPool(HOST)
    ids, views = _fill(pool, STEP)
    del views
    for i in (ids[1], ids[3], ids[0], ids[4], ids[2]):  # given back out of order
        pool.give(i)
    assert pool.reserved() == 0
    offsets, total = carve(STEP)
    for _ in range(2):  # the second step merges the allocations; the third reuses the one
        ids, views = _fill(pool, STEP)
        assert len({v.untyped_storage().data_ptr() for v in views}) == 1
        assert [v.storage_offset() for v in views] == offsets
        assert pool.footprint() == total
        for k, v in enumerate(views):
            assert torch.all(v == k + 1), k
        del views
        for i in reversed(ids):
            pool.give(i)


def test_a_range_given_back_is_taken_again_first_fit_and_neighbours_merge():
    pool = HostPool(HOST)
    ids, _ = _fill(pool, [ALIGN] * 4)
    for i in reversed(ids):
        pool.give(i)
    ids, views = _fill(pool, [ALIGN] * 4)  # now one allocation of 4·ALIGN
    pool.give(ids[1])
    pool.give(ids[2])  # two neighbours: one free range of 2·ALIGN
    i, v = pool.take(2 * ALIGN - 7)
    assert v.storage_offset() == ALIGN and pool.footprint() == 4 * ALIGN  # no new allocation
    assert torch.all(views[0] == 1) and torch.all(views[3] == 4)
    j, w = pool.take(1)  # nothing free is left: a new allocation of ALIGN bytes
    assert pool.footprint() == 5 * ALIGN and w.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
