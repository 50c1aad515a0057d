"""Protects the transformer building blocks (attention with GQA and rotary, GELU and SwiGLU MLPs,
LayerNorm/RMSNorm on sharded features, vocabulary-parallel embedding and cross-entropy, whole GPT
and Llama models): each must equal its single-process PyTorch counterpart in forward output and
in every gradient on grids of 1, 2, 4 and 8 ranks."""

import pytest
import torch
import torch.nn.functional as F
from harness import value_errors
from torch import nn

import axon4d
from axon4d.config import ModelConfig
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.nn.attention import Attention, DenseAttention
from axon4d.nn.block import DenseBlock, TransformerBlock
from axon4d.nn.embedding import VocabParallelEmbedding
from axon4d.nn.loss import vocab_parallel_cross_entropy
from axon4d.nn.mlp import MLP, DenseMLP
from axon4d.nn.norm import LayerNorm, RMSNorm

TOL = 2e-5
FLOOR = 1e-3  # some gradients are exactly zero in theory (a key bias cannot change a softmax)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the reference's scale (floored, for gradients that vanish)."""
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(FLOOR))


GPT = ModelConfig(n_layers=2, hidden=32, n_heads=4, vocab_size=64, seq_len=8, arch="gpt")
LLAMA = ModelConfig(
    n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=8, arch="llama"
)


def _grad_errors(dense_ref: nn.Module, dense_got: nn.Module) -> dict:
    got = dict(dense_got.named_parameters())
    errs = {}
    for name, p in dense_ref.named_parameters():
        errs[f"{name}"] = rel_err(got[name].detach(), p.detach())
        errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
    return errs


def _make_pair(kind, cfg):
    """(dense reference, parallel module) with the same weights."""
    bias = cfg.arch == "gpt"
    rope = cfg.rope_theta if cfg.arch == "llama" else None
    if kind == "attention":
        dense = DenseAttention(cfg.hidden, cfg.n_heads, cfg.kv_heads, bias, rope)
        return dense, Attention(cfg.hidden, cfg.n_heads, cfg.kv_heads, bias=bias, rope_theta=rope).load_dense_(dense)
    if kind == "mlp":
        dense = DenseMLP(cfg.hidden, cfg.ffn, cfg.gated, bias)
        return dense, MLP(cfg.hidden, cfg.ffn, gated=cfg.gated, bias=bias).load_dense_(dense)
    if kind == "layernorm":
        dense = nn.LayerNorm(cfg.hidden)
        with torch.no_grad():
            dense.weight.uniform_(0.5, 1.5), dense.bias.uniform_(-0.5, 0.5)
        return dense, LayerNorm(cfg.hidden).load_dense_(dense)
    if kind == "rmsnorm":
        dense = nn.RMSNorm(cfg.hidden, eps=1e-6)
        with torch.no_grad():
            dense.weight.uniform_(0.5, 1.5)
        return dense, RMSNorm(cfg.hidden).load_dense_(dense)
    if kind == "block":
        dense = DenseBlock(cfg)
        return dense, TransformerBlock(cfg).load_dense_(dense)
    raise ValueError(kind)


def _check_activation_module(grid, kind, cfg):
    """Modules mapping the residual layout (b, s, hidden/G_x) to itself."""
    torch.manual_seed(11)
    dense, mod = _make_pair(kind, cfg)
    x_full = torch.randn(4, cfg.seq_len, cfg.hidden)
    v = torch.randn(cfg.hidden)
    x = axon4d.shard_input(x_full).detach().requires_grad_()
    y = mod(x)
    (y * axon4d.shard_features(v, "x")).sum().div(y.shape[0] * y.shape[1]).backward()
    xr = x_full.clone().requires_grad_()
    yr = dense(xr)
    (yr * v).sum().div(yr.shape[0] * yr.shape[1]).backward()
    errs = {"forward": rel_err(axon4d.gather_batch(axon4d.gather_features(y, "x")), yr)}
    dx = axon4d.gather_batch(axon4d.gather_features(x.grad, "x")) / grid.size("batch")
    errs["input_grad"] = rel_err(dx, xr.grad)
    errs.update(_grad_errors(dense, mod.to_dense(grads=True)))
    return errs


