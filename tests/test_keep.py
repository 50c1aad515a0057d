"""Protects keep-for-backward across micro-batches (``oag_keep`` under ``accumulating``,
axon4d/scheduler/gathers.py ``carry_block``, docs/design.md §4): with k micro-batches each layer's weight
block is gathered over z (E10f) once per step, not k times — except inside blocks under full
recomputation, which gather per micro-batch as before — the gradients and losses are those of the
same run without keep and of the single-process model, a weight written between micro-batches or
an optimizer step between steps makes the next forward gather again, and with k = 1 keep issues
exactly the collectives it issued before (nothing carried past the step's last backward).
"""

from collections import Counter

import pytest
import torch

import axon4d
from axon4d.layout.geometry import Term
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.nn.linear import Linear
from axon4d.train.batches import accumulate, accumulate_one
from tests.test_blocks import GPT, LLAMA, TOL, _assert_small, _grad_errors

E10F, E10B = str(Term.E10F), str(Term.E10B)


def _layers(model):
    """(3D layers inside the blocks, 3D layers outside them)."""
    names = [n for n, m in model.named_modules() if isinstance(m, Linear)]
    inside = sum(n.startswith("blocks.") for n in names)
    return inside, len(names) - inside


def _steps(grid, cfg, policy, micro, recompute="none"):
    """Two steps of ``micro`` micro-batches of 12 sequences under ``policy`` with an SGD step
    between them, the dense model alongside: per step (gradient errors against the dense model's,
    the gathered gradients themselves, this rank's loss, records per tag, blocks still carried)."""
    axon4d.overlap.configure(policy, grid)
    torch.manual_seed(7)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense, grid=grid, recompute=recompute)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, dense)]
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        batches = torch.randint(0, cfg.vocab_size, (12, cfg.seq_len + 1), generator=gen).chunk(micro)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        grid.comm.log.clear()
        loss = accumulate(model, batches, grid)
        tags = Counter(str(r.tag) for r in grid.comm.log.records)
        carried = grid.scheduler.carried_blocks
        accumulate(dense, batches, None)
        got = model.to_dense(grads=True)
        grads = {n: p.grad.clone() for n, p in got.named_parameters()}
        out.append((_grad_errors(dense, got), grads, float(loss), tags, carried))
        for opt in opts:
            opt.step()
    return _layers(model), out


def _keep_against_gathering(grid, cfg, recompute):
    """Three micro-batches per step with and without keep, and one with keep."""
    return (
        _steps(grid, cfg, "all", 3, recompute),
        _steps(grid, cfg, "all,keep", 3, recompute),
        _steps(grid, cfg, "all", 1, recompute),
        _steps(grid, cfg, "all,keep", 1, recompute),
    )


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize(
    "world,grid,recompute",
    [
        (2, (1, 1, 2, 1), "none"),
        (2, (1, 1, 2, 1), "full"),
        pytest.param(4, (2, 1, 2, 1), "none", marks=pytest.mark.slow),
        pytest.param(4, (2, 1, 2, 1), "full", marks=pytest.mark.slow),
        pytest.param(8, (1, 2, 2, 2), "none", marks=pytest.mark.slow),
    ],
)
def test_kept_blocks_are_gathered_once_per_step_and_give_the_same_gradients(pools, cfg, world, grid, recompute):
    for rank, results in enumerate(pools(world).run(grid, _keep_against_gathering, cfg, recompute)):
        (inside, outside), gathering = results[0]
        _, keeping = results[1]
        _, one_gathering = results[2]
        _, one_keeping = results[3]
        what = f"{cfg.arch} on {grid}, recompute {recompute}, rank {rank}"
        for step, (gathered, kept) in enumerate(zip(gathering, keeping)):
            errs, grads, loss, tags, carried = kept
            _assert_small([gathering[step][0], errs], TOL, f"{what}, step {step}")
            # the same gathered blocks, the same GEMMs: the same numbers as gathering every micro-batch
            assert loss == gathered[2], what
            for name, g in grads.items():
                assert torch.equal(g, gathered[1][name]), (what, step, name)
            # E10f: once per micro-batch per layer without keep (a block under full recomputation also in
            # its re-run); with keep once per step (step 1 too: the optimizer step changed every
            # weight), except the blocks' layers under full recomputation, which gather as before
            if recompute == "full":  # each block's layers gather in forward and in the re-run
                assert tags[E10F] == 3 * 2 * inside + outside == 3 * one_keeping[step][3][E10F] - 2 * outside, what
            else:
                assert gathered[3][E10F] == 3 * (inside + outside) and tags[E10F] == inside + outside, (what, step)
            assert E10B not in tags and carried == 0, (what, step)
            # every other collective as without keep
            assert {t: n for t, n in tags.items() if t != E10F} == {
                t: n for t, n in gathered[3].items() if t not in (E10F, E10B)
            }, (what, step)
        for one_gathered, one_kept in zip(one_gathering, one_keeping):  # k = 1: keep issues what it did before
            _assert_small([one_kept[0]], TOL, f"{what}, k = 1")
            tags = one_kept[3]
            assert tags[E10F] == (2 if recompute == "full" else 1) * inside + outside and E10B not in tags, what
            assert {t: n for t, n in tags.items() if t != E10F} == {
                t: n for t, n in one_gathered[3].items() if t not in (E10F, E10B)
            }, what
            assert one_kept[4] == 0, what


def _written_between(grid, cfg):
    """One step of three micro-batches under keep whose weights are all scaled in place between the
    first and the second micro-batch (both models): gradient errors, E10f records, blocks carried
    after the first and after the last micro-batch."""
    axon4d.overlap.configure("all,keep", grid)
    torch.manual_seed(7)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense, grid=grid)
    batches = torch.randint(0, cfg.vocab_size, (12, cfg.seq_len + 1), generator=torch.Generator().manual_seed(2))
    grid.comm.log.clear()
    carried = []
    for i, batch in enumerate(batches.chunk(3)):
        if i == 1:
            with torch.no_grad():
                for m in (model, dense):
                    for p in m.parameters():
                        p.mul_(0.9)
        for m, g in ((model, grid), (dense, None)):
            accumulate_one(m, batch, g, last=i == 2, parts=3)
        carried.append(grid.scheduler.carried_blocks)
    e10f = sum(r.tag == Term.E10F for r in grid.comm.log.records)
    return _grad_errors(dense, model.to_dense(grads=True)), e10f, carried, _layers(model)


@pytest.mark.parametrize("world,grid", [(2, (1, 1, 2, 1)), pytest.param(4, (2, 1, 2, 1), marks=pytest.mark.slow)])
def test_a_weight_written_between_micro_batches_is_gathered_again(pools, world, grid):
    for errs, e10f, carried, (inside, outside) in pools(world).run(grid, _written_between, LLAMA):
        _assert_small([errs], TOL, f"llama on {grid}")
        n = inside + outside
        assert e10f == 2 * n  # the first micro-batch, the second (weights changed); the third reuses
        assert carried == [n, n, 0]  # every layer's block carried over the held backward; none past the step
