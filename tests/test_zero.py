"""Protects the optimizer sharded over data (axon4d.zero, ZeRO-1 and ZeRO-2; docs/design.md §4):
after 20 AdamW steps with clipping active the parameters equal those of the unsharded optimizer
(fp32, ≤ 1e-6 relative) on four grids with data > 1, GPT and Llama, micro-batches > 1 on some;
the data axis moves a reduce-scatter and an all-gather where ZeRO-0 all-reduced; optimizer state
per rank shrinks by G_data (torch's MemTracker); checkpoints load across data sizes and with or
without sharding; bad stages, optimizers and --zero values are refused."""

import contextlib
import gc
import io
import math
import shutil
import warnings

import pytest
import torch
from harness import value_errors
from safetensors import safe_open
from test_train import _base
from torch.distributed._tools.mem_tracker import MemTracker

import axon4d
from axon4d import checkpoint, grads
from axon4d.config import ModelConfig
from axon4d.export import save_pretrained_
from axon4d.layout.geometry import Op, Term
from axon4d.models.transformer import Transformer
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.train.batches import accumulate
from axon4d.train.config import TrainConfig
from axon4d.train.loop import train
from axon4d.zero import GATHER_TAG, ShardedOptimizer, shard_optimizer

LLAMA = ModelConfig(
    n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama"
)
GPT = ModelConfig(n_layers=2, hidden=32, n_heads=4, vocab_size=64, seq_len=8, arch="gpt")
CLIP = 0.05  # below the gradients' norm on every step: clipping is active
# AdamW's eps 1e-5 (not 1e-8): a gradient that is rounding noise (the key bias's, whose true value
# is 0) is not scaled up to a full step, so a one-ulp change of the clipped norm stays one ulp


def _model_and_opt(cfg, stage, grid, seed=0):
    torch.manual_seed(seed)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5, foreach=True)
    return model, (opt if stage == 0 else shard_optimizer(opt, model, grid, stage=stage))


def _step(model, opt, grid, step, micro):
    gen = torch.Generator().manual_seed(100 + step)
    batches = torch.randint(0, model.cfg.vocab_size, (8 * micro, model.cfg.seq_len + 1), generator=gen).chunk(micro)
    accumulate(model, batches, grid)
    norm = grads.clip_grad_norm_(model, CLIP, grid)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(norm)


def _exactness(grid, cfg, micro, steps):
    """Train ZeRO-0, -1 and -2 models side by side; for each sharded one, the relative difference
    of all its parameters from the unsharded one's (‖p − r‖ / ‖r‖ over the whole model) and the
    worst of any one tensor (max |p − r| / max |r|); the gradient norms of every step."""
    runs = {stage: _model_and_opt(cfg, stage, grid) for stage in (0, 1, 2)}
    norms = {stage: [] for stage in runs}
    for step in range(steps):
        for stage, (model, opt) in runs.items():
            norms[stage].append(_step(model, opt, grid, step, micro))
    with torch.no_grad():
        ref = list(runs[0][0].parameters())
        whole, worst = {}, {}
        for stage in (1, 2):
            pairs = list(zip(runs[stage][0].parameters(), ref))
            whole[stage] = math.sqrt(
                sum(float((p - r).square().sum()) for p, r in pairs) / sum(float(r.square().sum()) for r in ref)
            )
            worst[stage] = max(float((p - r).abs().max() / r.abs().max().clamp_min(1e-30)) for p, r in pairs)
        moved = max(float((p - q).abs().max()) for p, q in zip(ref, _model_and_opt(cfg, 0, grid)[0].parameters()))
    return whole, worst, norms, moved