def _assert_small(results, tol, label):
    for rank, errs in enumerate(results):
        bad = {k: v for k, v in errs.items() if not v <= tol}
        assert not bad, f"{label} rank {rank}: {bad}"


ACTIVATION_CASES = [
    ("attention", GPT),
    ("attention", LLAMA),
    ("mlp", GPT),
    ("mlp", LLAMA),
    ("layernorm", GPT),
    ("rmsnorm", LLAMA),
    ("block", GPT),
    ("block", LLAMA),
]


@pytest.mark.parametrize(
    "world,grids",
    [
        (1, [(1, 1, 1, 1)]),
        pytest.param(2, [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)], marks=pytest.mark.slow),
        pytest.param(4, [(2, 2, 1, 1), (1, 2, 2, 1), (2, 1, 1, 2), (1, 1, 2, 2)], marks=pytest.mark.slow),
        pytest.param(8, [(2, 2, 2, 1), (1, 2, 2, 2), (2, 2, 1, 2), (2, 1, 4, 1)], marks=pytest.mark.slow),
    ],
)
def test_blocks_match_single_process(pools, world, grids):
    for grid in grids:
        for kind, cfg in ACTIVATION_CASES:
            _assert_small(
                pools(world).run(grid, _check_activation_module, kind, cfg), TOL, f"{kind}/{cfg.arch} on {grid}"
            )


def _check_embedding_and_loss(grid):
    torch.manual_seed(2)
    vocab, hidden = 64, 32
    dense = nn.Embedding(vocab, hidden)
    emb = VocabParallelEmbedding(vocab, hidden).load_dense_(dense.weight)
    ids_full = torch.randint(0, vocab, (4, 6))
    v = torch.randn(hidden)
    y = emb(axon4d.shard_batch(ids_full))
    (y * axon4d.shard_features(v, "x")).sum().div(y.shape[0] * y.shape[1]).backward()
    yr = dense(ids_full)
    (yr * v).sum().div(yr.shape[0] * yr.shape[1]).backward()
    errs = {"emb_forward": rel_err(axon4d.gather_batch(axon4d.gather_features(y, "x")), yr)}
    errs.update({f"emb_{k}": e for k, e in _grad_errors(dense, emb.to_dense(grads=True)).items()})
    # cross-entropy over logits split over y, with an ignored token
    logits_full = torch.randn(4, 6, vocab)
    targets = torch.randint(0, vocab, (4, 6))
    targets[0, 0] = -100
    logits = axon4d.shard_features(axon4d.shard_batch(logits_full), "y").detach().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, axon4d.shard_batch(targets), grid)
    loss.backward()
    lr = logits_full.clone().requires_grad_()
    ref_loss = F.cross_entropy(lr.reshape(-1, vocab), targets.reshape(-1))
    ref_loss.backward()
    # a rank's loss is the mean over its own tokens; the global mean is their mean when shards hold equal valid counts
    ref_local = F.cross_entropy(
        axon4d.shard_batch(logits_full).reshape(-1, vocab), axon4d.shard_batch(targets).reshape(-1)
    )
    errs["ce_forward"] = rel_err(loss.detach(), ref_local)
    g = axon4d.gather_batch(axon4d.gather_features(logits.grad, "y"))
    local_counts = (axon4d.shard_batch(targets) != -100).sum()
    total = (targets != -100).sum()
    errs["ce_grad"] = rel_err(axon4d.shard_batch(g) * local_counts / total, axon4d.shard_batch(lr.grad))
    return errs


