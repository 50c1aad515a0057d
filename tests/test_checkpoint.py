"""Protects checkpoints: a sharded save on one grid loads onto another grid (and onto one
process) with every weight and both AdamW moments (exp_avg, exp_avg_sq) intact — also when z
shards end mid-row and z and data sizes change — and exports as a plain state dict of the
single-process model."""

import pytest
import torch

import axon4d
from axon4d import checkpoint
from axon4d.config import ModelConfig
from axon4d.models.transformer import DenseTransformer, Transformer

pytestmark = pytest.mark.slow  # every test saves on 8 ranks

CFG = ModelConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama")
GPT_CFG = ModelConfig(n_layers=1, hidden=32, n_heads=4, vocab_size=64, seq_len=8, arch="gpt")


def _train_steps(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, model.cfg.vocab_size, (8, model.cfg.seq_len + 1), generator=gen)
        loss = model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:]))
        opt.zero_grad()
        loss.backward()
        opt.step()


def _dense_state(model):
    return {k: v.clone() for k, v in model.to_dense().state_dict().items()}


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's first and second moments


def _moment_dense(model, opt, moment):
    """One AdamW moment of every parameter as the dense model would hold it (assembled via to_dense)."""
    saved = {p: p.detach().clone() for p in model.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(opt.state[p][moment])
    dense = _dense_state(model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(saved[p])
    return dense


def _moments_dense(model, opt):
    """{moment: dense state dict} for both AdamW moments."""
    return {m: _moment_dense(model, opt, m) for m in MOMENTS}


def _save(grid, cfg, path):
    torch.manual_seed(1)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_steps(model, opt, 2, seed=5)
    checkpoint.save(path, model, grid, opt, step=2, extra={"note": "test"})
    return _dense_state(model), _moments_dense(model, opt)


def _load(grid, cfg, path):
    torch.manual_seed(99)  # different init: everything must come from the checkpoint
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    meta = checkpoint.load(path, model, grid, opt)
    return meta, _dense_state(model), _moments_dense(model, opt), float(opt.state[next(model.parameters())]["step"])


@pytest.mark.parametrize("cfg", [CFG, GPT_CFG], ids=["llama", "gpt"])
@pytest.mark.parametrize(
    "src,dst", [((2, 2, 2, 1), (2, 1, 2, 2)), ((1, 2, 2, 2), (2, 2, 2, 1)), ((2, 2, 2, 1), (1, 1, 1, 1))]
)
def test_checkpoint_loads_onto_another_grid(pools, tmp_path, cfg, src, dst):
    path = str(tmp_path / "ckpt")
    saved = pools(8).run(src, _save, cfg, path)
    weights, moments = saved[0]
    world = dst[0] * dst[1] * dst[2] * dst[3]
    for meta, w, m, step in pools(world).run(dst, _load, cfg, path):
        assert meta["step"] == 2 and meta["grid"] == list(src) and meta["note"] == "test"
        assert step == 2.0
        for k in weights:
            assert torch.equal(w[k], weights[k]), k
            for moment in MOMENTS:
                assert torch.equal(m[moment][k], moments[moment][k]), (moment, k)


# on a (1,2,4,1) grid: a gate|up block is 42 rows of 32 (ffn 42), so each z shard is 10.5 rows and
# ends mid-row; a q|k|v block is 16 + 4 + 4 rows (8 heads, 2 kv heads), so shards cross from q to k to v
ODD_CFG = ModelConfig(n_layers=1, hidden=32, n_heads=8, n_kv_heads=2, ffn_hidden=42, vocab_size=64, seq_len=8)


def test_shards_cut_mid_row_load_onto_another_z_and_data_size(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    weights, moments = pools(8).run((1, 2, 4, 1), _save, ODD_CFG, path)[0]
    for _, w, m, step in pools(8).run((2, 1, 2, 2), _load, ODD_CFG, path):  # z 4 -> 2, data 1 -> 2
        assert step == 2.0
        for k in weights:
            assert torch.equal(w[k], weights[k]), k
            for moment in MOMENTS:
                assert torch.equal(m[moment][k], moments[moment][k]), (moment, k)


def _export(grid, path, out):
    return checkpoint.export_dense(path, out)


def test_export_as_single_file_dense_state_dict(pools, tmp_path):
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "dense.pt")
    weights, _ = pools(8).run((2, 2, 2, 1), _save, CFG, path)[0]
    pools(1).run(None, _export, None, path, out)
    dense = DenseTransformer(CFG)
    dense.load_state_dict(torch.load(out))
    for k, v in dense.state_dict().items():
        assert torch.equal(v, weights[k]), k


def _resume_curve(grid, path, phase):
    torch.manual_seed(1)
    model = Transformer(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if phase == "straight":
        _train_steps(model, opt, 4, seed=5)
    elif phase == "first":
        _train_steps(model, opt, 2, seed=5)
        checkpoint.save(path, model, grid, opt, step=2)
        return None
    else:
        checkpoint.load(path, model, grid, opt)
        gen = torch.Generator().manual_seed(5)
        for _ in range(2):  # skip the batches the first run consumed
            torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1), generator=gen)
        for _ in range(2):
            ids = torch.randint(0, CFG.vocab_size, (8, CFG.seq_len + 1), generator=gen)
            loss = model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return _dense_state(model)


def test_resume_continues_exactly(pools, tmp_path):
    path = str(tmp_path / "ckpt")
    straight = pools(8).run((2, 2, 2, 1), _resume_curve, path, "straight")[0]
    pools(8).run((2, 2, 2, 1), _resume_curve, path, "first")
    resumed = pools(8).run((2, 2, 2, 1), _resume_curve, path, "second")[0]
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