@pytest.mark.slow
@pytest.mark.parametrize(
    "grid,cfg,micro",
    [
        ((1, 1, 1, 2), LLAMA, 2),
        ((2, 1, 1, 2), GPT, 1),
        ((1, 2, 2, 2), LLAMA, 1),
        ((1, 1, 2, 4), GPT, 2),
    ],
    ids=["1x1x1x2-llama-mb2", "2x1x1x2-gpt", "1x2x2x2-llama", "1x1x2x4-gpt-mb2"],
)
def test_zero_1_and_2_equal_the_unsharded_optimizer_after_20_clipped_steps(pools, grid, cfg, micro):
    results = pools(math.prod(grid)).run(grid, _exactness, cfg, micro, 20, timeout=300)
    for rank, (whole, worst, norms, moved) in enumerate(results):
        assert moved > 1e-3, "the weights did not move: the comparison would prove nothing"
        assert min(norms[0]) > CLIP, "clipping was not active on every step"
        for stage in (1, 2):
            where = f"ZeRO-{stage} rank {rank} on {grid}"
            assert whole[stage] <= 1e-6, f"{where}: parameters differ by {whole[stage]:.3g} relative"
            # the key bias's true gradient is 0 (softmax ignores it): Adam scales its rounding
            # noise, so its last bits follow the order of the sums; a bound 10x looser per tensor
            assert worst[stage] <= 1e-5, f"{where}: a tensor differs by {worst[stage]:.3g} relative"
            assert norms[stage] == pytest.approx(norms[0], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [OverlapPolicy.off(), OverlapPolicy(bucket_mb=1.0)],
    ids=["overlap-off", "all-1MB-buckets"],
)
def test_zero_2_is_exact_without_overlap_and_with_buckets_of_several_shards(pools, policy):
    """Overlap off reduces each shard at once (the scheduler's synchronous path); 1 MB buckets hold
    every shard (laid side by side for the reduce-scatter) and every parameter (one all-gather)."""
    grid = (1, 1, 2, 2)
    for rank, (whole, worst, norms, _) in enumerate(pools(4).run(grid, _exactness, GPT, 2, 10, overlap=policy)):
        for stage in (1, 2):
            assert whole[stage] <= 1e-6 and worst[stage] <= 1e-5, (stage, rank, whole, worst)
            assert norms[stage] == pytest.approx(norms[0], rel=1e-6)


def _data_bytes(grid, cfg, stages=(0, 2)):
    """Per stage: the payload bytes of one step's collectives over data, by (op, tag); and the
    sizes of the Linear weight shards and of every parameter, for the expected figures."""
    out = {}
    for stage in stages:
        model, opt = _model_and_opt(cfg, stage, grid)
        _step(model, opt, grid, 0, 2)  # the first step learns the bucket layout
        grid.comm.log.clear()
        _step(model, opt, grid, 1, 2)
        counted = {}
        for r in grid.comm.log.records:
            if r.axis == "data":
                counted[(r.op.value, str(r.tag))] = counted.get((r.op.value, str(r.tag)), 0) + r.payload_bytes
        out[stage] = counted
        if stage:
            opt.release()
    weights = _linear_weights(model)
    every = [p.numel() for p in model.parameters()]
    return out, weights, every


def _linear_weights(model):
    """Elements of every axon4d.Linear weight shard of ``model`` on this rank (E12's gradients)."""
    return [m.weight.numel() for m in model.modules() if isinstance(m, axon4d.Linear)]


@pytest.mark.slow
def test_zero_2_reduce_scatters_and_all_gathers_over_data_where_zero_0_all_reduces(pools):
    grid = (2, 1, 1, 2)
    res, weights, every = pools(4).run(grid, _data_bytes, GPT)[0]
    g = grid[3]
    padded = lambda sizes: sum(g * math.ceil(n / g) * 4 for n in sizes)  # noqa: E731  fp32, each padded to G·c
    assert res[0] == {(Op.ALL_REDUCE.value, str(Term.E12)): sum(n * 4 for n in weights)}
    assert res[2] == {
        (Op.REDUCE_SCATTER.value, str(Term.E12)): padded(weights),
        (Op.ALL_GATHER.value, GATHER_TAG): padded(every),
    }


# -- memory -------------------------------------------------------------------------------------


