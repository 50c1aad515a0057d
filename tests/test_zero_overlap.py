"""Protects ZeRO's all-gathers over data left in flight into the next forward (axon4d.zero.gathers,
``overlap_gathers``) and the step skipped on the device (axon4d.train.optim.step, ``found_inf``):

- a deferred step returns with every bucket's gather in flight and parameters not yet whole; the next
  forward completes them (module pre-hooks, the scheduler's gathers over z and its prefetches) and
  training equals the eager step's bit for bit, in fp32 and with 16-bit weights;
- a checkpoint saved straight after a deferred step holds the whole parameters;
- with the collectives timed on a stand-in accelerator (a clock whose marks are read only once the
  device reached them, a link over data that completes its all-gathers late, reporting completion at
  once as NCCL does), the step's read of the communication log waits for none of ZeRO-2's gathers:
  every bucket's is still in flight when the next forward issues its first GEMM, the gathers' times
  are reported by the next step's read, and training equals the unsharded optimizer's bit for bit;
- a fused AdamW (torch's kernel, on the host here) given a non-finite flag leaves the weights, the
  moments and the step count as they were, sharded or not; a finite flag steps as without one;
- a flag given to a sharded optimizer whose kernel cannot take it is refused, naming the fix.
"""

import time

import pytest
import torch
from harness import value_errors

from axon4d import checkpoint, grads
from axon4d.config import ModelConfig
from axon4d.layout.geometry import Term
from axon4d.models.transformer import Transformer
from axon4d.nn.linear import Linear
from axon4d.options.overlap_policy import OverlapPolicy
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
        assert in_flight == [buckets] * 4 and buckets > 1, f"{where}: gathers in flight after each step {in_flight}"
        assert all(stale), f"{where}: the parameters were whole before the next forward: nothing was deferred"
        assert settled == [0, 0], f"{where}: gathers left in flight after a save / the next forward: {settled}"
        # an OAG prefetch of a weight still arriving would be gathered again once it arrived
        assert all(e == g > 0 for e, g in gathers), f"{where}: gathers over z (eager, deferred) per step: {gathers}"
        assert same, f"{where}: after the next forward the deferred model differs from the eager one"
        assert saved_whole, f"{where}: a checkpoint saved straight after a deferred step is not the whole model"


#: seconds the stand-in link over data takes per all-gather, one after another
LINK_S = 0.05


class _LateEvent:
    """A stand-in accelerator's timing event: the moment (``time.perf_counter``) the device reaches it."""

    def __init__(self, t):
        self.t = t

    def query(self):
        return time.perf_counter() >= self.t


class _StandInDevice:
    """A clock like an accelerator's (``axon4d.device.Clock`` with ``on_device``): reading a mark the
    device has not reached waits for it (``event.synchronize()``), and each such wait is counted;
    inside a collective's completion callback (``late``) a mark happens when the collective completes."""

    on_device = True

    def __init__(self):
        self.late = None
        self.waits = 0

    def mark(self):
        return _LateEvent(self.late if self.late is not None else time.perf_counter())

    def seconds(self, mark):
        if isinstance(mark, float):
            return mark
        ahead = mark.t - time.perf_counter()
        if ahead > 0:
            self.waits += 1
            time.sleep(ahead)
        return mark.t


class _LateWork:
    """A collective on the stand-in link: complete at ``t``; its completion is reported at once on a
    "stream" that waits for it (NCCL's future), and ``wait`` returns once it is complete."""

    def __init__(self, work, t, clock):
        self.work, self.t, self.clock = work, t, clock

    def wait(self):
        self.work.wait()
        time.sleep(max(0.0, self.t - time.perf_counter()))
        return True

    def add_done_callback(self, callback):
        self.clock.late = self.t
        try:
            callback()
        finally:
            self.clock.late = None


class _SlowLink:
    """The grid's transport with its all-gathers over data on a slow link: each completes ``LINK_S``
    after the one before it (or its issue); the times they complete, in issue order, in ``done``."""

    def __init__(self, inner, clock):
        self.inner, self.clock, self.free, self.done = inner, clock, 0.0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_gather(self, out, inp, axis):
        work = self.inner.all_gather(out, inp, axis)
        if axis != "data":
            return work
        self.free = max(time.perf_counter(), self.free) + LINK_S
        self.done.append(self.free)
        return _LateWork(work, self.free, self.clock)


