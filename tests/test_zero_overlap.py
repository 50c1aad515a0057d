"""Protects ZeRO's all-gathers over data left in flight into the next forward (axon4d.zero.gathers,
``overlap_gathers``) and the step skipped on the device (axon4d.train.optim.step, ``found_inf``):

- a deferred step returns with its last bucket's gather in flight and parameters not yet whole; the next
  forward completes them (module pre-hooks, the scheduler's gathers over z and its prefetches) and
  training equals the eager step's bit for bit, in fp32 and with 16-bit weights;
- a checkpoint saved straight after a deferred step holds the whole parameters;
- a fused AdamW (torch's kernel, on the host here) given a non-finite flag leaves the weights, the
  moments and the step count as they were, sharded or not; a finite flag steps as without one;
- a flag given to a sharded optimizer whose kernel cannot take it is refused, naming the fix.
"""

import pytest
import torch
from harness import value_errors

from axon4d import checkpoint, grads
from axon4d.config import ModelConfig
from axon4d.layout.geometry import Term
from axon4d.models.transformer import Transformer
from axon4d.train import optim
from axon4d.train.batches import accumulate
from axon4d.zero import shard_optimizer

LLAMA = ModelConfig(
    n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama"
)


def _pair(grid, stage, **kw):
    """Two identical models with ZeRO ``stage``: eager gathers, and deferred ones."""
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = Transformer(LLAMA)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5, **kw)
        runs.append((model, shard_optimizer(inner, model, grid, stage=stage, overlap_gathers=overlap)))
    return runs


def _train_step(model, opt, grid, step):
    gen = torch.Generator().manual_seed(100 + step)
    batch = torch.randint(0, LLAMA.vocab_size, (8, LLAMA.seq_len + 1), generator=gen)
    loss = accumulate(model, [batch], grid)
    grads.clip_grad_norm_(model, 0.05, grid)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def _gathers_over_z(grid, train):
    """The loss of ``train()`` and the all-gathers over z (E10f, E10b) it issued."""
    grid.comm.log.clear()
    loss = train()
    return loss, sum(1 for r in grid.comm.log.records if r.tag in (Term.E10F, Term.E10B))


def _deferred_equals_eager(grid, stage, path):
    (eager, e_opt), (late, l_opt) = _pair(grid, stage)
    losses, in_flight, stale, settled, gathers = [], [], [], [], []
    for step in range(4):
        e_loss, e_gathers = _gathers_over_z(grid, lambda: _train_step(eager, e_opt, grid, step))
        l_loss, l_gathers = _gathers_over_z(grid, lambda: _train_step(late, l_opt, grid, step))
        losses.append((e_loss, l_loss))
        gathers.append((e_gathers, l_gathers))
        in_flight.append(l_opt.gathers_in_flight)
        with torch.no_grad():  # before the next forward: some rank's parts have not arrived
            stale.append(any(not torch.equal(p, q) for p, q in zip(late.parameters(), eager.parameters())))
        if step == 2:  # a save straight after a deferred step: the whole parameters
            checkpoint.save(path, late, grid, l_opt, step=3, overwrite=True)
            settled.append(l_opt.gathers_in_flight)
    with torch.no_grad():
        late(torch.zeros(2, LLAMA.seq_len, dtype=torch.long))  # the next forward completes the gathers
    settled.append(l_opt.gathers_in_flight)
    same = all(torch.equal(p, q) for p, q in zip(late.parameters(), eager.parameters()))
    torch.manual_seed(1)
    fresh = Transformer(LLAMA)
    f_opt = shard_optimizer(torch.optim.AdamW(fresh.parameters(), lr=1e-2), fresh, grid, stage=stage)
    checkpoint.load(path, fresh, grid, f_opt)
    (ref, r_opt) = _pair(grid, stage)[0]
    for step in range(3):
        _train_step(ref, r_opt, grid, step)
    saved_whole = all(torch.equal(p, q) for p, q in zip(fresh.parameters(), ref.parameters()))
    return losses, in_flight, stale, settled, same, saved_whole, len(l_opt._gathers.buckets), gathers


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,precision", [(2, "fp32"), (1, "bf16-fp32-reduce")], ids=["zero2-fp32", "zero1-bf16-weights"]
)
def test_deferred_gathers_finish_in_the_next_forward_and_train_as_eager_ones(pools, tmp_path, stage, precision):
    grid = (1, 1, 2, 2)  # z = 2: the scheduler's gathers over z and their prefetches read deferred weights
    path = str(tmp_path / "ckpt")
    results = pools(4).run(grid, _deferred_equals_eager, stage, path, precision=precision, timeout=300)
    for rank, (losses, in_flight, stale, settled, same, saved_whole, buckets, gathers) in enumerate(results):
        where = f"ZeRO-{stage} {precision} rank {rank}"
        assert all(a == b for a, b in losses), f"{where}: deferred and eager losses differ: {losses}"
        assert in_flight == [1] * 4 and buckets > 1, f"{where}: gathers in flight after each step {in_flight}"
        assert all(stale), f"{where}: the parameters were whole before the next forward: nothing was deferred"
        assert settled == [0, 0], f"{where}: gathers left in flight after a save / the next forward: {settled}"
        # an OAG prefetch of a weight still arriving would be gathered again once it arrived
        assert all(e == g > 0 for e, g in gathers), f"{where}: gathers over z (eager, deferred) per step: {gathers}"
        assert same, f"{where}: after the next forward the deferred model differs from the eager one"
        assert saved_whole, f"{where}: a checkpoint saved straight after a deferred step is not the whole model"