@pytest.mark.parametrize(
    "world,grid",
    [
        (1, (1, 1, 1, 1)),
        (2, (1, 2, 1, 1)),
        (4, (2, 2, 1, 1)),
        pytest.param(8, (2, 2, 2, 1), marks=pytest.mark.slow),
        pytest.param(8, (1, 4, 1, 2), marks=pytest.mark.slow),
    ],
)
def test_vocab_parallel_embedding_and_cross_entropy(pools, world, grid):
    _assert_small(pools(world).run(grid, _check_embedding_and_loss), TOL, f"embedding/ce on {grid}")


def _chunked_loss(grid, dtype):
    """The loss and its logits gradient in row chunks of 5 tokens (the last one short) with ignored
    tokens, against F.cross_entropy on the full logits (fp32 from the same ``dtype`` values)."""
    torch.manual_seed(5)
    vocab = 64
    logits_full = torch.randn(2, 12, vocab).to(dtype)
    targets = torch.randint(0, vocab, (2, 12))
    targets[0, :7] = -100  # more than a chunk of ignored tokens
    targets[1, 3] = -100
    logits = axon4d.shard_features(axon4d.shard_batch(logits_full), "y").detach().requires_grad_()
    local_targets = axon4d.shard_batch(targets)
    rows = 5
    loss = vocab_parallel_cross_entropy(logits, local_targets, grid, chunk_bytes=rows * logits.shape[-1] * 4)
    loss.backward()
    lr = axon4d.shard_batch(logits_full).float().requires_grad_()
    ref = F.cross_entropy(lr.reshape(-1, vocab), local_targets.reshape(-1))
    ref.backward()
    g = axon4d.gather_features(logits.grad, "y")
    chunks = -(-local_targets.numel() // rows)
    return {"loss": rel_err(loss, ref), "grad": rel_err(g, lr.grad)}, chunks, str(logits.grad.dtype)


@pytest.mark.parametrize("world,grid", [(2, (1, 2, 1, 1)), pytest.param(4, (1, 2, 1, 2), marks=pytest.mark.slow)])
def test_cross_entropy_in_chunks_equals_torchs(pools, world, grid):
    """Several row chunks, ignore_index inside and across chunks, fp32 and bf16 logits: the loss
    equals torch's on the same values (fp32 math), the gradient comes back in the logits' dtype
    within one rounding of it."""
    for dtype, tol in ((torch.float32, TOL), (torch.bfloat16, {"loss": TOL, "grad": 1e-2})):
        for rank, (errs, chunks, grad_dtype) in enumerate(pools(world).run(grid, _chunked_loss, dtype)):
            assert chunks >= 3, chunks
            assert grad_dtype == str(dtype), (rank, grad_dtype)
            bound = tol if isinstance(tol, dict) else {k: tol for k in errs}
            assert all(e <= bound[k] for k, e in errs.items()), f"{dtype} rank {rank}: {errs}"


def _loss_memory(grid, dtype, chunk_bytes):
    """Peak bytes torch allocates (MemTracker) in the loss's forward and in its backward, beyond the
    logits (forward) and the logits plus their gradient (backward), which the tracker counts too."""
    import warnings

    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    n, v = 512, 256
    logits = torch.randn(n, v, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, v, (n,))

    def peak(fn):
        tracker = MemTracker()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tracker:
                out = fn()
        return tracker.get_tracker_snapshot("peak")[logits.device]["Total"], out

    forward, loss = peak(lambda: vocab_parallel_cross_entropy(logits, targets, grid, chunk_bytes=chunk_bytes))
    backward, _ = peak(loss.backward)
    size = logits.numel() * logits.element_size()
    return forward - size, backward - 2 * size, n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_entropy_temporaries_are_bounded_by_the_chunk(pools, dtype):
    """Beyond the logits and their gradient the loss allocates at most two fp32 chunks (plus a few
    per-token vectors), not the n·v fp32 copies (512 KiB here) a whole-tensor softmax makes."""
    chunk = 16 * 1024  # 16 rows of 256 fp32 logits: 32 chunks
    ((fwd, bwd, n),) = pools(1).run((1, 1, 1, 1), _loss_memory, dtype, chunk)
    bound = 2 * chunk + 32 * n  # per-token vectors: lse, targets, masks, scale
    assert fwd <= bound and bwd <= bound, (fwd, bwd, bound)
    if dtype == torch.bfloat16:  # the check sees a full fp32 copy: one chunk widens all the bf16 logits at once
        ((whole_fwd, whole_bwd, _),) = pools(1).run((1, 1, 1, 1), _loss_memory, dtype, 2**30)
        assert min(whole_fwd, whole_bwd) >= 512 * 1024 > bound, (whole_fwd, whole_bwd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_entropy_over_whole_logits_needs_no_grid(dtype):
    """Without a grid the logits hold the whole vocabulary (a Hugging Face model's tied head): the
    chunked loss equals torch's on the fp32 values, its gradient comes back in the logits' dtype,
    and its temporaries stay within two chunks, where torch's loss widens all the logits at once."""
    torch.manual_seed(0)
    logits = torch.randn(3, 40, 96, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 96, (3, 40))
    targets[1, 5:9] = -100
    loss = vocab_parallel_cross_entropy(logits, targets, None, chunk_bytes=7 * 96 * 4)  # 18 chunks
    loss.backward()
    wide = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(wide.reshape(-1, 96), targets.reshape(-1))
    ref.backward()
    assert rel_err(loss.detach(), ref.detach()) <= TOL
    assert logits.grad.dtype == dtype
    assert rel_err(logits.grad.float(), wide.grad) <= (TOL if dtype == torch.float32 else 1e-2)
    chunk = 16 * 1024
    fwd, bwd, n = _loss_memory(None, dtype, chunk)
    assert max(fwd, bwd) <= 2 * chunk + 32 * n < 512 * 1024, (fwd, bwd)


def _check_model(grid, cfg):
    torch.manual_seed(7)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense)
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    loss = model.loss(axon4d.shard_batch(ids), axon4d.shard_batch(targets))
    loss.backward()
    ref = dense.loss(ids, targets)
    ref.backward()
    logits = axon4d.gather_batch(axon4d.gather_features(model(axon4d.shard_batch(ids)), "y"))
    errs = {"logits": rel_err(logits, dense(ids))}
    mean_loss = grid.comm.all_reduce(loss.detach().reshape(1).clone(), "batch").wait() / grid.size("batch")
    errs["loss"] = rel_err(mean_loss, ref.detach().reshape(1))
    errs.update(_grad_errors(dense, model.to_dense(grads=True)))
    return errs


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize(
    "world,grid",
    [
        (1, (1, 1, 1, 1)),
        (2, (1, 1, 1, 2)),
        (4, (1, 2, 2, 1)),
        pytest.param(8, (2, 2, 2, 1), marks=pytest.mark.slow),
        pytest.param(8, (1, 2, 2, 2), marks=pytest.mark.slow),
    ],
)
def test_whole_model_matches_single_process(pools, cfg, world, grid):
    _assert_small(pools(world).run(grid, _check_model, cfg), TOL, f"{cfg.arch} on {grid}")


def _train(grid, cfg, steps):
    torch.manual_seed(3)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=gen)
        loss = model.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = grid.comm.all_reduce(loss.detach().reshape(1).clone(), "batch").wait() / grid.size("batch")
        losses.append(mean.item())
    return losses


