"""Protects FP8 dispatch (axon4d/options/fp8_rows.py, ``dispatch=fp8`` of axon4d/grid/expert_layout.py,
docs/moe.md "FP8 dispatch"): rows cast to e4m3 once, with fp32 quotients and one scale per 128
features; on 8-rank grids of each layout kind the MoE layer equals the single-process layer whose
expert inputs and expert-output gradients are cast alike (forward, every gradient; ≤ 1e-5 relative)
while it differs from the uncast one; the dispatch and the combine's gradient move the packed bytes
(the comm log), the combine and the dispatch's gradient the compute dtype; the casts make the passes
the planner prices; a training job runs under such a layout. Start here when changing how MoE rows
travel."""

import pytest
import torch
from test_moe import TOL, margin_inputs, rel_err
from torch.utils._python_dispatch import TorchDispatchMode

import axon4d
from axon4d.config import ModelConfig
from axon4d.device import fp8_fused
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.shape import GridShape
from axon4d.nn.moe import MoE
from axon4d.nn.moe_dense import DenseMoE
from axon4d.options import fp8_rows
from axon4d.options.precision import FP8
from axon4d.plan.moe_cost import pack_passes, unpack_passes


def test_a_row_is_rounded_once_from_an_fp32_quotient_whatever_its_dtype():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 256, generator=gen) * torch.logspace(-2, 1, 256)).bfloat16()
    packed = fp8_rows.pack(x)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 256 + 4 * 2)
    # the same bytes as from the exact fp32 values: no rounding of x/s to bf16 first
    assert torch.equal(packed, fp8_rows.pack(x.float()))
    blocks = x.float().view(6, 2, 128)
    scale = blocks.abs().amax(-1, keepdim=True) / 448.0
    want = (blocks / scale).to(FP8).view(6, 256)
    assert torch.equal(packed[:, :256].view(FP8).float(), want.float())
    twice = (blocks.bfloat16() / scale.bfloat16()).to(FP8).view(6, 256)  # the double rounding a bf16 quotient makes
    assert not torch.equal(twice.float(), want.float())


def test_each_block_of_128_features_has_its_own_scale_and_round_trips_within_e4m3():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 384, generator=gen)
    x[:, 128:256] *= 1e-3  # a block of small values keeps its precision under its own scale
    x[1, 256:] = 0.0  # a zero block stays zero, no NaN
    y = fp8_rows.round_trip(x)
    assert y.dtype == x.dtype and torch.isfinite(y).all() and (y[1, 256:] == 0).all()
    big = x.abs() >= x.abs().view(4, 3, 128).amax(-1).repeat_interleave(128, 1) * 2**-6  # e4m3's normal range
    assert ((y - x).abs() <= x.abs() * 2**-4 + 1e-30)[big].all()
    # a row cut into shards of whole blocks packs to the same values as the whole row
    halves = torch.cat([fp8_rows.round_trip(x[:, :128]), fp8_rows.round_trip(x[:, 128:])], dim=1)
    assert torch.equal(halves, y)


@pytest.fixture
def cast_mode():
    """Restores the cast path and the fused path's state after a test that sets them."""
    yield fp8_fused.set_mode
    fp8_fused.set_mode(None)
    fp8_fused._State.failure = None


