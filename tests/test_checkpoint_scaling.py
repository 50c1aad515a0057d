"""Protects loads and saves whose cost follows a rank's own part, not the world (issue 52,
``axon4d.checkpoint.index``): for the 80B model on 4096 ranks (grid (1, 4, 4, 256), ZeRO-2, 2.4 M
chunks), simulated metadata-only by ``bench/checkpoint_scaling.py``, one rank's load — meta.json,
the piece index, its reads, the sizes of its files — takes < 2 s and < 200 MB, and rank 0's
coordination of a save < 5 s; on a small world the piece index plans exactly the reads DCP's
whole index gives; the merge on rank 0 sorts the chunks and refuses writes that overlap or leave a
gap (what DCP's global plan checked when it saw every item). Each runs the bench in a process of its own (a fake process group of the
world's size)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "checkpoint_scaling.py")


def _bench(tmp_path, *args):
    out = str(tmp_path / "scaling.json")
    run = subprocess.run([sys.executable, BENCH, "--out", out, *args], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.slow
def test_the_piece_index_plans_the_reads_of_the_whole_index(tmp_path):
    got = _bench(tmp_path, "--grid", "1,2,2,4", "--rounds", "1", "--check", "--rank", "5")
    assert got["checked_against_whole_index"] and got["load_reads"] >= got["load_pieces"] > 1000, got


@pytest.mark.slow
def test_a_4096_rank_load_and_save_of_the_80b_checkpoint_stay_small(tmp_path):
    got = _bench(tmp_path, "--rounds", "3")
    assert got["world"] == 4096 and got["chunks"] > 2_000_000, got
    assert got["load_s"] < 2 and got["load_peak_mb"] < 200, got
    assert got["save_coordination_s"] < 5, got


def _part(rows):
    """A rank's part of the piece index (``index.rank_records``' form): chunks (offset, size) of a
    1-D tensor "t" of 8 elements, and its shape if it holds the chunk at offset 0."""
    from axon4d.files.ckptindex import RECORD, key_hash

    r = np.zeros(len(rows), RECORD)
    r["key"], r["size"] = key_hash("t"), 1
    r["off"][:, 0], r["size"][:, 0] = [o for o, _ in rows], [n for _, n in rows]
    r["len"] = 4 * r["size"][:, 0]
    first = any(o == 0 for o, _ in rows)
    return {"records": r.tobytes(), "files": ["f"], "keys": {"t": {"shape": [8], "dtype": "float32"}} if first else {}}


def test_the_merge_sorts_the_chunks_and_refuses_writes_that_overlap_or_leave_a_gap():
    from axon4d.checkpoint import index

    merged = index.merge([_part([(4, 4)]), _part([(0, 4)])])
    assert merged.table["keys"]["t"] == {"shape": [8], "dtype": "float32", "start": 0, "count": 2, "hmax": 4}
    assert merged.records["off"][:, 0].tolist() == [0, 4] and merged.records["file"].tolist() == [1, 0]
    assert merged.table["files"] == ["f", "f"]
    for rows in ([(4, 2)], [(2, 6)]):  # a gap at 6..8; 2..4 written twice
        with pytest.raises(ValueError, match="overlap or leave a gap"):
            index.merge([_part([(0, 4)]), _part(rows)])
