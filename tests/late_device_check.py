"""A training job on a stand-in accelerator whose steps complete late, for tests/test_faults.py.

    python late_device_check.py DEVICE_S STOP_RANK STOP_STEP [axon4d train flags...]

On an accelerator the host queues a whole step, then blocks in the step's host read (its loss and
gradient norm, ``axon4d.train.loop.STEP_READ``) until the device has run it. Here every rank's read
takes DEVICE_S seconds (the device running the step), then waits for every other rank's (a barrier
over the world: a step's collectives complete once every rank's device reaches them). Rank
STOP_RANK SIGSTOPs itself halfway through the read of step STOP_STEP (counted from 1; 0: never): a
rank stopped mid-step. Every rank prints ``LATE-CHECK pid=<pid> rank=<rank>`` first, and the
stopping rank ``LATE-CHECK stopping`` before it stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from axon4d.grid.launch_env import env_rank
from axon4d.train import add_arguments, loop, main


def plant(device_s: float, stop_rank: int, stop_step: int) -> None:
    """Make every step's host read last ``device_s`` and end in a barrier; stop ``stop_rank`` in step ``stop_step``'s."""
    read, rank = loop._read_step, env_rank() or 0
    steps = {"n": 0}

    def late_read(loss_sum, norm, grid):
        steps["n"] += 1
        tolist = torch.Tensor.tolist

        def device_step(values):
            time.sleep(device_s / 2)
            if rank == stop_rank and steps["n"] == stop_step:
                print(f"LATE-CHECK stopping in the read of step {stop_step}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(device_s / 2)
            dist.barrier()
            return tolist(values)

        torch.Tensor.tolist = device_step  # type: ignore[method-assign]
        try:
            return read(loss_sum, norm, grid)
        finally:
            torch.Tensor.tolist = tolist  # type: ignore[method-assign]

    loop._read_step = late_read  # type: ignore[assignment]


if __name__ == "__main__":
    device_s, stop_rank, stop_step = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    print(f"LATE-CHECK pid={os.getpid()} rank={env_rank() or 0}", flush=True)
    plant(device_s, stop_rank, stop_step)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args(sys.argv[4:])))
