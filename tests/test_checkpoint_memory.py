"""Protects checkpoints that stream (issue 28): on a (1,1,4,1) grid a save and a load each hold at
most a quarter of the rank's parameters and AdamW state beyond what the rank holds before and after
(torch's MemTracker), where gathering every z-sharded block at once held about G_z times that."""

import warnings

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from axon4d import checkpoint
from axon4d.config import ModelConfig
from axon4d.models.transformer import Transformer

# four layers, so that no one tensor is a large share of a rank's state
CFG = ModelConfig(
    n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, ffn_hidden=256, vocab_size=256, seq_len=8, arch="llama"
)
BOUND = 0.25  # at most this share of the rank's parameters + optimizer state, beyond them


def _model(seed, step):
    """A model and AdamW; with ``step``, one step on a made-up gradient (so both moments exist)."""
    torch.manual_seed(seed)
    model = Transformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if step:
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _resident(model, opt):
    """Bytes of the rank's parameters and optimizer state."""
    state = [t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return sum(p.nbytes for p in model.parameters()) + sum(t.nbytes for t in state)


def _extra(grid, model, opt, work):
    """Peak bytes of torch tensors on this rank during ``work()`` beyond the larger of what was
    live before and after it (torch's MemTracker, following the model and optimizer as well)."""
    tracker = MemTracker()
    with warnings.catch_warnings():  # it warns of parameters without gradients
        warnings.simplefilter("ignore", UserWarning)
        tracker.track_external(model, opt)
        with tracker:
            before = tracker.get_tracker_snapshot("current")[grid.device]["Total"]
            work()
            after = tracker.get_tracker_snapshot("current")[grid.device]["Total"]
    return tracker.get_tracker_snapshot("peak")[grid.device]["Total"] - max(before, after)


def _save_and_load(grid, path):
    """(resident bytes, extra bytes of a save, of a load into a fresh model and optimizer, whether
    the load gave back this rank's parameters and moments)."""
    model, opt = _model(1, step=True)
    save = _extra(grid, model, opt, lambda: checkpoint.save(path, model, grid, opt, step=1))
    fresh, fresh_opt = _model(2, step=False)  # a resume: the optimizer makes its moments as it loads
    load = _extra(grid, fresh, fresh_opt, lambda: checkpoint.load(path, fresh, grid, fresh_opt))
    same = all(
        torch.equal(p, q)
        and all(torch.equal(opt.state[p][m], fresh_opt.state[q][m]) for m in ("exp_avg", "exp_avg_sq", "step"))
        for p, q in zip(model.parameters(), fresh.parameters())
    )
    return _resident(model, opt), save, load, same


def test_save_and_load_hold_a_small_share_of_the_state_beside_it(pools, tmp_path):
    for rank, (resident, save, load, same) in enumerate(
        pools(4).run((1, 1, 4, 1), _save_and_load, str(tmp_path / "ckpt"))
    ):
        assert same, rank
        assert save <= BOUND * resident, (rank, save / resident)
        assert load <= BOUND * resident, (rank, load / resident)
