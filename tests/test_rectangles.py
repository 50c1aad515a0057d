"""axon4d.layout.rectangles.FusedRows: the one description of fused rows (q | k | v, gate | up, GPT-2's c_attn),
in one process: the permutation each layer used to write itself, fusing and splitting back, a rank's
chunk per segment and where its rows lie in each segment's tensor."""

import pytest
import torch
from torch import nn

from axon4d.layout.rectangles import FusedRows


def _grouped(sizes, groups):
    """The permutation written out: for each group j, chunk j of every segment in turn."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [s + j * (n // groups) + r for j in range(groups) for s, n in zip(starts, sizes) for r in range(n // groups)]


@pytest.mark.parametrize(
    "segments, groups",
    [
        ((("q", 32), ("k", 16), ("v", 16)), 2),  # attention with GQA on G_y = 2
        ((("gate", 12), ("up", 12)), 3),  # SwiGLU on G_y = 3
        ((("q", 12), ("k", 12), ("v", 12)), 1),  # GPT-2's c_attn on G_y = 1
    ],
)
def test_fused_rows_permute_split_and_place_every_row(segments, groups):
    rows = FusedRows(segments, groups)
    sizes = [n for _, n in segments]
    assert rows.order().tolist() == _grouped(sizes, groups)
    parts = [torch.randn(n, 5) for n in sizes]
    fused = rows.fuse(torch.cat(parts))
    assert all(torch.equal(a, b) for a, b in zip(rows.split(fused), parts))
    assert torch.equal(rows.unfuse(fused), torch.cat(parts))
    chunk = fused.shape[0] // groups
    for j in range(groups):
        mine = fused[j * chunk : (j + 1) * chunk]
        local = rows.local(mine)
        sources = rows.sources(j, 5, lambda seg: seg)
        for view, part, src in zip(local, parts, sources):
            assert view.data_ptr() == mine[src.start :].data_ptr()  # a view
            assert torch.equal(view, part[src.row0 : src.row0 + src.count])
            assert src.shape == (part.shape[0], 5)


def test_fused_dense_layers_round_trip_with_grads():
    rows = FusedRows((("gate", 6), ("up", 6)), 2)
    dense = [nn.Linear(4, 6), nn.Linear(4, 6)]
    weight, bias = rows.fuse_dense(dense)
    fused = nn.Linear(4, 12)
    with torch.no_grad():
        fused.weight.copy_(weight)
        fused.bias.copy_(bias)
    fused(torch.randn(3, 4)).square().sum().backward()
    back = [nn.Linear(4, 6), nn.Linear(4, 6)]
    rows.split_into_(fused, back, grads=True)
    for a, b in zip(dense, back):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert torch.equal(torch.cat([b.weight.grad for b in back]), rows.unfuse(fused.weight.grad))
    assert rows.fuse_dense([nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False)])[1] is None


def test_fused_rows_refuse_segments_the_groups_do_not_divide():
    with pytest.raises(ValueError, match=r"k \(6 rows\)"):
        FusedRows((("q", 8), ("k", 6)), 4)