def test_the_fused_row_cast_packs_the_eager_bytes(cast_mode):
    """Forced on the host (an accelerator's default): the compiled cast gives the eager path's bytes,
    for bf16 and fp32 rows, zero blocks and a non-finite one alike."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 256, generator=gen) * torch.logspace(-3, 2, 256)
    x[1, :128] = 0.0
    x[2, 200] = float("inf")
    for rows in (x, x.bfloat16()):
        cast_mode("eager")
        eager = fp8_rows.pack(rows)
        cast_mode("fused")
        fused = fp8_rows.pack(rows)
        assert fp8_fused.failure() is None
        assert torch.equal(fused, eager)


class _Passes(TorchDispatchMode):
    """Counts the ATen ops that launch work (views, aliases and allocations apart) and the bytes
    they move: each tensor argument read and each result written once; an in-place op reads and
    writes its first argument (``copy_`` reads its source and writes its destination)."""

    def __init__(self):
        super().__init__()
        self.kernels, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in ("detach", "empty", "promote_types"):
            return out
        self.kernels += 1
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name == "copy_":
            self.bytes += tensors[0].nbytes + tensors[1].nbytes
        elif name.endswith("_"):
            self.bytes += 2 * tensors[0].nbytes + sum(t.nbytes for t in tensors[1:])
        else:
            outs = out if isinstance(out, tuple) else (out,)
            self.bytes += sum(t.nbytes for t in tensors) + sum(o.nbytes for o in outs)
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_planner_prices_the_casts_passes_the_code_makes(dtype):
    """The eager pack and the unpack, counted op by op, against ``moe_cost.pack_passes`` and
    ``unpack_passes``: the same kernels, the same bytes but the scales' (4 per 128 values)."""
    rows, features = 64, 512
    x = torch.randn(rows, features, dtype=dtype)
    with _Passes() as packing:
        packed = fp8_rows.pack(x)
    with _Passes() as unpacking:
        fp8_rows.unpack(packed, features, dtype)
    for counted, (priced, kernels) in (
        (packing, pack_passes(rows, features, dtype.itemsize, fused=False)),
        (unpacking, unpack_passes(rows, features, dtype.itemsize)),
    ):
        assert counted.kernels == kernels
        scales = rows * features // 128 * 64  # the per-block ops on the scales: a few 4-byte values per 128
        assert priced <= counted.bytes <= priced + scales, (counted.bytes, priced)


def test_rows_not_in_whole_blocks_and_layouts_of_a_narrow_model_are_refused():
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_rows.pack(torch.zeros(2, 100))
    layout = ExpertLayout.parse("ep=world,tp=1,dispatch=fp8")
    assert layout.fp8_dispatch and str(layout) == "ep=world,tp=1,dispatch=fp8"
    assert ExpertLayout.parse(str(layout)) == layout and not ExpertLayout.parse("ep=world,tp=1").fp8_dispatch
    with pytest.raises(ValueError, match="hidden = 32.*multiple of 128"):
        layout.check(GridShape(2, 2, 2, 1), 8, 16, 0, 32)
    split = ExpertLayout.parse("ep=data,tp=x,dispatch=fp8")  # hidden/G_x must be whole blocks
    with pytest.raises(ValueError, match="hidden/128 = 3"):
        split.check(GridShape(2, 1, 1, 4), 8, 16, 0, 384)
    with pytest.raises(ValueError, match="dispatch one of compute, fp8"):
        ExpertLayout.parse("ep=world,dispatch=fp4")


CFG = ModelConfig(
    n_layers=1,
    hidden=256,
    n_heads=4,
    vocab_size=64,
    seq_len=8,
    arch="llama",
    n_experts=8,
    experts_per_token=2,
    expert_ffn=32,
    shared_experts=1,
    moe_aux_coef=0.05,
    moe_z_coef=1e-3,
)

#: (grid, layout) of each kind: whole experts over every rank, split over x·y with ep over data,
#: ep over z with replicas over data, and rows moved over x (y splits the experts)
LAYOUTS = {
    "whole-over-world": ((2, 2, 2, 1), "ep=world,tp=1,dispatch=fp8"),
    "split-xy-ep-data": ((2, 2, 1, 2), "ep=data,tp=x·y,dispatch=fp8"),
    "ep-z-replicas-data": ((2, 1, 2, 2), "ep=z,tp=x·y,dispatch=fp8"),
    "split-y-ep-x-z": ((2, 2, 2, 1), "ep=x·z,tp=y,dispatch=fp8"),
}


