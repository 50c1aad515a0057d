"""Protects loads and saves whose cost follows a rank's own part, not the world (issue 52,
``axon4d.checkpoint.index``): for the 80B model on 4096 ranks (grid (1, 4, 4, 256), ZeRO-2, 2.4 M
chunks), simulated metadata-only by ``bench/checkpoint_scaling.py``, one rank's load — meta.json,
the piece index, its reads, the sizes of its files — takes < 2 s and < 200 MB, and rank 0's
coordination of a save < 5 s; on a small world the piece index plans exactly the reads DCP's
whole index gives. Each runs the bench in a process of its own (a fake process group of the
world's size)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "checkpoint_scaling.py")


def _bench(tmp_path, *args):
    out = str(tmp_path / "scaling.json")
    run = subprocess.run([sys.executable, BENCH, "--out", out, *args], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def test_the_piece_index_plans_the_reads_of_the_whole_index(tmp_path):
    got = _bench(tmp_path, "--grid", "1,2,2,4", "--rounds", "1", "--check", "--rank", "5")
    assert got["checked_against_whole_index"] and got["load_reads"] >= got["load_pieces"] > 1000, got


@pytest.mark.slow
def test_a_4096_rank_load_and_save_of_the_80b_checkpoint_stay_small(tmp_path):
    got = _bench(tmp_path, "--rounds", "3")
    assert got["world"] == 4096 and got["chunks"] > 2_000_000, got
    assert got["load_s"] < 2 and got["load_peak_mb"] < 200, got
    assert got["save_coordination_s"] < 5, got
