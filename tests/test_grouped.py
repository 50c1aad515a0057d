"""Protects the grouped GEMMs of the expert layers (axon4d/device/grouped.py, docs/moe.md E18): on
both of their paths — ``torch._grouped_mm`` and the padded batched GEMM — ``grouped_mm``,
``grouped_mm_t`` and ``grouped_weight_grad`` equal one product per group (the loop reference kept
here, not in the library) in fp32 within 1e-6 relative, for uneven groups, empty groups, a single
group, all rows in one group and no rows at all, and in bf16 within its rounding; and no Python
loop over the groups runs (one batched GEMM per call, no per-group matmul). Start here when
changing how the grouped GEMMs run."""

import pytest
import torch

from axon4d.device import grouped

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