def _fused_pair():
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 4)
    b = torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (a, b)]
    for m in (a, b):
        m(torch.ones(3, 8)).sum().backward()
    return (a, opts[0]), (b, opts[1])


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters() if p in opt.state]
    return params, state


def _same(x, y):
    (pa, sa), (pb, sb) = x, y
    return all(torch.equal(p, q) for p, q in zip(pa, pb)) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(sa, sb)
    )


def test_a_fused_adamw_skips_a_non_finite_step_on_the_device_and_steps_a_finite_one_as_usual():
    (a, opt_a), (b, opt_b) = _fused_pair()
    opt_a.step()  # one step each, so the moments and the step count exist
    opt_b.step()
    for m in (a, b):
        m(torch.ones(3, 8)).sum().backward()
    before = _snapshot(a, opt_a)
    reads = []
    finite = optim.step(opt_a, torch.tensor([float("nan")]), torch.tensor(1.0), lambda: reads.append(1) or False)
    assert not finite and reads == [1], "the host read must run once and report the step not finite"
    assert _same(_snapshot(a, opt_a), before), "a non-finite step moved the weights, the moments or the step"
    finite = optim.step(opt_a, torch.tensor([2.0]), torch.tensor(1.0), lambda: True)
    opt_b.step()
    assert finite and _same(_snapshot(a, opt_a), _snapshot(b, opt_b)), "a finite flag changed the step"
    assert not _same(_snapshot(a, opt_a), before), "the finite step did not move the weights"
    assert getattr(opt_a, "found_inf", None) is None, "the flag was left on the optimizer"


def _sharded_skip(grid):
    torch.manual_seed(0)
    model = Transformer(LLAMA)
    outcomes = {}
    for kernel in ("fused", "foreach"):
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, **{kernel: True})
        opt = shard_optimizer(inner, model, grid, stage=2, overlap_gathers=True)
        batch = torch.randint(0, LLAMA.vocab_size, (4, LLAMA.seq_len + 1), generator=torch.Generator().manual_seed(3))
        accumulate(model, [batch], grid)
        if kernel == "foreach":
            opt.found_inf = torch.tensor(1.0)
            outcomes["refused"] = value_errors({"foreach": opt.step})["foreach"]
            opt.found_inf = None
        else:
            opt.step()  # a first step: moments exist
            opt.zero_grad()
            accumulate(model, [batch], grid)
            params = [p.detach().clone() for p in model.parameters()]
            moments = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
            finite = optim.step(opt, torch.tensor(float("inf")), torch.tensor(1.0), lambda: False)
            opt.settle()
            outcomes["finite"] = finite
            outcomes["params_kept"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
            outcomes["moments_kept"] = all(
                all(torch.equal(s[k], m[k]) for k in m) for s, m in zip(opt.state.values(), moments)
            )
        opt.zero_grad()
        opt.release()
    return outcomes


@pytest.mark.slow
def test_a_sharded_fused_adamw_skips_on_the_device_and_a_foreach_one_refuses_the_flag(pools):
    for rank, out in enumerate(pools(2).run((1, 1, 1, 2), _sharded_skip)):
        assert out["finite"] is False, rank
        assert out["params_kept"] and out["moments_kept"], f"rank {rank}: the skipped step changed the state: {out}"
        msg = out["refused"]
        assert msg and "found_inf" in msg and "fused=True" in msg, f"rank {rank}: {msg!r}"


def _gathers_after_configure(grid):
    """ZeRO's all-gathers over data per step, before and after the grid's policy changes its bucket size."""
    torch.manual_seed(0)
    model = Transformer(LLAMA)
    opt = shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, grid, stage=1)
    counts = []
    for step in range(2):
        if step == 1:
            grid.scheduler.configure({"bucket_mb": 1.0})  # every parameter fits one bucket per dtype
        grid.comm.log.clear()
        _train_step(model, opt, grid, step)
        counts.append(sum(1 for r in grid.comm.log.records if r.tag == Term.ZERO_GATHER))
    return counts, len(list(model.parameters()))


def test_a_policy_s_new_bucket_size_reaches_zero_s_gathers(pools):
    for counts, params in pools(2).run((1, 1, 1, 2), _gathers_after_configure):
        assert counts == [params, 1], f"gathers per step {counts} ({params} parameters, then one bucket)"
