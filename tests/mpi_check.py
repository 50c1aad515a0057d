"""Runs the gloo backend's own correctness tests on the MPI transport, under ``mpiexec -n 8``.

Started by tests/test_mpi.py. Every rank joins one torch world (for group bookkeeping) and builds
each grid with ``axon4d.init(..., comm="mpi")``, so every collective goes through mpi4py. The
tests of test_comm.py, test_linear.py, test_overlap.py, test_moe.py and test_moe_layouts.py are called with ``MPIPools`` in place of
the gloo ``pools`` fixture: ``run`` calls the function on every MPI rank and gathers the results
on all of them, so each rank evaluates the same assertions. Rank 0 prints one line per test:
``MPICHECK <name> ok`` or ``MPICHECK <name> FAIL <first line of the error>``.
"""

import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_comm
import test_linear
import test_moe
import test_moe_layouts
import test_overlap
import torch
from mpi4py import MPI

import axon4d
from axon4d.grid import launch


class Skip(Exception):
    """The test needs a world of another size than this mpiexec job."""


class MPIPools:
    """Stands in for the ``pools`` fixture: runs a function on every rank of this MPI job."""

    def __call__(self, world):
        if world != MPI.COMM_WORLD.Get_size():
            raise Skip(f"needs {world} ranks")
        return self

    def run(self, grid, fn, *args, timeout=None, **init_kwargs):
        g = axon4d.init(grid=grid, comm="mpi", **init_kwargs)
        try:
            assert g.comm.transport_name == "mpi"
            choice = g.comm.transport_choice
            assert (choice.why, choice.seconds) == ("comm='mpi'", None)  # given: no probe
            result = fn(g, *args)
        finally:
            axon4d.shutdown()
        return MPI.COMM_WORLD.allgather(result)


def _name(grid):
    return "(" + "x".join(str(s) for s in grid) + ")"  # no spaces: names are the second word of a line


TESTS = [
    ("comm.collectives", test_comm.test_collectives_return_correct_data_and_are_logged, {}),
    (
        "comm.all_to_all",
        test_comm.test_all_to_all_moves_each_rows_split_to_its_rank_and_logs_the_bytes_sent,
        {"world": 8, "grid": (1, 2, 2, 2)},
    ),
    *[
        (
            f"comm.bytes{_name(g)}.{d}",
            test_comm.test_linear_moves_exactly_the_bytes_of_e8_to_e13,
            {"grid": g, "dtype_name": d},
        )
        for g in [(2, 2, 2, 1), (1, 2, 2, 2), (1, 1, 8, 1)]
        for d in ["float32", "bfloat16"]
    ],
    ("linear.fp32_every_grid_of_8", test_linear.test_every_grid_matches_torch_linear_fp32, {"world": 8}),
    ("linear.bf16", test_linear.test_bf16_matches_within_documented_tolerance, {"grid": (2, 2, 2, 1)}),
    *[
        (
            f"moe.layer{_name(g)}.{case}",
            test_moe.test_moe_layer_on_grids_equals_the_dense_layer,
            {"world": 8, "grid": g, "case": case},
        )
        for g in [(1, 2, 2, 2)]
        for case in ("top2-shared-softmax", "top2-starved")
    ],
    (
        "moe.chunked(2x2x1x2)",
        test_moe.test_moe_layer_dispatched_in_overlapped_chunks_equals_the_dense_layer,
        {"world": 8, "grid": (2, 2, 1, 2), "case": "top2-shared-softmax"},
    ),
    *[  # expert layouts whose groups are products of axes: MPI splits of the world (Grid.open_axis)
        (
            f"moe.layout.{kind}",
            test_moe_layouts.test_the_moe_layer_under_each_expert_layout_equals_the_dense_layer,
            {"kind": kind},
        )
        for kind in ("whole-over-world", "split-y-ep-x-z", "ep-z-replicas-data")
    ],
    ("linear.padded", test_linear.test_weight_blocks_that_do_not_split_over_z_are_padded, {"grid": (1, 1, 4, 2)}),
    *[
        (
            f"overlap.equivalence{_name(g)}",
            test_overlap.test_every_mechanism_alone_and_all_together_give_the_gradients_of_overlap_off,
            {"grid": g},
        )
        for g in [(2, 2, 2, 1), (2, 1, 2, 2)]
    ],
    ("overlap.prefetch", test_overlap.test_oag_prefetches_the_next_layers_weight_from_the_second_step_on, {}),
]


def main():
    torch.set_num_threads(1)
    info = launch.detect()
    launch.start_world(info, "gloo")  # one torch world for all grids; collectives go through MPI
    pools = MPIPools()
    only = sys.argv[1:]
    for name, test, kwargs in TESTS:
        if only and not any(name.startswith(o) for o in only):
            continue
        try:
            test(pools, **kwargs)
            line = f"MPICHECK {name} ok"
        except Skip as e:
            line = f"MPICHECK {name} skip {e}"
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            line = f"MPICHECK {name} FAIL {type(e).__name__}: {first}"
            if info.rank == 0:
                traceback.print_exc()
        if info.rank == 0:
            print(line, flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
