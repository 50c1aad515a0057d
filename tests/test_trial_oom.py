"""``axon4d train --grid auto --try 3`` on 4 gloo ranks where the planner's first plan runs out of
memory on one rank in the middle of a step (planted by ``$AXON4D_TRIAL_OOM``, axon4d.trials): the
plan is skipped on every rank within seconds (axon4d.reliability.fence), its reason recorded, and
the run trains with the best of the others; ``trials.json`` holds the interleaved repeat table."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from axon4d import trials
from axon4d.plan.job import plan_job
from axon4d.train import TrainConfig, planned, train, trial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_MACHINE = os.path.join(ROOT, "bench", "results", "planner_machine_local.json")
TINY = dict(model="tiny", layers=2, hidden=64, heads=4, kv_heads=2, vocab_size=128, seq_len=16, progress=False)
WORLD = 4
#: --try-rounds here (3 by default): enough for an interleaved table, kept short
ROUNDS = 2


def _doomed_run(base, failing_rank):
    """A --try 3 run whose planner's first plan runs out of memory mid-step on ``failing_rank``;
    the seconds each try of that plan took on this rank (build to agreement), the doomed grid."""
    cfg = TrainConfig(**base)
    doomed = plan_job(dataclasses.replace(planned.request(cfg, False, 3), rank=1)).fitting[0].shape
    spec = ",".join(map(str, doomed.as_tuple()))
    took: list[float] = []
    one = trials._try_one

    def timed(cand, *args):
        t0 = time.perf_counter()
        try:
            return one(cand, *args)
        finally:
            if cand.shape == doomed:
                took.append(time.perf_counter() - t0)

    os.environ[trials.OOM_ENV] = f"{spec}@{failing_rank}"
    trials._try_one = timed
    try:
        return train(cfg), list(doomed.as_tuple()), took
    finally:
        trials._try_one = one
        del os.environ[trials.OOM_ENV]


@pytest.mark.slow  # ~70 s here: a 4-rank training job that builds and steps five plans (two rounds)
def test_a_plan_out_of_memory_mid_step_on_one_rank_is_skipped_within_seconds(pools, tmp_path):
    # whole sequences pinned: the planted out-of-memory names a grid, which split sequences could share
    base = dict(
        grid="auto",
        try_plans=3,
        try_steps=1,
        try_rounds=ROUNDS,
        machine=HOST_MACHINE,
        steps=1,
        batch_size=8,
        pin="context_parallel",
    )
    out = str(tmp_path / "oom")
    results = pools(WORLD).run(None, _doomed_run, {**base, **TINY, "out_dir": out}, 3, timeout=300)
    rows = results[0][0]["trials"]
    for summary, _, took in results:  # every rank: the same verdict, within seconds, and a run trained
        assert summary["trials"] == rows and len(summary["losses"]) == 1
        assert len(took) == 1 and took[0] < 30, took  # tried once, skipped within 30 s on every rank
    doomed = results[0][1]
    skipped = rows[0]
    assert skipped["grid"] == doomed and skipped["measured_s"] is None and not skipped["chosen"]
    assert skipped["failure"] == "out of memory"
    assert skipped["error"].startswith("rank 3: OutOfMemoryError: out of memory planted by AXON4D_TRIAL_OOM")
    others = rows[1:]
    assert all(len(r["rounds_s"]) == ROUNDS and r["measured_s"] > 0 and r["error"] is None for r in others)
    (chosen,) = [r for r in rows if r["chosen"]]
    reference, challenger = others
    beyond = max(challenger["rounds_s"]) < min(reference["rounds_s"])
    assert chosen is (challenger if beyond else reference)  # the best of the others, by the documented rule
    assert results[0][0]["grid"].endswith(f"data={chosen['grid'][3]})")
    record = json.load(open(os.path.join(out, trial.TRIALS_FILE)))
    assert record["rule"] == trials.RULE and record["trials"] == rows
    # the interleaved repeat table: round by round, every plan still in the running in the planner's order
    order = [(e["round"], e["plan"]) for e in record["repeats"]]
    assert order == [(1, 1), (1, 2), (1, 3)] + [(r, p) for r in range(2, ROUNDS + 1) for p in (2, 3)]
    assert record["repeats"][0]["measured_s"] is None
