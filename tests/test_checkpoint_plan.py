"""Protects the size of what a save's coordination moves (``axon4d.checkpoint.pieces.writes``,
``planners.SavePieces``): each piece the ranks hold alike is planned by one of them only, and a
step count by one rank of the world; and the items stay on the rank — DCP's gather of plans to the
coordinator carries an empty plan from each (the piece index, not DCP's plans, records them). Counted for one rank of the 80B job ``axon4d plan`` picks on 1024
Perlmutter GPUs — grid (1, 2, 32, 16), ZeRO-2 — built on the meta device in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
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
    assert got["sent_bytes"] < 1_000, got  # what DCP's gather to the coordinator carries


def _load_coordination(grid, path):
    """Save a small model, then count the object collectives (DCP's coordination: pickled plans,
    results, the index) that a load of it issues on this rank."""
    import torch
    import torch.distributed as dist

    from axon4d import checkpoint
    from axon4d.config import ModelConfig
    from axon4d.models.transformer import Transformer
    from axon4d.train.batches import accumulate

    cfg = ModelConfig(n_layers=2, hidden=32, n_heads=4, vocab_size=64, seq_len=8, arch="llama")
    torch.manual_seed(0)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    accumulate(model, [ids], grid)
    opt.step()  # the moments exist: the load reads them too
    checkpoint.save(path, model, grid, opt, step=1, overwrite=True)
    calls = []
    names = ("gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list")
    real = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, lambda *a, _n=n, **k: calls.append(_n) or real[_n](*a, **k))
    try:
        fresh = Transformer(cfg)
        checkpoint.load(path, fresh, grid, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    finally:
        for n in names:
            setattr(dist, n, real[n])
    same = all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))
    return calls, same


def test_a_load_plans_its_own_reads_and_coordinates_nothing(pools, tmp_path):
    for rank, (calls, same) in enumerate(pools(4).run((1, 2, 2, 1), _load_coordination, str(tmp_path / "c"))):
        assert same, f"rank {rank}: the loaded model differs from the saved one"
        assert calls == [], f"rank {rank}: the load coordinated through {calls}"
