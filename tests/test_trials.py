"""``axon4d.try_plans`` (axon4d.trials) for a library user's own model and step on an 8-rank gloo
world: the plans tried are the planner's fastest fitting ones in its order, a plan the builder
cannot build on one rank is skipped with that rank's reason on every rank, the fastest measured is
returned, nothing stays built (no grid, no process group), and ``axon4d.init(**tried.init_args())``
builds the chosen plan; bad arguments and a grid already built are refused on every rank alike.
The training job's ``--try`` on the same trials: tests/test_trial.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

import axon4d
from axon4d.config import get_config
from axon4d.models.transformer import Transformer
from axon4d.plan.auto import ranked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_MACHINE = os.path.join(ROOT, "bench", "results", "planner_machine_local.json")
WORLD = 8


def _model_config():
    return get_config("tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=128, seq_len=16)


def _user_job(failing_rank):
    """A library user's trial of the top 3 plans, whose builder cannot build the second on
    ``failing_rank``; then the chosen plan built and stepped, and the refusals."""
    mcfg = _model_config()
    plan = {"model": mcfg, "batch": 8, "machine": HOST_MACHINE, "recompute": "auto"}
    top = ranked(WORLD, **plan, precision="fp32", overlap="auto", rank=1, top=3)  # rank 1: prints nothing
    expected = [list(c.shape.as_tuple()) for c in top.candidates if c.fits][:3]
    ids = torch.randint(0, mcfg.vocab_size, (8, mcfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    built = []

    def build(grid, cand):
        if list(grid.shape.as_tuple()) == expected[1] and grid.rank == failing_rank:
            raise torch.OutOfMemoryError("planted: no room for this plan")
        model = Transformer(mcfg, grid=grid, recompute=cand.recompute)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = axon4d.shard_batch(ids[:, :-1], grid), axon4d.shard_batch(ids[:, 1:], grid)
        built.append((list(grid.shape.as_tuple()), model.recompute.value, cand.recompute))

        def step():
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return axon4d.Trial(model, opt, step)

    groups = len(c10d._world.pg_map)
    refused = {}
    try:
        axon4d.try_plans(build, plan=plan, top=0, precision="fp32")
    except ValueError as e:
        refused["top"] = str(e)
    tried = axon4d.try_plans(build, plan=plan, top=3, steps=1, rounds=1, precision="fp32")
    after = len(c10d._world.pg_map)
    try:
        axon4d.get_grid()
    except RuntimeError:
        left = None
    else:
        left = "a grid is still built"
    grid = axon4d.init(**tried.init_args(), precision="fp32")
    try:
        try:
            axon4d.try_plans(build, plan=plan, precision="fp32")
        except RuntimeError as e:
            refused["built"] = str(e)
        final = list(grid.shape.as_tuple())
    finally:
        axon4d.shutdown()
    return {
        "expected": expected,
        "rows": tried.rows,
        "best": list(tried.best.shape.as_tuple()),
        "built": built,
        "groups": (groups, after),
        "left": left,
        "final": final,
        "refused": refused,
    }


@pytest.mark.slow
def test_try_plans_tries_a_users_model_skips_a_plan_it_cannot_build_and_returns_the_fastest(pools):
    results = pools(WORLD).run(None, _user_job, 5, timeout=300)
    first = results[0]
    rows = first["rows"]
    assert [r["grid"] for r in rows] == first["expected"]  # the planner's three fastest fitting, in its order
    skipped = rows[1]
    assert skipped["measured_s"] is None and not skipped["chosen"]
    assert skipped["error"] == "rank 5: OutOfMemoryError: planted: no room for this plan"
    ran = [rows[0], rows[2]]
    assert all(r["measured_s"] > 0 and r["measured_peak_bytes"] > 0 and r["error"] is None for r in ran)
    (chosen,) = [r for r in rows if r["chosen"]]
    assert chosen["measured_s"] == min(r["measured_s"] for r in ran)
    for res in results:  # one verdict on every rank; nothing left built; the chosen plan built afterwards
        assert res["rows"] == rows and res["best"] == chosen["grid"] == res["final"]
        assert res["groups"][0] == res["groups"][1] and res["left"] is None
        # every plan built with the candidate's recomputation (the second not on rank 5)
        assert [b[0] for b in res["built"]] == [
            g for i, g in enumerate(first["expected"]) if i != 1 or res is not results[5]
        ]
        assert all(mode == asked for _, mode, asked in res["built"])
        assert "must be a whole number ≥ 1, e.g. top=3" in res["refused"]["top"]
        assert "a grid is already built: call axon4d.shutdown() first" in res["refused"]["built"]
