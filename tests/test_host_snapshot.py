"""Protects the asynchronous checkpoint's snapshot (axon4d/memory/host_snapshot.py): each tensor comes back
as a host view holding its values, with its dtype, offset, sizes and strides, in one allocation
that holds each storage once at an aligned offset — ``carve``'s total, which the planner prices —
and that the next snapshot of the same storages reuses."""

import torch

from axon4d.device import HOST
from axon4d.device.pinned import ALIGN, carve
from axon4d.memory.host_snapshot import HostSnapshot


def _state():
    """Tensors as a checkpoint's pieces are: views of storages of several dtypes and sizes."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 10, generator=g)  # 240 bytes: the next storage starts at ALIGN, not 240
    m = torch.randn(33, generator=g, dtype=torch.float64)
    b = torch.randn(4, 5, generator=g).to(torch.bfloat16)
    step = torch.tensor(7.0)
    ids = torch.arange(12, dtype=torch.int64)
    return [w[1:4, 2:7], w.t(), w, m[5:], b.t()[1], step, ids.view(3, 4)[:, 1]]


def test_the_snapshot_holds_every_tensors_values_and_layout_in_one_aligned_allocation():
    tensors = _state()
    snap = HostSnapshot()
    copies = snap.take(tensors)
    for t, c in zip(tensors, copies):
        assert c.device == HOST and c.dtype == t.dtype and c.shape == t.shape and c.stride() == t.stride()
        assert torch.equal(c, t)
        assert c.untyped_storage().data_ptr() == snap.memory.untyped_storage().data_ptr()  # one allocation
        assert (c.storage_offset() - t.storage_offset()) * t.element_size() % ALIGN == 0
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    assert snap.footprint() == carve(list(storages.values()))[1]  # each storage once, aligned
    # views of one storage share its copy: writing through one is seen through the other
    copies[2][1, 2] = 123.0
    assert copies[0][0, 0] == 123.0 and copies[1][2, 1] == 123.0


def test_the_next_snapshot_reuses_the_allocation_and_a_new_layout_makes_a_new_one():
    tensors = _state()
    snap = HostSnapshot()
    first = snap.take(tensors)[2].untyped_storage().data_ptr()
    tensors[2].mul_(2)
    again = snap.take(tensors)
    assert again[2].untyped_storage().data_ptr() == first and torch.equal(again[2], tensors[2])
    grown = tensors + [torch.ones(1000)]
    copies = snap.take(grown)
    assert torch.equal(copies[-1], grown[-1])
    assert snap.footprint() == carve([4 * 60, 8 * 33, 2 * 20, 4, 8 * 12, 4000])[1]
    snap.clear()
    assert snap.footprint() == 0
