"""Protects the grouped GEMMs of the expert layers (axon4d/device/grouped.py, docs/moe.md E18): on
both of their paths — ``torch._grouped_mm`` and the padded batched GEMM — ``grouped_mm``,
``grouped_mm_t`` and ``grouped_weight_grad`` equal one product per group (the loop reference kept
here, not in the library) in fp32 within 1e-6 relative, for uneven groups, empty groups, a single
group, all rows in one group and no rows at all, and in bf16 within its rounding; and no Python
loop over the groups runs (one batched GEMM per call, no per-group matmul). The FP8 grouped GEMMs
(``scaled_grouped_mm``, ``scaled_grouped_weight_grad``, one scale per group) equal their
dequantised reference bit for bit on the host, e4m3 and e5m2, empty groups included, and the call
they make to ``torch._scaled_grouped_mm`` on a GPU (emulated here) gives the same products. Start
here when changing how the grouped GEMMs run."""

import pytest
import torch

from axon4d.device import grouped
from axon4d.options import fp8_grouped
from axon4d.options.fp8_gemm import Quantised

SIZES = {
    "uneven": [5, 1, 9, 3],
    "empty-groups": [0, 4, 0, 7, 0],
    "one-group": [11],
    "all-in-one": [0, 0, 12, 0],
    "no-rows": [0, 0, 0],
}


@pytest.fixture(params=["native", "padded"])
def path(request, monkeypatch):
    """Runs a test on each path: ``native`` where torch's kernel takes the operands (it does on the
    host for fp32 and bf16 with aligned strides), ``padded`` with the kernel switched off."""
    if request.param == "padded":
        monkeypatch.setattr(grouped, "_native", lambda *args: False)
    return request.param


def loop_mm(a, b, sizes):
    """(M, K) × (G, K, N) → (M, N), one matmul per group."""
    out, start = [], 0
    for g, n in enumerate(sizes):
        out.append(a[start : start + n] @ b[g])
        start += n
    return torch.cat(out) if out else a.new_zeros((0, b.shape[2]))


def loop_weight_grad(dy, a, sizes):
    """(M, N), (M, K) → (G, N, K), one matmul per group."""
    out, start = [], 0
    for n in sizes:
        out.append(dy[start : start + n].t() @ a[start : start + n])
        start += n
    return torch.stack(out)


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0