def _train_reference(cfg, steps):
    torch.manual_seed(3)
    dense = DenseTransformer(cfg)
    opt = torch.optim.AdamW(dense.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=gen)
        loss = dense.loss(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("grid", [(2, 2, 2, 1), (1, 2, 2, 2)])
@pytest.mark.slow
def test_training_follows_the_single_process_loss_curve(pools, grid):
    ref = _train_reference(LLAMA, 50)
    for curve in pools(8).run(grid, _train, LLAMA, 50):
        worst = max(abs(a - b) / b for a, b in zip(curve, ref))
        assert worst < 1e-4, f"grid {grid}: loss curve deviates by {worst:.1e}"
    assert ref[-1] < ref[0]  # it actually learned something


def _head_errors(grid):
    return value_errors(
        {
            "heads": lambda: Attention(32, 4, 4),
            "kv_heads": lambda: Attention(32, 8, 2),
            "vocab": lambda: VocabParallelEmbedding(30, 32),
        }
    )


@pytest.mark.slow
def test_heads_and_vocab_that_do_not_split_raise_clear_errors(pools):
    for msgs in pools(8).run((1, 8, 1, 1), _head_errors):
        assert "n_heads = 4 is not divisible by G_y = 8" in msgs["heads"]
        assert "n_kv_heads = 2 is not divisible by G_y = 8" in msgs["kv_heads"]
        assert "vocab_size = 30 is not divisible by G_y = 8" in msgs["vocab"]


def _norm_work(grid):
    """For LayerNorm and RMSNorm: whether forward and gradients equal torch.nn's bitwise, and the
    aten ops torch's profiler records in one forward + backward of ours and of torch.nn's."""
    from torch.profiler import ProfilerActivity, profile

    def run(mod, x, v):
        x = x.detach().clone().requires_grad_()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            y = mod(x)
            (y * v).sum().backward()
        # aten::to of an fp32 tensor to fp32 returns it (no work): the casts of the bf16 path
        ops = sum(e.name.startswith("aten::") and e.name != "aten::to" for e in prof.events())
        return y.detach(), x.grad, ops

    torch.manual_seed(4)
    out = {}
    for kind, cfg in (("layernorm", GPT), ("rmsnorm", LLAMA)):
        dense, mod = _make_pair(kind, cfg)
        x_full, v = torch.randn(2, 6, cfg.hidden), torch.randn(cfg.hidden)
        y, dx, ops = run(mod, axon4d.shard_features(x_full, "x"), axon4d.shard_features(v, "x"))
        yr, dxr, ops_ref = run(dense, x_full, v)
        got = mod.to_dense(grads=True)
        exact = torch.equal(axon4d.gather_features(y, "x"), yr) and torch.equal(axon4d.gather_features(dx, "x"), dxr)
        exact = exact and all(torch.equal(got.get_parameter(n).grad, p.grad) for n, p in dense.named_parameters())
        with torch.no_grad():
            low = mod(axon4d.shard_features(x_full, "x").bfloat16())
        out[kind] = {"exact": exact, "ops": ops, "ops_ref": ops_ref, "bf16_out": low.dtype}
    return out


@pytest.mark.parametrize(
    "world,grid,whole", [(1, (1, 1, 1, 1), True), (2, (1, 2, 1, 1), True), (2, (2, 1, 1, 1), False)]
)
def test_a_norm_whose_features_are_whole_runs_torchs_kernel(pools, world, grid, whole):
    """G_x = 1: the norm is torch.nn's own (bitwise equal, no more ops besides casts that return
    their input; for LayerNorm one fused kernel each way); split over x it is axon4d's own Function
    around the statistics' all-reduce (more ops; exact to TOL by test_blocks_match_single_process
    and tests/test_norms.py).
    Either way bf16 activations come back in bf16."""
    for rank, res in enumerate(pools(world).run(grid, _norm_work)):
        for kind, r in res.items():
            assert r["bf16_out"] == torch.bfloat16, (kind, rank, r)
            if whole:
                assert r["exact"], f"{kind} on {grid} rank {rank}: not bitwise torch.nn's"
                assert r["ops"] <= r["ops_ref"], (
                    f"{kind} on {grid} rank {rank}: {r['ops']} ops, torch.nn {r['ops_ref']}"
                )
            else:
                assert r["ops"] > r["ops_ref"], f"{kind} on {grid} rank {rank}: split path expected, {r}"