def _optimizer_state_bytes(grid, stage):
    """Bytes of optimizer state on this rank after one step (torch's MemTracker, category
    Optstate), and of the gradients held after a backward: ``.grad`` plus ZeRO-2's parts
    (distinct storages)."""
    model, opt = _model_and_opt(LLAMA, stage, grid)
    tracker = MemTracker()
    with warnings.catch_warnings():  # it warns of parameters without gradients
        warnings.simplefilter("ignore", UserWarning)
        tracker.track_external(model, opt)
        with tracker:
            gen = torch.Generator().manual_seed(1)
            accumulate(model, (torch.randint(0, 64, (8, 9), generator=gen),), grid)
            held = [p.grad for p in model.parameters() if p.grad is not None]
            if stage:
                held += [m.grad for g in opt.param_groups for m in g["params"] if m.grad is not None]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
            opt.step()
            opt.zero_grad(set_to_none=True)
            state = tracker.get_tracker_snapshot("current")[grid.device]
    if stage == 2:
        opt.release()
    opt_bytes = next(v for k, v in state.items() if getattr(k, "value", k) == "Optstate")
    sizes = [p.numel() for p in model.parameters()]
    return opt_bytes, sum(storages.values()), sizes, _linear_weights(model)


@pytest.mark.slow
def test_optimizer_state_per_rank_shrinks_by_g_data(pools):
    grid = (1, 1, 1, 4)
    g = grid[3]
    for stages in zip(*[pools(4).run(grid, _optimizer_state_bytes, s) for s in (0, 1, 2)]):
        (full, full_grads, sizes, weights), (one, _, _, _), (two, two_grads, _, _) = stages
        n, k = sum(sizes), len(sizes)
        # AdamW's exp_avg and exp_avg_sq, fp32: 8·n bytes whole; in parts of ⌈n_i / G⌉ elements
        # each, at most 8 bytes more per parameter, and its step count (4 bytes) is not split
        assert full >= 8 * n
        assert one == two and full / g <= one <= full / g + 12 * k, (full, one, k)
        assert full_grads == 4 * n  # every parameter's .grad, whole
        # ZeRO-2: the Linear weights' gradients in parts of ⌈n / G⌉, the rest (embedding, norms) whole
        assert two_grads == full_grads - 4 * sum(weights) + 4 * sum(math.ceil(w / g) for w in weights)
        assert two_grads < 0.4 * full_grads


# -- checkpoints --------------------------------------------------------------------------------


def _dense(model):
    return {k: v.clone() for k, v in model.to_dense().state_dict().items()}


def _moments(model, opt, grid):
    """{moment: the dense model's tensors of it}: a ZeRO optimizer's parts are summed over data
    into whole local tensors first (every other rank's part is zero there)."""
    saved = [p.detach().clone() for p in model.parameters()]
    out = {}
    with torch.no_grad():
        for moment in ("exp_avg", "exp_avg_sq"):
            for p in model.parameters():
                if isinstance(opt, ShardedOptimizer):
                    start, master = opt.owned(p)
                    whole = torch.zeros(p.numel())
                    whole[start : start + master.numel()] = opt.state[master][moment]
                    p.copy_(grid.comm.all_reduce(whole, "data").wait().view(p.shape))
                else:
                    p.copy_(opt.state[p][moment])
            out[moment] = _dense(model)
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)
    return out


def _steps_of(opt, model):
    key = next(model.parameters())
    key = opt.owned(key)[1] if isinstance(opt, ShardedOptimizer) else key
    return float(opt.state[key]["step"])


def _save_sharded(grid, path, stage):
    """Two steps of a ZeRO model and of an unsharded one side by side; save the sharded one."""
    (model, opt), (ref, ref_opt) = _model_and_opt(LLAMA, stage, grid), _model_and_opt(LLAMA, 0, grid)
    for step in range(2):
        _step(model, opt, grid, step, 1)
        _step(ref, ref_opt, grid, step, 1)
    checkpoint.save(path, model, grid, opt, step=2)
    if stage == 2:
        opt.release()
    return _dense(ref), _moments(ref, ref_opt, grid)


def _load_into(grid, path, stage, save_to=None):
    """Load ``path`` into a fresh model and (ZeRO ``stage``) optimizer; its dense weights and
    moments and step count; with ``save_to``, save it again there (unsharded)."""
    model, opt = _model_and_opt(LLAMA, stage, grid, seed=7)
    checkpoint.load(path, model, grid, opt)
    if save_to:
        checkpoint.save(save_to, model, grid, opt, step=2)
    out = _dense(model), _moments(model, opt, grid), _steps_of(opt, model)
    if stage == 2:
        opt.release()
    return out