def _timed_overlap(grid, steps=3):
    """ZeRO-2 with deferred gathers (the job's) and the unsharded optimizer, trained one after the other on
    the stand-in accelerator and link, the job's log read after each step: per step of ZeRO's, the
    stand-in clock's waits in that read, the buckets in flight after it, the times the next forward
    issued its first GEMM and its gathers completed (the next read's carried records), and whether
    they were in that read's times; both runs' losses and parameters."""
    comm = grid.comm
    clock, host = _StandInDevice(), comm.clock
    link = _SlowLink(comm.transport, clock)
    comm.use_clock(clock)
    comm.transport = link
    try:
        runs = {}
        for stage in (0, 2):
            torch.manual_seed(0)
            model = Transformer(LLAMA)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5, foreach=True)
            if stage:
                opt = shard_optimizer(opt, model, grid, stage=2, overlap_gathers=True)
            runs[stage] = (model, opt)
        first = next(m for m in runs[2][0].modules() if isinstance(m, Linear))
        gemm: list[float] = []
        first.register_forward_hook(lambda *_: gemm.append(time.perf_counter()))
        losses = {0: [], 2: []}
        reads = []
        for stage, (model, opt) in runs.items():  # one after the other: each read carries its own
            for step in range(steps):
                comm.log.clear()
                gen = torch.Generator().manual_seed(100 + step)
                batch = torch.randint(0, LLAMA.vocab_size, (8, LLAMA.seq_len + 1), generator=gen)
                issued = len(link.done)
                losses[stage].append(float(accumulate(model, [batch], grid)))
                opt.step()
                opt.zero_grad(set_to_none=True)
                waits = clock.waits
                summary = comm.log.summary()  # the job's read at the end of the step
                if stage:
                    carried = [r for r in comm.log.carried if r.tag == Term.ZERO_GATHER]
                    reads.append(
                        {
                            "waits": clock.waits - waits,
                            "in_flight": opt.gathers_in_flight,
                            "buckets": len(opt._gathers.buckets),
                            "issued": link.done[issued:],
                            "carried_done": [r.t_done for r in carried],
                            "carried_timed": all(r in comm.log.timed_records() for r in carried),
                            "comm_s": summary["comm_s"],
                        }
                    )
        runs[2][1].settle()
        params = {stage: [p.detach().clone() for p in model.parameters()] for stage, (model, _) in runs.items()}
        same = all(torch.equal(p, q) for p, q in zip(params[0], params[2]))
        moved = max(float((p - q).abs().max()) for p, q in zip(params[0], Transformer(LLAMA).parameters()))
        runs[2][1].release()
        return reads, gemm, losses, same, moved
    finally:
        comm.transport = link.inner
        comm.use_clock(host)


@pytest.mark.slow
def test_timed_zero2_gathers_overlap_the_next_forward_and_train_as_the_unsharded_optimizer(pools):
    """Reading the log at a step's end waits for no gather still meant to overlap the next forward:
    with the stand-in accelerator (module docstring) every bucket's gather is still in flight after
    the read, completes after the next forward issued its first GEMM, and is timed by the next read."""
    results = pools(2).run((1, 1, 1, 2), _timed_overlap, overlap=OverlapPolicy(bucket_mb=0.0), timeout=300)
    for rank, (reads, gemm, losses, same, moved) in enumerate(results):
        where = f"rank {rank}"
        assert losses[0] == losses[2] and same and moved > 1e-3, f"{where}: ZeRO-2 differs from unsharded: {losses}"
        assert len(gemm) == len(reads)
        for step, read in enumerate(reads):
            at = f"{where} step {step + 1}"
            assert read["waits"] == 0, f"{at}: the log's read waited for a collective ({read['waits']} marks)"
            assert read["buckets"] > 4 and read["in_flight"] == read["buckets"], f"{at}: {read}"
            assert len(read["issued"]) == read["buckets"], f"{at}: {read}"
            if step + 1 < len(reads):  # the gathers of this step, completed under the next forward
                nxt = reads[step + 1]
                assert nxt["carried_timed"] and nxt["carried_done"] == pytest.approx(read["issued"]), f"{at}: {nxt}"
                assert max(read["issued"]) > gemm[step + 1], (
                    f"{at}: the last gather completed at {max(read['issued']):.3f}, before the next forward's "
                    f"first GEMM at {gemm[step + 1]:.3f}: it did not overlap the forward"
                )


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
