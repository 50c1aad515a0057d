"""Protects the size of what a save's coordination moves (``axon4d.checkpoint.pieces.writes``,
``planners.SavePieces``): DCP pickles every rank's plan to the coordinator, one item per piece
written, so each piece the ranks hold alike is planned by one of them only, and a step count by
one rank of the world. Counted for one rank of the 80B job ``axon4d plan`` picks on 1024
Perlmutter GPUs — grid (1, 2, 32, 16), ZeRO-2 — built on the meta device in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("rank", [7])
def test_a_rank_of_the_80b_job_plans_few_items(rank):
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "plan_count_check.py"), "80B", "1,2,32,16", "2", str(rank)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # every piece and step count it holds: 1611 pieces of 42 blocks' tensors and 509 step counts
    assert got["all_items"] == 2120
    # its own: the fp32 masters and both moments of its ZeRO part of the 4 Linear weights of each
    # block (one rectangle each here: 12 × 42 = 504), and a share of the tensors held alike
    assert 504 <= got["items"] <= 540, got
    assert got["bytes"] <= 90_000 and got["bytes"] * 4 < got["all_bytes"], got