def _close(got, expected, what):
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-7, msg=f"{what}: {k}")


@pytest.mark.slow
def test_checkpoints_load_across_data_sizes_with_or_without_zero(pools, tmp_path):
    zero_ckpt, plain_ckpt = str(tmp_path / "zero"), str(tmp_path / "plain")
    weights, moments = pools(8).run((1, 1, 2, 4), _save_sharded, zero_ckpt, 2)[0]
    # a ZeRO-2 checkpoint of data 4: into no sharding on data 2 (and saved again), into ZeRO-1 on data 8
    for grid, stage, save_to in (((2, 1, 2, 2), 0, plain_ckpt), ((1, 1, 1, 8), 1, None)):
        for rank, (w, m, steps) in enumerate(pools(8).run(grid, _load_into, zero_ckpt, stage, save_to)):
            what = f"ZeRO-2 data 4 -> ZeRO-{stage} on {grid}, rank {rank}"
            _close(w, weights, what)
            for moment in m:
                _close(m[moment], moments[moment], f"{what}, {moment}")
            assert steps == 2.0
    # an unsharded checkpoint into ZeRO-2 on data 4 (z 2)
    for rank, (w, m, steps) in enumerate(pools(8).run((1, 1, 2, 4), _load_into, plain_ckpt, 2)):
        _close(w, weights, f"unsharded -> ZeRO-2, rank {rank}")
        for moment in m:
            _close(m[moment], moments[moment], f"unsharded -> ZeRO-2, rank {rank}, {moment}")
        assert steps == 2.0


# -- refusals -----------------------------------------------------------------------------------


def _refusals(grid):
    model = Transformer(LLAMA)
    adamw = lambda: torch.optim.AdamW(model.parameters())  # noqa: E731
    stepped = adamw()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    stepped.step()
    cases = {
        "stage 3": lambda: shard_optimizer(adamw(), model, grid, stage=3),
        "lbfgs": lambda: shard_optimizer(torch.optim.LBFGS(model.parameters()), model, grid),
        "unknown": lambda: shard_optimizer(_Custom(model.parameters()), model, grid),
        "stepped": lambda: shard_optimizer(stepped, model, grid),
        "foreign": lambda: shard_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))]), model, grid),
    }
    out = value_errors(cases)
    vouched = shard_optimizer(_Custom(model.parameters()), model, grid, elementwise=True)
    out["vouched"] = type(vouched.inner).__name__
    return out


class _Custom(torch.optim.Optimizer):
    """A user's optimizer axon4d cannot know to be elementwise (signSGD)."""

    def __init__(self, params, lr=1.0):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def test_bad_stages_and_optimizers_are_refused_naming_what_works(pools):
    msgs = pools(2).run((1, 1, 1, 2), _refusals)[0]
    assert "ZeRO stage 3" in msgs["stage 3"] and "give 1" in msgs["stage 3"]
    assert "LBFGS cannot be sharded" in msgs["lbfgs"] and "AdamW" in msgs["lbfgs"]
    assert "_Custom is not known to be elementwise" in msgs["unknown"] and "elementwise=True" in msgs["unknown"]
    assert "already stepped" in msgs["stepped"] and "checkpoint" in msgs["stepped"]
    assert "not one of the model's" in msgs["foreign"]
    assert msgs["vouched"] == "_Custom"


# -- the training job ---------------------------------------------------------------------------


def _job(tmp, **kw):
    """test_train's small job, on (1,1,2,2) with two micro-batches per step."""
    return _base(tmp, **{"grid": "1,1,2,2", "micro_batches": 2, **kw})


def _train(cfg):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = train(TrainConfig(**cfg))
    return summary["losses"], summary["optimizer"], summary["zero"], out.getvalue()