def operands(sizes, k=16, n=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = sum(sizes)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(len(sizes), k, n, generator=g).to(dtype)  # (G, K, N)
    dy = torch.randn(m, n, generator=g).to(dtype)
    return a, b, dy


@pytest.mark.parametrize("case", list(SIZES))
def test_grouped_products_equal_one_product_per_group_in_fp32(path, case):
    sizes = SIZES[case]
    a, b, dy = operands(sizes)
    out = grouped.grouped_mm(a, b, sizes)
    assert out.shape == (sum(sizes), b.shape[2])
    assert rel(out, loop_mm(a, b, sizes)) <= 1e-6
    bt = b.transpose(1, 2).contiguous()  # (G, N, K), nn.Linear's orientation
    assert rel(grouped.grouped_mm_t(a, bt, sizes), loop_mm(a, b, sizes)) <= 1e-6
    dw = grouped.grouped_weight_grad(dy, a, sizes)
    assert dw.shape == (len(sizes), b.shape[2], a.shape[1])
    assert rel(dw, loop_weight_grad(dy, a, sizes)) <= 1e-6
    for g, n in enumerate(sizes):
        if n == 0:
            assert torch.equal(dw[g], torch.zeros_like(dw[g])), f"group {g} has no rows: its gradient is zero"


def test_misaligned_strides_take_the_padded_path_and_stay_exact():
    """K = 3 fp32 (12-byte rows): torch's kernel would refuse them, the padded GEMM runs."""
    sizes = [2, 0, 5]
    a, b, dy = operands(sizes, k=3, n=5)
    assert not grouped.native_grouped_mm(a, b)
    assert rel(grouped.grouped_mm(a, b, sizes), loop_mm(a, b, sizes)) <= 1e-6
    assert rel(grouped.grouped_weight_grad(dy, a, sizes), loop_weight_grad(dy, a, sizes)) <= 1e-6


@pytest.mark.parametrize("case", ["uneven", "empty-groups"])
def test_bf16_on_the_host_within_its_rounding(path, case):
    sizes = SIZES[case]
    a, b, dy = operands(sizes, dtype=torch.bfloat16)
    out = grouped.grouped_mm(a, b, sizes)
    assert out.dtype == torch.bfloat16
    exact = loop_mm(a.double(), b.double(), sizes)  # the same bf16 inputs, summed in fp64
    assert rel(out, exact) <= 2**-7
    dw = grouped.grouped_weight_grad(dy, a, sizes)
    assert dw.dtype == torch.bfloat16
    assert rel(dw, loop_weight_grad(dy.double(), a.double(), sizes)) <= 2**-7


def test_no_python_loop_runs_over_the_groups(path, monkeypatch):
    """Each call is one batched GEMM (``torch._grouped_mm`` or ``torch.bmm``), whatever the number of
    groups; no per-group matmul runs, and nothing reads a device value back on the host."""
    calls = []

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    def forbidden(*args, **kwargs):
        raise AssertionError("a per-group product ran")

    monkeypatch.setattr(torch, "bmm", counted("bmm", torch.bmm))
    monkeypatch.setattr(torch, "_grouped_mm", counted("_grouped_mm", torch._grouped_mm))
    for name in ("matmul", "mm"):
        monkeypatch.setattr(torch, name, forbidden)
    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    monkeypatch.setattr(torch.Tensor, "__matmul__", forbidden)
    sizes = [3, 0, 2, 6, 1, 0, 4, 2]
    a, b, dy = operands(sizes)
    kernel = "_grouped_mm" if path == "native" else "bmm"
    for fn, args in [
        (grouped.grouped_mm, (a, b, sizes)),
        (grouped.grouped_mm_t, (a, b.transpose(1, 2), sizes)),
        (grouped.grouped_weight_grad, (dy, a, sizes)),
    ]:
        calls.clear()
        fn(*args)
        assert calls == [kernel], f"{fn.__name__}: {calls}"


def test_sizes_that_do_not_match_the_operands_are_refused():
    a, b, dy = operands([2, 3])
    with pytest.raises(ValueError, match="2 group sizes adding to 4 for 2 groups and 5 rows"):
        grouped.grouped_mm(a, b, [2, 2])
    with pytest.raises(ValueError, match="3 group sizes"):
        grouped.grouped_mm(a, b, [2, 3, 0])
    with pytest.raises(ValueError, match="size ≥ 0"):
        grouped.grouped_weight_grad(dy, a, [6, -1])


def test_a_refused_kernel_falls_back_to_the_padded_gemm_and_is_not_asked_again(monkeypatch):
    monkeypatch.setattr(grouped, "_REFUSED", set())
    asked = []

    def refuse(*args, **kwargs):
        asked.append(1)
        raise RuntimeError("not on this device")

    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    sizes = SIZES["empty-groups"]
    a, b, dy = operands(sizes)
    for _ in range(2):
        assert rel(grouped.grouped_mm(a, b, sizes), loop_mm(a, b, sizes)) <= 1e-6
        assert rel(grouped.grouped_weight_grad(dy, a, sizes), loop_weight_grad(dy, a, sizes)) <= 1e-6
    assert len(asked) == 2, "each form is tried once, then the padded GEMM runs"
    assert not grouped.native_grouped_mm(a, b)


def test_the_kernels_weight_gradient_of_an_empty_group_is_zero_even_if_it_leaves_it_unwritten(monkeypatch):
    """A kernel need not write the product of a group of no rows (torch's output is uninitialised)."""
    real = torch._grouped_mm

    def unwritten(x, y, offs):
        out = real(x, y, offs=offs)
        if out.dim() == 3:
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            out[sizes == 0] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", unwritten)
    sizes = SIZES["empty-groups"]
    a, _, dy = operands(sizes)
    dw = grouped.grouped_weight_grad(dy, a, sizes)
    assert rel(dw, loop_weight_grad(dy, a, sizes)) <= 1e-6
    assert torch.equal(dw[0], torch.zeros_like(dw[0]))


# -- FP8: one scale per group ------------------------------------------------------------------------------
FP8_SIZES = {"uneven": [5, 1, 19, 3], "empty-groups": [0, 4, 0, 17, 0], "no-rows": [0, 0]}


def fp8_operands(sizes, k=32, n=16, seed=0, grad=torch.float8_e4m3fn):
    """Rows (M, k) and a stack (G, n, k) quantised per group (groups of different magnitudes), and
    output gradients (M, n) in ``grad``."""
    gen = torch.Generator().manual_seed(seed)
    m, g = sum(sizes), len(sizes)
    mags = torch.logspace(-3, 1, g)
    ids = torch.repeat_interleave(torch.arange(g), torch.tensor(sizes, dtype=torch.long))
    x = torch.randn(m, k, generator=gen) * mags[ids].unsqueeze(1)
    w = torch.randn(g, n, k, generator=gen) * mags.view(-1, 1, 1)
    dy = torch.randn(m, n, generator=gen) * mags.flip(0)[ids].unsqueeze(1)
    q = fp8_grouped.quantise_grouped
    return q(x.bfloat16(), sizes), q(w), q(dy.bfloat16(), sizes, dtype=grad)


def fp8_products(xq, wq, dyq, sizes):
    """Forward, dX and dW as ``ExpertFP8GEMM`` makes them."""
    y = grouped.scaled_grouped_mm(xq.data, wq.data, xq.scale, wq.scale, sizes, torch.bfloat16)
    w_t = wq.data.transpose(1, 2).contiguous()
    dx = grouped.scaled_grouped_mm(dyq.data, w_t, dyq.scale, wq.scale, sizes, torch.bfloat16)
    place, padded = grouped.aligned_rows(sizes, torch.device("cpu"))
    dy_t = fp8_grouped.transposed_grouped(dyq, place, sum(padded))
    x_t = fp8_grouped.transposed_grouped(xq, place, sum(padded))
    dw = grouped.scaled_grouped_weight_grad(dy_t.data, x_t.data, dyq.scale, xq.scale, padded, torch.bfloat16)
    return y, dx, dw


def fp8_references(xq, wq, dyq, sizes):
    w_t = Quantised(wq.data.transpose(1, 2), wq.scale)
    return (
        fp8_grouped.grouped_reference(xq, wq, sizes, torch.bfloat16),
        fp8_grouped.grouped_reference(dyq, w_t, sizes, torch.bfloat16),
        fp8_grouped.grouped_weight_reference(dyq, xq, sizes, torch.bfloat16),
    )


@pytest.mark.parametrize("grad", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("case", list(FP8_SIZES))
def test_fp8_grouped_products_equal_their_dequantised_reference_bit_for_bit(case, grad):
    sizes = FP8_SIZES[case]
    xq, wq, dyq = fp8_operands(sizes, grad=grad)
    assert xq.scale.shape == wq.scale.shape == (len(sizes),)
    for name, got, want in zip(
        ("forward", "dX", "dW"), fp8_products(xq, wq, dyq, sizes), fp8_references(xq, wq, dyq, sizes)
    ):
        assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape, name
        assert torch.equal(got, want), f"{name}: {(got.float() - want.float()).abs().max()}"
    dw = fp8_products(xq, wq, dyq, sizes)[2]
    for g in (g for g, m in enumerate(sizes) if m == 0):
        assert not dw[g].any()


def test_each_groups_scale_is_its_own_amax():
    sizes = [3, 0, 5]
    x = torch.randn(8, 16)
    x[3:] *= 1e-4  # the last group's rows are small: its own scale keeps their precision
    q = fp8_grouped.quantise_grouped(x, sizes)
    assert torch.equal(q.scale[0], x[:3].abs().max() / 448) and torch.equal(q.scale[2], x[3:].abs().max() / 448)
    assert q.scale[1] == torch.finfo(torch.float32).tiny  # a group of no rows
    back = fp8_grouped.dequantise_grouped(q, sizes)
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-30).all()  # e4m3's unit roundoff, every group


def _emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum=False):
    """torch._scaled_grouped_mm's row-wise semantics on the host: 2d×3d (offsets along a's rows) and
    2d×2d (offsets along the reduced dim), b column-major, each scale per row or column."""
    assert b.stride(-2) == 1 and a.stride(-1) == 1 and a.dtype == b.dtype == torch.float8_e4m3fn
    assert out_dtype == torch.bfloat16 and offs.dtype == torch.int32 and a.shape[-1] % 16 == 0
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
        x = a.float() * scale_a.unsqueeze(1)
        parts = [x[s:e] @ (b[g].float() * scale_b[g]) for g, (s, e) in enumerate(zip(starts, ends))]
        return torch.cat(parts).to(out_dtype)
    n, k, groups = a.shape[0], b.shape[1], len(ends)
    assert scale_a.shape == (groups * n,) and scale_b.shape == (groups * k,)
    assert all((e - s) % 16 == 0 for s, e in zip(starts, ends))  # each group's tokens aligned
    sa, sb = scale_a.view(groups, n), scale_b.view(groups, k)
    parts = [
        (a[:, s:e].float() * sa[g].unsqueeze(1)) @ (b[s:e].float() * sb[g])
        for g, (s, e) in enumerate(zip(starts, ends))
    ]
    return torch.stack(parts).to(out_dtype)


def test_the_gpu_kernels_call_gives_the_same_products(monkeypatch):
    """The arguments handed to ``torch._scaled_grouped_mm`` on CUDA 9.x/10.x (scales repeated per row
    and column, b column-major, offsets), checked with a host emulation of its row-wise semantics."""
    calls = []

    def fake(*args, **kwargs):
        calls.append(args[1].dim())
        return _emulated_scaled_grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", fake)
    monkeypatch.setattr(grouped, "native_scaled_grouped_mm", lambda *args: True)
    sizes = FP8_SIZES["empty-groups"]
    xq, wq, dyq = fp8_operands(sizes)
    for name, got, want in zip(
        ("forward", "dX", "dW"), fp8_products(xq, wq, dyq, sizes), fp8_references(xq, wq, dyq, sizes)
    ):
        assert torch.equal(got, want), name
    assert calls == [3, 3, 2]


def test_fp8_weight_gradient_refuses_unaligned_token_runs():
    q = torch.zeros(16, 24, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="each a multiple of 16"):
        grouped.scaled_grouped_weight_grad(q, q, torch.ones(2), torch.ones(2), [8, 16], torch.bfloat16)
