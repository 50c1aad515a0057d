"""``axon4d train --grid auto`` runs the planner's whole plan (axon4d.train.planned: the run's ends of
the one seam axon4d.plan.job, a request in and a plan out): the grid and the overlap knobs it
priced, and the step options it chose — those left at their defaults — while options given on the
command line, or named by ``--pin``, stay as given."""

from __future__ import annotations

import dataclasses
import os
import types

import pytest

from axon4d.grid.shape import GridShape
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan.job import JobPlan
from axon4d.plan.options import AUTO_OPTION
from axon4d.train import TrainConfig, planned, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: a machine file measured on a CPU host (no accelerator): the planner's choice there is a host's
HOST_MACHINE = os.path.join(ROOT, "bench", "results", "planner_machine_local.json")
TINY = dict(model="tiny", layers=2, hidden=64, heads=4, kv_heads=2, vocab_size=128, seq_len=16, progress=False)


def test_options_left_at_their_defaults_are_the_planner_s():
    cfg = TrainConfig(grid="auto")
    asked = planned.question(cfg, accelerator=True)
    assert asked == {name: AUTO_OPTION for name in planned.PLANNED}
    # on the host the run computes in fp32: no FP8 gathers to choose
    assert planned.question(cfg, accelerator=False)["fp8_gather"] is False
    # a flag given another value pins it; --pin pins one at its default
    cfg = TrainConfig(grid="auto", recompute="full", micro_batches=2, offload="0,1", pin="zero,context-parallel")
    asked = planned.question(cfg, accelerator=True)
    assert asked["recompute"] == "full" and asked["micro_batches"] == 2 and asked["offload"] == 2
    assert asked["zero"] == 0 and asked["context_parallel"] is False and asked["fp8_gather"] == AUTO_OPTION
    assert planned.question(TrainConfig(precision="bf16"), accelerator=True)["fp8_gather"] is False
    with pytest.raises(ValueError, match="--pin 'zero,speed': speed is not a planned option; name some of recompute"):
        TrainConfig(pin="zero,speed")


def test_the_run_asks_one_request_and_applies_the_plan_that_comes_back():
    """The run's request is plain data built from its config (the step's batch, the precision it
    computes in, each option free or pinned, the machine, the correction), and the planner's answer
    (a stand-in here) becomes the run's config: the grid, recomputation, k micro-batches of batch/k
    sequences, ZeRO, the first n blocks offloaded, the sequences split, FP8 gathers as the precision."""
    options = {"recompute": "balanced", "micro_batches": 4, "zero": 1, "offload": 2, "fp8_gather": True}
    best = types.SimpleNamespace(
        shape=GridShape(1, 2, 2, 2),
        overlap=OverlapPolicy(),
        options=options,
        context_parallel=True,
        context_mode="ring",
        context_axes="z,data",
        recompute="balanced",
        option=options.__getitem__,
        expert_layout="",  # a dense model's
    )
    answer = types.SimpleNamespace(best=best)  # the search's result, as JobPlan reads it
    cfg = TrainConfig(grid="auto", batch_size=32, machine="h100", correction="c.json", **TINY)
    asked = planned.request(cfg, accelerator=True)
    assert (asked.batch, asked.micro_batches, asked.precision) == (32, AUTO_OPTION, "bf16-fp32-reduce")
    assert (asked.machine, asked.correction, asked.top, asked.model) == ("h100", "c.json", 3, cfg.model_config())
    run = planned.apply(cfg, JobPlan(asked, answer))
    assert (run.grid, run.recompute, run.micro_batches, run.batch_size) == ("1,2,2,2", "balanced", 4, 8)
    assert (run.zero, run.offload, run.context_parallel, run.precision) == (1, "0,1", True, "bf16-fp8-gather")
    assert run.context_parallel_mode == "ring"  # the keys and values passed as the plan priced them
    assert run.context_parallel_axes == "z,data"  # over the axes the plan priced
    assert (run.try_plans, run.correction) == (0, "")  # a named grid: nothing left to try nor to price
    # pinned micro-batches keep the batch per micro-batch as given
    pinned = dataclasses.replace(cfg, micro_batches=2, precision="fp32")
    asked = planned.request(pinned, accelerator=True)
    assert asked.micro_batches == 2 and asked.batch == 64 and asked.precision == "fp32"
    run = planned.apply(pinned, JobPlan(asked, answer))
    assert (run.micro_batches, run.batch_size, run.precision) == (2, 32, "fp32")


def _auto_job(cfg_dict):
    from axon4d.plan.auto import choose

    cfg = TrainConfig(**cfg_dict)
    expected = choose(
        4,
        model=cfg.model_config(),
        batch=cfg.batch_size,
        machine=cfg.machine,
        dtype="float32",
        overlap="auto",
        rank=1,
        recompute=AUTO_OPTION,
        micro_batches=AUTO_OPTION,
        zero=AUTO_OPTION,
        offload=AUTO_OPTION,
        context_parallel=AUTO_OPTION,
        fp8_gather=False,
    )
    summary = train(cfg)
    return summary, expected.shape.as_tuple(), expected.options, expected.context_parallel


@pytest.mark.slow
def test_train_grid_auto_builds_and_runs_the_planner_s_plan(pools, tmp_path):
    base = dict(grid="auto", machine=HOST_MACHINE, steps=2, batch_size=8, out_dir=str(tmp_path / "run"), **TINY)
    summary, shape, options, split = pools(4).run(None, _auto_job, base)[0]
    assert summary["grid"] == str(GridShape(*shape)) and summary["recompute"] == options["recompute"]
    assert summary["zero"] == options["zero"] and len(summary["losses"]) == 2
    # a pinned option is kept: full recomputation asked for, full recomputation run
    summary, _, options, _ = pools(4).run(
        None, _auto_job, {**base, "recompute": "full", "out_dir": str(tmp_path / "b")}
    )[0]
    assert summary["recompute"] == "full"