@pytest.mark.slow
def test_the_training_job_with_zero_follows_the_unsharded_curve_and_resumes_across_stages(pools, tmp_path):
    plain, kernel, stage, _ = pools(4).run(None, _train, _job(tmp_path / "plain"))[0]
    assert (kernel, stage) == ("foreach", 0)
    sharded, kernel, stage, banner = pools(4).run(None, _train, _job(tmp_path / "z", zero=2, save_every=2))[0]
    assert (kernel, stage) == ("foreach, ZeRO-2 over 2 data ranks", 2) and "AdamW foreach, ZeRO-2" in banner
    assert sharded == pytest.approx(plain, rel=1e-5)
    # resume the ZeRO-2 run's step-2 checkpoint without sharding on data 4, and with ZeRO-1 on data 1
    shutil.rmtree(tmp_path / "z" / "checkpoints" / "step_4")
    for grid, zero in (("1,1,1,4", 0), ("1,1,4,1", 1)):
        resumed, kernel, _, _ = pools(4).run(None, _train, _job(tmp_path / "z", grid=grid, zero=zero, resume="always"))[
            0
        ]
        assert resumed == pytest.approx(plain[2:], rel=1e-5), (grid, zero)
        shutil.rmtree(tmp_path / "z" / "checkpoints" / "step_4")
    assert kernel == "foreach, ZeRO-1 (a no-op: data 1)"


def test_a_bad_zero_value_is_refused_naming_the_stages():
    for bad in (3, -1, True):
        with pytest.raises(ValueError, match=r"--zero .*: choose 0 \(no sharding\), 1 .* or 2"):
            TrainConfig(zero=bad)


# -- training in 16 bits: the Linear weights stored in bf16, their fp32 masters sharded ---------


def _sixteen_bit_exactness(grid, cfg, micro, steps):
    """ZeRO-0, -1 and -2 side by side under ``bf16-fp32-reduce``: per sharded stage, the dtypes of
    the Linear weights and of the rest; the masters' relative difference from the unsharded fp32
    parameters (this rank's parts, over the whole model) and the largest difference of a weight
    from the unsharded parameter rounded to bf16, in bf16 ulps; every step's gradient norm."""
    runs = {stage: _model_and_opt(cfg, stage, grid) for stage in (0, 1, 2)}
    norms = {stage: [] for stage in runs}
    for step in range(steps):
        for stage, (model, opt) in runs.items():
            norms[stage].append(_step(model, opt, grid, step, micro))
    ref = dict(runs[0][0].named_parameters())
    out = {}
    with torch.no_grad():
        for stage in (1, 2):
            model, opt = runs[stage]
            linear = {id(m.weight) for m in model.modules() if isinstance(m, axon4d.Linear)}
            dtypes = {
                "linear": {str(p.dtype) for p in model.parameters() if id(p) in linear},
                "other": {str(p.dtype) for p in model.parameters() if id(p) not in linear},
            }
            num = den = 0.0
            ulps = 0.0
            for name, p in model.named_parameters():
                r = ref[name].detach().reshape(-1)
                start, master = opt.owned(p)
                part = r[start : start + master.numel()]
                num += float((master - part).square().sum())
                den += float(part.square().sum())
                if id(p) in linear:
                    rounded = r.to(p.dtype).float()
                    ulp = rounded.abs().clamp_min(1e-30) * 2**-7  # one bf16 ulp of each element (≤)
                    ulps = max(ulps, float(((p.reshape(-1).float() - rounded).abs() / ulp).max()))
            out[stage] = (dtypes, math.sqrt(num / den), ulps)
            opt.release()
    return out, norms