def _check(grid, chunks, starve=0):
    grid.comm.log.clear()
    torch.manual_seed(5)
    dense = DenseMoE(CFG)
    b, s = 4, CFG.seq_len
    x_full = margin_inputs(dense, b * s, seed=9, starve=starve).view(b, s, CFG.hidden)
    plain = DenseMoE(CFG)  # the uncast reference: FP8 dispatch must differ from it
    plain.load_state_dict(dense.state_dict())
    mod = MoE(CFG).load_dense_(dense)
    dense.fp8_dispatch = mod.layout.fp8_dispatches(grid.shape)
    v = torch.randn(CFG.hidden)
    x = axon4d.shard_input(x_full).detach().requires_grad_()
    with grid.scheduler.using({"forward_chunks": chunks, "min_chunk_kb": 0}):
        y = mod(x)
        loss = (y * axon4d.shard_features(v, "x")).sum().div(y.shape[0] * y.shape[1]) + mod.aux_loss
        loss.backward()
    errs, far = {}, {}
    for name, ref in (("cast", dense), ("plain", plain)):
        xr = x_full.clone().requires_grad_()
        yr = ref(xr)
        ((yr * v).sum().div(b * s) + ref.aux_loss).backward()
        out = {"forward": rel_err(axon4d.gather_batch(axon4d.gather_features(y, "x")), yr)}
        dx = axon4d.gather_batch(axon4d.gather_features(x.grad, "x")) / grid.size("batch")
        out["input_grad"] = rel_err(dx, xr.grad)
        got = dict(mod.to_dense(grads=True).named_parameters())
        for n, p in ref.named_parameters():
            out[f"{n}.grad"] = rel_err(got[n].grad, p.grad)
        (errs if name == "cast" else far).update(out)
    by_tag = {}
    for r in grid.comm.log.records:
        by_tag.setdefault(str(r.tag), []).append(r.payload_bytes)
    return errs, far, by_tag, mod.rows_over_x


