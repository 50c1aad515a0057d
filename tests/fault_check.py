"""A training job with one fault planted on one rank, for tests/test_faults.py.

    python fault_check.py FAULT RANK STEP [axon4d train flags...]

FAULT is where rank RANK fails once the job reaches step STEP (counted from 1):
``forward`` (raises inside the model's forward), ``backward`` (raises inside the backward at that
step), ``save`` (raises inside the first checkpoint save, whatever STEP says), ``kill`` (SIGKILLs
itself in the forward), ``stop`` (SIGSTOPs itself in the forward: a hung rank), ``write-kill``
(SIGKILLs itself inside the write of the STEP-th checkpoint save, in the background under
--async-save), or ``none``. The fault is
planted from outside the library (patching, hooks, signals), then ``axon4d.train.main`` runs with
the remaining flags. Every rank prints ``FAULT-CHECK pid=<pid> rank=<rank>`` first. Under
``torchrun --max-restarts`` the fault is planted at the first launch only: the restarted job
runs clean (tests/test_restart.py).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from axon4d import checkpoint
from axon4d.grid.launch import restart_count
from axon4d.grid.launch_env import env_rank
from axon4d.models.transformer import Transformer
from axon4d.train import add_arguments, main


class PlantedError(RuntimeError):
    pass


def _rank() -> int:
    return env_rank() or 0


def plant(fault: str, rank: int, step: int) -> None:
    calls = {"forward": 0}
    forward = Transformer.forward

    def counting_forward(self, *args, **kwargs):
        calls["forward"] += 1  # one forward per step (one micro-batch)
        at_step = calls["forward"] == step
        if at_step and fault == "forward":
            raise PlantedError(f"planted forward failure at step {step}")
        if at_step and fault == "kill":
            print(f"FAULT-CHECK rank={rank} killed in the forward of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if at_step and fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        out = forward(self, *args, **kwargs)
        if at_step and fault == "backward":

            def fail(grad: torch.Tensor) -> torch.Tensor:
                raise PlantedError(f"planted backward failure at step {step}")

            out.register_hook(fail)
        return out

    Transformer.forward = counting_forward  # type: ignore[method-assign]
    if fault == "save":

        def failing_save(*args, **kwargs):
            raise PlantedError("planted failure inside the first checkpoint save")

        checkpoint.dcp.save = failing_save  # type: ignore[assignment]
    if fault == "write-kill":
        write = checkpoint.writer.Writer.write_data
        saves = {"n": 0}

        def killing_write(self, *args, **kwargs):
            saves["n"] += 1  # one write per save on each rank
            if saves["n"] == step:
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, *args, **kwargs)

        checkpoint.writer.Writer.write_data = killing_write  # type: ignore[method-assign]


if __name__ == "__main__":
    fault, rank, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(f"FAULT-CHECK pid={os.getpid()} rank={_rank()}", flush=True)
    if _rank() == rank and fault != "none" and restart_count() == 0:
        plant(fault, rank, step)
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args(sys.argv[4:])))