@pytest.mark.slow
@pytest.mark.parametrize(
    "grid,cfg,micro,policy",
    [
        ((1, 1, 1, 2), LLAMA, 2, None),
        ((1, 1, 2, 2), GPT, 1, None),
        ((2, 1, 1, 4), LLAMA, 1, None),
        ((1, 1, 2, 2), GPT, 2, OverlapPolicy.off()),
        ((1, 1, 2, 2), LLAMA, 1, OverlapPolicy(bucket_mb=1.0)),
    ],
    ids=["1x1x1x2-llama-mb2", "1x1x2x2-gpt", "2x1x1x4-llama", "1x1x2x2-gpt-mb2-overlap-off", "1x1x2x2-llama-1MB"],
)
def test_in_16_bits_zero_stores_linear_weights_in_bf16_and_follows_the_unsharded_masters(
    pools, grid, cfg, micro, policy
):
    # 4 steps: a bf16 weight rounded the other way (one ulp) moves the later steps' gradients, and
    # Adam then amplifies the gap chaotically, sharded or not; the fp32 test above runs 20
    results = pools(math.prod(grid)).run(
        grid, _sixteen_bit_exactness, cfg, micro, 4, precision="bf16-fp32-reduce", overlap=policy
    )
    for rank, (out, norms) in enumerate(results):
        for stage, (dtypes, whole, ulps) in out.items():
            where = f"ZeRO-{stage} rank {rank} on {grid}"
            assert dtypes == {"linear": {"torch.bfloat16"}, "other": {"torch.float32"}}, (where, dtypes)
            assert whole <= 1e-6, f"{where}: masters differ from the unsharded parameters by {whole:.3g}"
            assert ulps <= 1.0, f"{where}: a weight is {ulps:.2f} bf16 ulps from the unsharded one rounded"
            assert norms[stage] == pytest.approx(norms[0], rel=1e-5)


@pytest.mark.slow
def test_in_16_bits_zero_gathers_bf16_weights_and_reduces_fp32_gradients(pools):
    grid = (2, 1, 1, 2)
    res, weights, every = pools(4).run(grid, _data_bytes, GPT, (0, 1, 2), precision="bf16-fp32-reduce")[0]
    g = grid[3]
    padded = lambda sizes, size: sum(g * math.ceil(n / g) * size for n in sizes)  # noqa: E731
    assert res[0] == {(Op.ALL_REDUCE.value, str(Term.E12)): 4 * sum(weights)}  # fp32 sums
    # bf16 weights, fp32 biases, norms and tables
    gathered = padded(weights, 2) + padded(every, 4) - padded(weights, 4)
    assert res[1] == {
        (Op.ALL_REDUCE.value, str(Term.E12)): 4 * sum(weights),
        (Op.ALL_GATHER.value, GATHER_TAG): gathered,
    }
    assert res[2] == {
        (Op.REDUCE_SCATTER.value, str(Term.E12)): padded(weights, 4),
        (Op.ALL_GATHER.value, GATHER_TAG): gathered,
    }


def _save_sixteen_bit(grid, path):
    """Two steps of a ZeRO-2 model in 16 bits and of an unsharded one side by side; save the first.
    The unsharded one's fp32 weights and moments (what the masters equal, to rounding)."""
    (model, opt), (ref, ref_opt) = _model_and_opt(LLAMA, 2, grid), _model_and_opt(LLAMA, 0, grid)
    for step in range(2):
        _step(model, opt, grid, step, 1)
        _step(ref, ref_opt, grid, step, 1)
    checkpoint.save(path, model, grid, opt, step=2)
    opt.release()
    return _dense(ref), _moments(ref, ref_opt, grid)


def _reload_sixteen_bit(grid, path, save_to):
    """Load ``path`` into a fresh ZeRO-1 model in 16 bits and save it again at ``save_to``; the
    largest gap between a bf16 weight and its master part rounded (0: the load rounded the masters
    in), and the refusal of a load without the optimizer."""
    model, opt = _model_and_opt(LLAMA, 1, grid, seed=7)
    refused = value_errors({"no optimizer": lambda: checkpoint.load(path, model, grid)})["no optimizer"]
    checkpoint.load(path, model, grid, opt)
    gap = 0.0
    with torch.no_grad():
        for p in model.parameters():
            start, master = opt.owned(p)
            mine = p.reshape(-1)[start : start + master.numel()].float()
            if master.numel():
                gap = max(gap, float((mine - master.to(p.dtype).float()).abs().max()))
    checkpoint.save(save_to, model, grid, opt, step=2)
    opt.release()
    return gap, refused


