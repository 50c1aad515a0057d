"""``axon4d train --grid auto --try N`` (axon4d.train.trial) on an 8-rank gloo world: the plans
tried are the planner's fastest fitting ones, each is built (with every step option its plan gives
it) and torn down without leaking process groups, threads or host memory (resident and peak), the run trains with the fastest measured on the loss curve of a run pinned
to it, a plan that fails is skipped with its reason, a resumed run does not try again; and the
correction file its measurements make (axon4d.plan.correction)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from axon4d.plan import correction
from axon4d.plan.job import plan_job, priced_machine
from axon4d.plan.machine import load
from axon4d.train import TrainConfig, loop, planned, train, trial
from axon4d.train.report import host_usage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_MACHINE = os.path.join(ROOT, "bench", "results", "planner_machine_local.json")
TINY = dict(model="tiny", layers=2, hidden=64, heads=4, kv_heads=2, vocab_size=128, seq_len=16, progress=False)
WORLD = 8


def _groups() -> int:
    """Process groups torch.distributed holds now (the default one included)."""
    return len(c10d._world.pg_map)


def _plan(cfg, top=3):
    """The planner's plan for ``cfg``'s run, its ``top`` fastest fitting plans wanted, as every rank
    asks for it (rank 1's request: nothing printed)."""
    return plan_job(dataclasses.replace(planned.request(cfg, False, top), rank=1))


def _tried_then_pinned(base):
    """A --try 3 run, the planner's top 3 by its own ranking, and a run pinned to the chosen plan."""
    cfg = TrainConfig(**base)
    job = _plan(cfg)
    top = [list(c.shape.as_tuple()) for c in job.fitting]
    tried = train(cfg)
    chosen = next(r for r in tried["trials"] if r["chosen"])
    best = next(c for c in job.candidates if list(c.shape.as_tuple()) == chosen["grid"])
    pinned_cfg = planned.apply(dataclasses.replace(cfg, out_dir=cfg.out_dir + "-pinned"), job, best)
    pinned = train(pinned_cfg)  # a named grid with the chosen options: nothing planned
    return tried, top, pinned


@pytest.mark.slow
def test_the_top_plans_are_tried_and_the_fastest_trains_as_a_run_pinned_to_it(pools, tmp_path):
    base = dict(
        grid="auto",
        try_plans=3,
        try_steps=1,
        try_rounds=1,
        machine=HOST_MACHINE,
        steps=3,
        batch_size=8,
        out_dir=str(tmp_path / "a"),
    )
    tried, top, pinned = pools(WORLD).run(None, _tried_then_pinned, {**base, **TINY}, timeout=300)[0]
    rows = tried["trials"]
    assert [r["grid"] for r in rows] == top  # the planner's three fastest fitting plans, in its order
    assert all(r["measured_s"] > 0 and r["measured_peak_bytes"] > 0 and r["error"] is None for r in rows)
    chosen = [r for r in rows if r["chosen"]]
    assert len(chosen) == 1 and chosen[0]["measured_s"] == min(r["measured_s"] for r in rows)
    assert tried["grid"] == pinned["grid"] and tried["grid"].endswith(f"data={chosen[0]['grid'][3]})")
    assert tried["losses"] == pinned["losses"] and len(tried["losses"]) == 3  # the trial trained nothing kept
    on_disk = json.load(open(tmp_path / "a" / trial.TRIALS_FILE))["trials"]
    assert [r["grid"] for r in on_disk] == top
    corr = correction.load(str(tmp_path / "a" / trial.CORRECTION_FILE))
    assert corr.world == WORLD and len(corr.trials) == 3


def _resumed(base):
    first = train(TrainConfig(**base))
    again = train(TrainConfig(**{**base, "steps": 3, "resume": "auto"}))
    return first, again


@pytest.mark.slow
def test_a_resumed_run_takes_the_plan_tried_before(pools, tmp_path):
    base = dict(grid="auto", try_plans=2, try_steps=1, try_rounds=1, machine=HOST_MACHINE, steps=2, batch_size=8)
    first, again = pools(WORLD).run(None, _resumed, {**base, **TINY, "out_dir": str(tmp_path / "r")}, timeout=300)[0]
    assert again["grid"] == first["grid"] and len(again["losses"]) == 1
    assert all(r.get("recorded") for r in again["trials"])  # read from trials.json, not measured again
    assert [r["measured_s"] for r in again["trials"]] == [r["measured_s"] for r in first["trials"]]


def _one_fails(base, failing_rank):
    """A --try 3 run whose second plan cannot be built on ``failing_rank`` alone."""
    cfg = TrainConfig(**base)
    doomed = _plan(cfg).fitting[1].shape
    build = loop._model

    def failing(run_cfg, mcfg, grid):
        if grid.shape == doomed and grid.rank == failing_rank:
            raise torch.OutOfMemoryError("planted: no room for this plan")
        return build(run_cfg, mcfg, grid)

    loop._model = failing
    try:
        return train(cfg), list(doomed.as_tuple())
    finally:
        loop._model = build


@pytest.mark.slow
def test_a_plan_that_fails_on_one_rank_is_skipped_with_its_reason_on_every_rank(pools, tmp_path):
    base = dict(grid="auto", try_plans=3, try_steps=1, try_rounds=1, machine=HOST_MACHINE, steps=1, batch_size=8)
    results = pools(WORLD).run(None, _one_fails, {**base, **TINY, "out_dir": str(tmp_path / "f")}, 3, timeout=300)
    for summary, doomed in results:  # every rank reached the same verdict and trained
        rows = {tuple(r["grid"]): r for r in summary["trials"]}
        skipped = rows[tuple(doomed)]
        assert skipped["measured_s"] is None and not skipped["chosen"]
        assert skipped["error"] == "rank 3: OutOfMemoryError: planted: no room for this plan"
        assert sum(r["chosen"] for r in summary["trials"]) == 1 and len(summary["losses"]) == 1


def _every_option(base, machine):
    """A --try 3 run whose options are pinned (the planner prices every grid with them; ``machine``
    knows a bf16 peak), each trial's build recorded: the plan's grid, the run's micro-batches, the
    model's recomputation, offloaded blocks and split sequences, the grid's gathers, the
    optimizer's ZeRO stage, and whether the previous trial's model and optimizer were freed."""
    import gc
    import weakref

    from axon4d.options.precision import FP8

    cfg = TrainConfig(**{**base, "machine": machine})
    top = [(list(c.shape.as_tuple()), c.options) for c in _plan(cfg).fitting]
    make = trial._trial
    seen, refs = [], []

    def recording(run_cfg, grid, build, step):
        gc.collect()
        freed = all(r() is None for r in refs)
        made = make(run_cfg, grid, build, step)
        m, opt = made.model, made.optimizer
        refs.extend([weakref.ref(m), weakref.ref(opt)])
        seen.append(
            {
                "grid": list(grid.shape.as_tuple()),
                "micro_batches": run_cfg.micro_batches,
                "recompute": m.recompute.value,
                "offload": len(m.offload),
                "context_parallel": m.context_parallel,
                "fp8_gather": grid.precision.gather == FP8,
                "zero": getattr(opt, "stage", 0),
                "freed_before": freed,
            }
        )
        return made

    groups = _groups()
    trial._trial = recording
    try:
        summary = train(cfg)
    finally:
        trial._trial = make
    gc.collect()
    return top, seen, summary, groups, _groups(), all(r() is None for r in refs)


@pytest.mark.slow
def test_tried_plans_are_built_with_every_option_the_planner_gives_them(pools, tmp_path):
    machine = json.load(open(HOST_MACHINE))  # the host's, with a bf16 peak: FP8 gathers compute in bf16
    machine["peak_flops"]["bfloat16"] = machine["peak_flops"]["float32"]
    (tmp_path / "bf16.json").write_text(json.dumps(machine))
    # a step of 2 micro-batches of 2 sequences split over data ≤ 2: grids with z = 2 lead, where
    # FP8 gathers and split sequences take effect
    options = dict(recompute="full", micro_batches=2, zero=2, offload="0", context_parallel=True)
    base = dict(
        grid="auto",
        try_plans=3,
        try_steps=1,
        try_rounds=1,
        steps=2,
        batch_size=2,
        precision="bf16-fp8-gather",
        pin="context_parallel_axes",  # sequences over z (the default), where FP8 gathers take effect too
        **options,
    )
    args = ({**base, **TINY, "out_dir": str(tmp_path / "o")}, str(tmp_path / "bf16.json"))
    for top, seen, summary, before, after, freed in pools(WORLD).run(None, _every_option, *args, timeout=400):
        assert [r["grid"] for r in summary["trials"]] == [g for g, _ in top] == [s["grid"] for s in seen]
        assert all(r["measured_s"] > 0 and r["error"] is None for r in summary["trials"]), summary["trials"]
        for (grid, opts), built in zip(top, seen):  # each trial built as its plan says
            assert opts == {"recompute": "full", "micro_batches": 2, "zero": 2, "offload": 1, "fp8_gather": grid[2] > 1}
            want = {"recompute": "full", "micro_batches": 2, "offload": 1, "context_parallel": True, "zero": 2}
            assert {k: built[k] for k in want} == want and built["fp8_gather"]  # the run's precision gathers in FP8
        assert any(opts["fp8_gather"] for _, opts in top) and any(g[2] > 1 and g[3] > 1 for g, _ in top)
        assert all(s["freed_before"] for s in seen) and freed  # each trial's model and optimizer collected
        assert after == before and len(summary["losses"]) == 2  # no process group left; the chosen plan trained


def _peak_rss(reset: bool = False) -> int:
    """This process's peak resident bytes since the last reset (``VmHWM``); ``reset``: start the
    peak again from the resident bytes now (Linux's ``clear_refs``)."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _leaks(base):
    """Process groups, then (resident bytes, peak resident bytes, threads) after one trial of a
    plan and after four more; the peak counted from before the first trial."""
    cfg = TrainConfig(**base)
    job = _plan(cfg)
    groups = _groups()
    args = (lambda c: "fp32", loop._model, loop._step)
    _peak_rss(reset=True)  # this rank's earlier work (other tests) out of the peak
    trial._try_all(cfg, job, [job.best], *args)
    one = (*host_usage(), _peak_rss())
    trial._try_all(cfg, job, [job.best] * 4, *args)
    return groups, _groups(), one, (*host_usage(), _peak_rss())


@pytest.mark.slow
def test_trials_leak_neither_process_groups_nor_host_memory(pools, tmp_path):
    base = dict(grid="auto", try_plans=1, try_steps=1, try_rounds=1, machine=HOST_MACHINE, steps=1, batch_size=8)
    for before, after, one, five in pools(WORLD).run(None, _leaks, {**base, **TINY, "out_dir": str(tmp_path)}):
        (rss_one, threads_one, peak_one), (rss_five, threads_five, peak_five) = one, five
        assert after == before
        assert rss_five <= 1.05 * rss_one, (rss_one, rss_five)
        assert peak_five <= 1.05 * peak_one, (peak_one, peak_five)  # five trials peak as high as one
        assert threads_five <= threads_one, (threads_one, threads_five)  # each grid's threads end with it


def test_the_correction_recovers_compute_and_communication_factors():
    rows = [
        {"predicted_compute_s": c, "predicted_comm_s": m, "measured_s": 1.5 * c + 0.5 * m}
        for c, m in [(1.0, 1.0), (2.0, 0.5), (0.5, 3.0)]
    ]
    fitted = correction.fit("host", 8, rows)
    assert fitted.compute == pytest.approx(1.5) and fitted.communication == pytest.approx(0.5)
    one = correction.fit("host", 8, rows[:1])  # one plan cannot tell the two apart: one factor
    assert one.compute == one.communication == pytest.approx(1.0)
    machine = load(HOST_MACHINE)
    k = machine.step_scale_for(8)
    corrected = correction.apply(machine, fitted).step_scale_for(8)
    assert corrected == pytest.approx((1.5 * k[0], 0.5 * k[1], 0.5 * k[2], 0.5 * k[3]))
    assert machine.step_scale_for(8) == k  # the machine itself is unchanged


def test_a_correction_file_is_refused_when_it_is_not_one(tmp_path):
    path = tmp_path / "c.json"
    correction.write(
        str(path), correction.fit("host", 8, [{"predicted_compute_s": 1, "predicted_comm_s": 1, "measured_s": 3}])
    )
    assert correction.load(str(path)).compute == pytest.approx(1.5)
    with pytest.raises(ValueError, match="is not a correction"):
        correction.load(HOST_MACHINE)
    path.write_text(json.dumps({"kind": correction.KIND, "world": 8, "compute": -1, "communication": 1}))
    with pytest.raises(ValueError, match="compute = -1 must be a positive finite number"):
        correction.load(str(path))


def test_try_and_correction_need_grid_auto():
    with pytest.raises(ValueError, match="--try 3 with --grid 1,1,1,-1: only --grid auto has plans to try"):
        TrainConfig(try_plans=3)
    with pytest.raises(ValueError, match="--correction c.json with --grid 2,2,2,1: only --grid auto has plans to"):
        TrainConfig(grid="2,2,2,1", correction="c.json")


def test_the_training_job_prices_its_plans_with_a_correction_file(tmp_path):
    path = str(tmp_path / "c.json")
    correction.write(path, correction.Correction("local", WORLD, 2.0, 2.0))
    cfg = TrainConfig(**TINY, grid="auto", machine=HOST_MACHINE, batch_size=8, correction=path)
    ask = dataclasses.replace(planned.request(cfg, False), world=WORLD, rank=1)  # as each of 8 ranks asks
    assert (ask.machine, ask.correction) == (HOST_MACHINE, path)
    machine = priced_machine(ask)  # the machine's in-step scale for 8 ranks, doubled
    assert machine.step_scale_for(WORLD) == pytest.approx([2 * k for k in load(HOST_MACHINE).step_scale_for(WORLD)])
    alone, corrected = (plan_job(dataclasses.replace(ask, correction=c)) for c in ("", path))
    pairs = list(zip(alone.candidates[:3], corrected.candidates[:3]))
    assert all(a.shape == c.shape and c.time.step_s == pytest.approx(2 * a.time.step_s) for a, c in pairs)
    assert corrected.machine_name == alone.machine_name == load(HOST_MACHINE).name  # what correction.json scales
    with pytest.raises(
        ValueError, match="measured on 8 ranks, this job has 16: its factors scale the prices of 8-rank"
    ):
        plan_job(dataclasses.replace(ask, world=16))
    assert planned.apply(cfg, corrected).correction == ""  # a named grid: nothing left to price


def test_a_correction_fitted_to_corrected_prices_is_composed_onto_the_machine_s_own():
    base = [(1.0, 1.0), (2.0, 0.5), (0.5, 3.0)]
    prior = correction.Correction("host", 8, 2.0, 4.0)
    rows = [  # priced with the prior's factors, measured as 1.5 compute + 0.5 communication of the machine's own
        {"predicted_compute_s": 2.0 * c, "predicted_comm_s": 4.0 * m, "measured_s": 1.5 * c + 0.5 * m} for c, m in base
    ]
    composed = correction.compose(correction.fit("host", 8, rows), prior)
    assert (composed.compute, composed.communication) == pytest.approx((1.5, 0.5))
