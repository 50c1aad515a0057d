"""How ``--try`` and ``axon4d.try_plans`` choose among the plans they timed (axon4d.trials.choose):
the planner's first plan that ran unless another's slowest round beat its fastest; the interleaved
repeat table (``repeats``); and ``axon4d.plan.auto.ranked`` priced with a correction."""

from __future__ import annotations

import dataclasses
import os

import pytest

from axon4d import trials
from axon4d.config import get_config
from axon4d.plan import correction
from axon4d.plan.auto import ranked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_MACHINE = os.path.join(ROOT, "bench", "results", "planner_machine_local.json")


def _rows(*rounds):
    """Rows of plans 1, 2, ... with these rounds' seconds (None: the plan failed)."""
    out = []
    for i, r in enumerate(rounds):
        ok = r is not None
        row = {"rank": i + 1, "grid": [1, 1, 1, i + 1], "rounds_s": r or [None], "chosen": False}
        row |= {"measured_s": sorted(r)[len(r) // 2] if ok else None, "error": None if ok else "rank 0: boom"}
        out.append(row)
    return out


def test_the_planners_first_stays_unless_another_is_faster_beyond_the_spread():
    rows = _rows([1.0, 1.2, 1.1], [0.95, 1.05, 1.0], [1.3, 1.4, 1.2])  # plan 2 faster by its median, within spread
    assert trials.choose(rows, "t", "h")["rank"] == 1
    rows = _rows([1.0, 1.2, 1.1], [0.8, 0.9, 0.85], [0.5, 0.99, 0.6])  # both beyond: the faster median
    assert trials.choose(rows, "t", "h")["rank"] == 3 and sum(r["chosen"] for r in rows) == 1
    rows = _rows(None, [1.0, 1.1, 1.0], [0.7, 0.8, 0.75])  # the first failed: the next that ran is the reference
    assert trials.choose(rows, "t", "h")["rank"] == 3
    with pytest.raises(RuntimeError, match=r"t: no plan ran \(\[1, 1, 1, 1\]: rank 0: boom\); h"):
        trials.choose(_rows(None), "t", "h")


def test_the_repeat_table_is_round_by_round_in_the_planners_order():
    rows = _rows([1.0, 1.1], [None], [2.0, 2.1])
    table = [(e["round"], e["plan"], e["measured_s"]) for e in trials.repeats(rows)]
    assert table == [(1, 1, 1.0), (1, 2, None), (1, 3, 2.0), (2, 1, 1.1), (2, 3, 2.1)]


def test_ranked_takes_a_correction():
    model = get_config("tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=128, seq_len=16)
    ask = dict(model=model, batch=8, machine=HOST_MACHINE, precision="fp32", rank=1, top=3)
    plain = ranked(8, **ask).best
    corr = correction.Correction("local", 8, compute=2.0, communication=2.0)
    scaled = ranked(8, **ask, correction=corr)
    same = next(c for c in scaled.candidates if c.shape == plain.shape and c.options == plain.options)
    assert same.time.step_s == pytest.approx(2.0 * plain.time.step_s, rel=0.05)
    with pytest.raises(ValueError, match="measured on 4 ranks, this job has 8"):
        ranked(8, **ask, correction=dataclasses.replace(corr, world=4))


def test_under_nccl_a_rank_aborts_the_trials_groups_when_another_failed():
    """``fence.TrialWorld.watch`` (NCCL's path, here with stand-in groups and an in-memory store):
    within a poll or two of another rank's failure the watching rank aborts its trial's groups; the
    rank that failed first does not abort its own."""
    import time

    import torch.distributed as dist

    from axon4d.reliability import fence

    class Group:
        aborted = 0

        def abort(self):
            self.aborted += 1

    store = dist.HashStore()
    worlds = [fence.TrialWorld(store, "t", rank, 2, 10.0) for rank in range(2)]
    groups = [[Group(), Group()] for _ in worlds]
    for w, g in zip(worlds, groups, strict=True):
        w._group = g[1]  # the trial's world
        w.watch(lambda g=g: g[:1], on_host=False)
    assert worlds[1].fail() and not worlds[0].fail()  # rank 1 first, rank 0 after it
    deadline = time.monotonic() + 10
    while groups[0][0].aborted == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2 * fence.POLL_S)
    for w in worlds:
        w.stop_watching()
    assert [g.aborted for g in groups[0]] == [1, 1] and [g.aborted for g in groups[1]] == [0, 0]
    assert worlds[0].origin() == 1 and worlds[0].failed()
