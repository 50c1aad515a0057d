"""A ``--try`` job started by tests/test_trial_launch.py under ``mpiexec -n 8`` or as srun's tasks
(their environment alone): it joins the world through the training job alone.

``argv[1]`` is the output directory; each later argument is a transport (``--comm``: torch, mpi)
under which one ``axon4d train --grid auto --try 2`` runs, one after another in the same job, in
``OUT/<transport>``; each run after the first prices its plans with the correction the run before
it wrote (``--correction``). Every grid built (the trials' and the run's) is recorded with its
transport and launcher. Each rank writes ``OUT/<transport>.rank<r>.json``: the planner's top two
fitting plans by its own ranking and their prices, the rows the run reports, the grid it trained
on, its losses and the grids built.
"""

import dataclasses
import json
import os
import sys

import torch

from axon4d.grid import runtime
from axon4d.plan.job import plan_job
from axon4d.train import TrainConfig, planned, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST_MACHINE = os.path.join(ROOT, "bench", "results", "planner_machine_local.json")
TINY = dict(model="tiny", layers=2, hidden=64, heads=4, kv_heads=2, vocab_size=128, seq_len=16, progress=False)
TRIED = 2

built: list[dict] = []
_init = runtime.init


def _recording_init(*args, **kwargs):
    """``runtime.init``, recording the grid it built: its sizes, transport and launcher."""
    grid = _init(*args, **kwargs)
    built.append(
        {"grid": list(grid.shape.as_tuple()), "transport": grid.comm.transport_name, "launcher": grid.launcher}
    )
    return grid


def _uncorrected(cfg, fitting):
    """The candidates of ``fitting``'s grids as the machine alone prices them (without --correction)."""
    job = plan_job(dataclasses.replace(planned.request(cfg, False, top=8), correction="", rank=1))
    return [next(c for c in job.candidates if c.shape == f.shape) for f in fitting]


def main(out: str, transports: list[str]) -> None:
    torch.set_num_threads(1)
    runtime.init = _recording_init  # trial.py and loop.py call runtime.init through the module
    correction = ""
    for comm in transports:
        built.clear()
        cfg = TrainConfig(
            **TINY,
            grid="auto",
            try_plans=TRIED,
            try_steps=1,
            try_rounds=1,
            machine=HOST_MACHINE,
            steps=2,
            batch_size=8,
            comm=comm,
            out_dir=os.path.join(out, comm),
            correction=correction,
        )
        fitting = plan_job(
            dataclasses.replace(planned.request(cfg, False, top=TRIED), rank=1)
        ).fitting  # rank 1: prints nothing
        summary = train(cfg)
        correction = os.path.join(out, comm, "correction.json")
        rank = torch.distributed.get_rank()
        record = {
            "top": [list(c.shape.as_tuple()) for c in fitting],
            "prices": [float(c.time.step_s) for c in fitting],
            "uncorrected": [float(c.time.step_s) for c in _uncorrected(cfg, fitting)],
            "trials": summary["trials"],
            "grid": summary["grid"],
            "losses": summary["losses"],
        }
        with open(os.path.join(out, f"{comm}.rank{rank}.json"), "w") as f:
            json.dump({**record, "built": list(built)}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