@pytest.mark.slow
def test_in_16_bits_checkpoints_hold_the_fp32_masters_across_data_sizes(pools, tmp_path):
    first, second = str(tmp_path / "data2"), str(tmp_path / "data4")
    weights, moments = pools(4).run((1, 1, 2, 2), _save_sixteen_bit, first, precision="bf16-fp32-reduce")[0]
    reloaded = pools(4).run((1, 1, 1, 4), _reload_sixteen_bit, first, second, precision="bf16-fp32-reduce")
    assert [gap for gap, _ in reloaded] == [0.0] * 4
    # a load without the optimizer that holds the masters is refused on every rank, naming the fix
    assert all("pass it, load(path, model, grid, optimizer)" in refused for _, refused in reloaded)
    # the twice-saved masters, loaded unsharded in fp32, are the unsharded run's fp32 weights
    for rank, (w, m, steps) in enumerate(pools(4).run((2, 1, 1, 2), _load_into, second, 0)):
        _close(w, weights, f"16-bit ZeRO-2 -> 16-bit ZeRO-1 -> fp32, rank {rank}")
        for moment in m:
            _close(m[moment], moments[moment], f"16-bit ZeRO -> fp32, rank {rank}, {moment}")
        assert steps == 2.0


@pytest.mark.slow
def test_the_training_job_in_bf16_with_zero_follows_the_unsharded_curve_and_resumes_without_it(pools, tmp_path):
    """--precision bf16-fp32-reduce: ZeRO-2 stores the Linear weights in bf16 with sharded fp32
    masters; its checkpoint (the masters) resumes with --zero 0, where the weights are fp32 again."""
    bf16 = {"precision": "bf16-fp32-reduce"}
    plain = pools(4).run(None, _train, _job(tmp_path / "plain", **bf16))[0][0]
    sharded, kernel, _, _ = pools(4).run(None, _train, _job(tmp_path / "z", zero=2, save_every=2, **bf16))[0]
    assert kernel == "foreach, ZeRO-2 over 2 data ranks"
    assert sharded == pytest.approx(plain, rel=1e-4)
    shutil.rmtree(tmp_path / "z" / "checkpoints" / "step_4")
    resumed = pools(4).run(None, _train, _job(tmp_path / "z", zero=0, resume="always", **bf16))[0][0]
    assert resumed == pytest.approx(plain[2:], rel=1e-4)


def _export_sixteen_bit(grid, out):
    """A ZeRO-2 model in 16 bits, one step, exported live (``save_pretrained_``): the dtypes of the
    exported tensors and the dense model's logits of a fixed batch."""
    model, opt = _model_and_opt(LLAMA, 2, grid)
    _step(model, opt, grid, 0, 1)
    save_pretrained_(model, out)
    ids = torch.arange(16).remainder(LLAMA.vocab_size).view(2, 8)
    with torch.no_grad():
        logits = model.to_dense().float()(ids)
    opt.release()
    dtypes = set()
    if grid.rank == 0:
        with safe_open(f"{out}/model.safetensors", "pt") as f:
            dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    return ids, logits, dtypes


@pytest.mark.slow
def test_in_16_bits_a_live_export_writes_the_bf16_weights_the_model_computes_with(pools, tmp_path):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "hf")
    ids, logits, dtypes = pools(4).run((1, 1, 2, 2), _export_sixteen_bit, out, precision="bf16-fp32-reduce")[0]
    assert dtypes == {"BF16", "F32"}  # the Linear weights bf16, the norms and the token table fp32
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(input_ids=ids).logits
    assert float((got - logits).abs().max() / logits.abs().max()) <= 1e-5


def _dropped(grid):
    """A ZeRO-2 optimizer dropped without release(): how many shardings the scheduler holds before
    and after, and whether the next backward's weight gradients land in ``.grad`` again."""
    model, opt = _model_and_opt(GPT, 2, grid)
    before = len(grid.scheduler.data_shardings)
    del opt
    gc.collect()
    after = len(grid.scheduler.data_shardings)
    accumulate(model, (torch.randint(0, GPT.vocab_size, (8, GPT.seq_len + 1)),), grid)
    linear = [m.weight.grad is not None for m in model.modules() if isinstance(m, axon4d.Linear)]
    return before, after, all(linear)


def test_a_sharded_optimizer_dropped_without_release_leaves_the_scheduler(pools):
    assert pools(2).run((1, 1, 1, 2), _dropped) == [(1, 0, True)] * 2
