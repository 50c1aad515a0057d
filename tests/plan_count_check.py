"""Counts one rank's DCP save plan for a model on the meta device, as one rank of a large fake grid
(tests/test_checkpoint_plan.py).

Usage: python plan_count_check.py SIZE x,y,z,data ZERO RANK — prints JSON: the plan's items and
their pickled bytes, those of a plan of every piece and step count the rank holds (what each rank
planned when DCP alone removed the duplicates), and the pickled bytes DCP's gather to the
coordinator now carries (``sent_bytes``: the items stay on the rank, ``SavePieces``).
"""

import dataclasses
import json
import pickle
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

size, grid_arg, zero, rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
grid_shape = tuple(int(s) for s in grid_arg.split(","))
world = grid_shape[0] * grid_shape[1] * grid_shape[2] * grid_shape[3]
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

import axon4d  # noqa: E402
from axon4d.checkpoint.pieces import rank_state  # noqa: E402
from axon4d.checkpoint.planners import SavePieces  # noqa: E402
from axon4d.models import get_config  # noqa: E402
from axon4d.models.transformer import Transformer  # noqa: E402
from axon4d.zero import shard_optimizer  # noqa: E402

grid = axon4d.init(grid=grid_shape, precision="bf16-fp32-reduce", overlap=False)
model = Transformer(get_config(size), device="meta")
opt = torch.optim.AdamW(model.parameters())
if zero:
    opt = shard_optimizer(opt, model, grid, stage=zero)
for group in opt.param_groups:  # both moments and a step count, as after a step (on meta: no storage)
    for p in group["params"]:
        opt.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": torch.tensor(1.0)}


def count(load: bool) -> tuple[int, int, int]:
    state = rank_state(model, opt, grid, load=load)
    planner = SavePieces(state.parts)
    planner.set_up_planner(state.steps, None, False)
    sent = planner.create_local_plan()
    plan = dataclasses.replace(sent, items=planner.items)
    return len(plan.items), len(pickle.dumps(plan)), len(pickle.dumps(sent))


(items, nbytes, sent), (all_items, all_bytes, _) = count(load=False), count(load=True)
print(json.dumps({"items": items, "bytes": nbytes, "all_items": all_items, "all_bytes": all_bytes, "sent_bytes": sent}))