@pytest.mark.parametrize("kind", [*LAYOUTS, "starved"])
def test_the_layer_under_fp8_dispatch_equals_the_reference_cast_alike(pools, kind):
    """Each layout kind; "starved": whole experts over every rank, the last four experts reached by
    no token, so four ranks receive no row and send none back (empty packs)."""
    grid, layout = LAYOUTS["whole-over-world" if kind == "starved" else kind]
    chunks = 2 if kind == "whole-over-world" else 1  # chunked exchanges too
    starve = 4 if kind == "starved" else 0
    for errs, far, by_tag, rows_over_x in pools(8).run(grid, _check, chunks, starve, expert_layout=layout):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"{layout} on {grid}: {bad}"
        assert rows_over_x == (not ExpertLayout.parse(layout).splits("x"))  # whole rows travel where x doesn't split
        assert far["forward"] > 1e-3 and far["experts.up.grad"] > 1e-3, f"nothing was cast: {far}"
        shape = GridShape(*grid)
        features = ExpertLayout.parse(layout).dispatched_features(shape, CFG.hidden)
        packed, plain = features + 4 * (features // 128), features * 4  # bytes of a row: fp8 + scales, fp32
        for tag, width in (  # the dispatch's rows carry their gates' 4 bytes, and their gradients the gates'
            ("moe.dispatch", packed + 4),
            ("moe.combine.grad", packed),
            ("moe.combine", plain),
            ("moe.dispatch.grad", plain + 4),
        ):
            sizes = by_tag[tag]
            assert len(sizes) == chunks and all(n % width == 0 for n in sizes), (tag, sizes, width)
        rows = sum(by_tag["moe.dispatch"]) // (packed + 4)
        assert rows == sum(by_tag["moe.combine.grad"]) // packed  # the rows sent out come back


def _fp8_job(root):
    """On each rank: a 3-step tiny-moe job (hidden 128) under whole experts over data with rows in
    the compute dtype, in FP8, and in FP8 under bf16-fp8 (FP8 grouped GEMMs) — (losses, the layout
    each summary names) — and the job's refusal of FP8 dispatch for tiny-moe's own hidden of 64."""
    import os

    from axon4d.train import TrainConfig, train

    job = dict(model="tiny-moe", hidden=128, steps=3, batch_size=4, warmup_steps=0, progress=False, grid="1,1,1,4")
    out = []
    for layout in ("ep=data,tp=1", "ep=data,tp=1,dispatch=fp8"):
        summary = train(TrainConfig(**job, expert_layout=layout, out_dir=os.path.join(root, layout)))
        out.append((summary["losses"], summary["expert_layout"]))
    # with the experts' grouped GEMMs in FP8 too: the restored rows are cast again, per expert
    gemms = train(
        TrainConfig(**job, expert_layout="ep=data,tp=1,dispatch=fp8", precision="bf16-fp8", out_dir=root + "/gemms")
    )
    out.append((gemms["losses"], gemms["expert_layout"]))
    try:
        train(TrainConfig(**{**job, "hidden": 0}, expert_layout="ep=data,dispatch=fp8", out_dir=root + "/narrow"))
        refusal = ""
    except ValueError as e:
        refusal = str(e)
    return out, refusal


@pytest.mark.slow
def test_a_training_job_runs_under_fp8_dispatch_and_refuses_a_narrow_model(pools, tmp_path):
    runs = pools(4).run(None, _fp8_job, str(tmp_path), timeout=300)
    for ((plain, plain_layout), (fp8, fp8_layout), (gemms, _)), refusal in runs:
        assert (plain_layout, fp8_layout) == ("ep=data,tp=1", "ep=data,tp=1,dispatch=fp8")
        assert len(fp8) == 3 and all(abs(a - b) <= 0.01 * abs(b) for a, b in zip(fp8, plain)), (fp8, plain)
        assert fp8 != plain  # the rows were cast
        assert len(gemms) == 3 and all(abs(a - b) <= 0.05 * abs(b) for a, b in zip(gemms, plain)), (gemms, plain)
        assert "hidden = 64" in refusal and "multiple of 128" in refusal, refusal


#: an MoE model whose hidden is whole blocks of 128 on every split a small search tries
PLANNED = CFG.replace(n_layers=2, seq_len=256, vocab_size=1024)


def _layouts(**kw):
    from axon4d.plan.search import plan

    r = plan(PLANNED, 8, "h100", 16, top=None, **kw)
    return {(c.shape, c.expert_layout) for c in r.candidates}


def test_the_search_offers_fp8_dispatch_as_asked_and_a_pinned_layout_says_it_itself():
    both, on, off = _layouts(), _layouts(fp8_dispatch=True), _layouts(fp8_dispatch=False)
    fp8 = {lay for _, lay in both if lay.endswith(",dispatch=fp8")}
    assert fp8 and {lay for _, lay in both} - fp8  # auto: each layout both ways
    assert not any(lay.endswith(",dispatch=fp8") for _, lay in off)
    crossing = {(s, lay) for s, lay in on if ExpertLayout.parse(lay).ep_axes(s)}  # rows cross an axis
    assert crossing and all(lay.endswith(",dispatch=fp8") for _, lay in crossing)
    from axon4d.plan.search import plan

    with pytest.raises(ValueError, match="pinned expert layout ep=world,tp=1: a pinned layout says how its rows"):
        plan(PLANNED, 8, "h100", 16, expert_layout="ep=world,tp=1", fp8_dispatch=True)
    with pytest.raises(ValueError, match="fp8_dispatch = 'yes': use auto, True or False"):
        plan(PLANNED, 8, "h100", 16, fp8_dispatch="yes")


def test_the_training_job_asks_for_fp8_dispatch_as_pinned():
    from axon4d.plan.options import AUTO_OPTION
    from axon4d.train import TrainConfig, planned

    assert planned.question(TrainConfig(model="tiny-moe", grid="auto"), accelerator=True)["fp8_dispatch"] == AUTO_OPTION
    pinned = TrainConfig(model="tiny-moe", grid="auto", pin="fp8_dispatch")
    assert planned.question(pinned, accelerator=True)["fp8_dispatch"] is False  # the default layout's rows
    given = TrainConfig(model="tiny-moe", hidden=128, grid="auto", expert_layout="ep=world,tp=1,dispatch=fp8")
    asked = planned.question(given, accelerator=True)
    assert asked["fp8_dispatch"] is True and asked["expert_layout"] == "ep=world,tp=1,dispatch=fp8"
