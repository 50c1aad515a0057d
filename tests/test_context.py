"""Protects context parallelism (docs/context.md): one sequence split head–tail over z.

- the layout maths: which global positions each z-rank holds, and that gathering puts them back;
- exactness: with ``Transformer(cfg, context_parallel=True)`` the logits, the loss and every
  parameter gradient equal the single-process ``DenseTransformer`` on the full sequences (fp32,
  ≤ 1e-5 relative) for G_z ∈ {2, 4}, with and without y and data splits, GQA ratios 1 and 4,
  rotary (llama) and learned (gpt) positions, and under selective and full recomputation;
- balance: every z-rank's queries attend to the same number of keys, (2·G_z+1)·S/(2·G_z);
- overlap: the key/value all-gather is in flight while the diagonal (local) attention runs, and the
  reduce-scatter of their gradients while the diagonals' backward runs;
- traffic: each layer all-gathers over z the keys and values of this rank's own key/value heads
  only (n_kv/G_y heads), and reduce-scatters their gradients, as many bytes as docs/context.md says;
- a sequence length that 2·G_z does not divide is a ValueError on every rank, naming S, G_z and
  the nearest lengths that work.
"""

import pytest
import torch
from harness import value_errors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from axon4d import activations
from axon4d.config import ModelConfig
from axon4d.device import attention as kernels
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Op, Term
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.nn.attention import Attention
from axon4d.nn.context import prefix_attention, split_sequence_attention
from axon4d.plan.saved import block_saved
from axon4d.plan.workload import Workload

TOL = 1e-5
FLOOR = 1e-3  # some gradients are exactly zero in theory (a key bias cannot change a softmax)
SEQ = 16  # 2·G_z chunks of 4 tokens on G_z = 2, of 2 tokens on G_z = 4
BATCH = 2


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error relative to the reference's scale (floored, for gradients that vanish)."""
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(FLOOR))


GPT = ModelConfig(n_layers=2, hidden=32, n_heads=8, vocab_size=64, seq_len=SEQ, arch="gpt")  # GQA ratio 1
LLAMA_GQA = ModelConfig(
    n_layers=2, hidden=32, n_heads=8, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=SEQ, arch="llama"
)  # GQA ratio 4
LLAMA_MHA = LLAMA_GQA.replace(n_kv_heads=8)  # GQA ratio 1, rotary
LLAMA_GQA2 = LLAMA_GQA.replace(n_kv_heads=4)  # GQA ratio 2
CONFIGS = {"gpt": GPT, "llama_gqa4": LLAMA_GQA, "llama_gqa1": LLAMA_MHA, "llama_gqa2": LLAMA_GQA2}


def grid_id(value):
    """A grid (x, y, z, data) as "x1y1z2d1" in test ids; other parameters as they are."""
    return "x{}y{}z{}d{}".format(*value) if isinstance(value, tuple) else str(value)


def test_each_z_rank_holds_a_head_and_a_tail_chunk():
    # G_z = 2, S = 8: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert activations.sequence_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert activations.sequence_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    # G_z = 4, S = 8: chunks of 1; rank r holds r and 7 − r
    assert [activations.sequence_positions(8, z, 4).tolist() for z in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for g_z in (1, 2, 4):
        held = torch.cat([activations.sequence_positions(24, z, g_z) for z in range(g_z)])
        assert torch.equal(held[activations.sequence_order(24, g_z)], torch.arange(24))


def test_a_length_that_does_not_split_names_the_rule_and_the_lengths_that_work():
    with pytest.raises(ValueError) as e:
        activations.sequence_chunk_len(10, 2)
    msg = str(e.value)
    assert "S = 10" in msg and "G_z = 2" in msg and "multiple of 4" in msg and "8 or 12" in msg
    assert activations.sequence_chunk_len(12, 2) == 3


def _check_model(grid, cfg, recompute, mode=True, terms=(Term.CP_KV, Term.CP_KV_GRAD)):
    """The model split over z (``context_parallel=mode``) against one process: relative errors of
    the logits, the loss and every parameter and gradient, and the (op, axis, bytes, tag) of its
    collectives of ``terms``."""
    torch.manual_seed(7)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense, recompute=recompute, context_parallel=mode)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    targets = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    grid.comm.log.clear()
    loss = model.loss(activations.shard_sequence(ids), activations.shard_sequence(targets))
    loss.backward()
    kv = [(r.op, r.axis, r.payload_bytes) for r in grid.comm.log.records if r.tag in terms]
    kinds = {r.tag for r in grid.comm.log.records if r.tag in terms}
    ref = dense.loss(ids, targets)
    ref.backward()
    logits = activations.gather_sequence(activations.gather_features(model(activations.shard_sequence(ids)), "y"))
    errs = {"logits": rel_err(logits, dense(ids))}
    mean_loss = grid.comm.all_reduce(loss.detach().reshape(1).clone(), "batch").wait() / grid.size("batch")
    errs["loss"] = rel_err(mean_loss, ref.detach().reshape(1))
    got = dict(model.to_dense(grads=True).named_parameters())
    for name, p in dense.named_parameters():
        errs[name] = rel_err(got[name], p)
        errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
    return (errs, kv) if mode is True else (errs, kinds)


def _expected_kv_records(grid, cfg, recompute):
    """Per layer: the all-gather of K and V (the whole sequence of this rank's kv heads) and the
    reduce-scatter of their gradients, both of b·S·2·(n_kv/G_y)·d·4 bytes of payload; full
    recomputation runs the block's forward, all-gather included, once more in backward."""
    g_z = grid[2]
    if g_z == 1:
        return []
    b = BATCH // grid[3]
    payload = b * SEQ * 2 * (cfg.kv_heads // grid[1]) * (cfg.hidden // cfg.n_heads) * 4
    fwd = [(Op.ALL_GATHER, "z", payload)] * cfg.n_layers * (2 if recompute == "full" else 1)
    bwd = [(Op.REDUCE_SCATTER, "z", payload)] * cfg.n_layers
    return fwd + bwd


def _priced_kv_records(grid, cfg):
    """What the planner prices for the same step (``Workload.context_collectives``)."""
    wl = Workload(cfg, BATCH, "float32", context_parallel=True)
    return [(c.op, c.axis, c.payload_bytes) for c in wl.context_collectives(GridShape(*grid))]


def _run_matrix(pools, cfg_name, grid, recompute="none"):
    cfg = CONFIGS[cfg_name]
    world = grid[0] * grid[1] * grid[2] * grid[3]
    for rank, (errs, kv) in enumerate(pools(world).run(grid, _check_model, cfg, recompute)):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"{cfg_name} on {grid} ({recompute}) rank {rank}: {bad}"
        assert sorted(kv, key=str) == sorted(_expected_kv_records(grid, cfg, recompute), key=str), (
            f"{cfg_name} on {grid} rank {rank}: key/value collectives {kv}"
        )
        if recompute == "none":  # the planner prices exactly the bytes the step logged
            assert sorted(kv, key=str) == sorted(_priced_kv_records(grid, cfg), key=str), (
                f"{cfg_name} on {grid} rank {rank}: logged {kv}, priced {_priced_kv_records(grid, cfg)}"
            )


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize(
    "grid",
    [
        (1, 1, 2, 1),
        pytest.param((1, 2, 2, 1), marks=pytest.mark.slow),
        pytest.param((1, 1, 4, 1), marks=pytest.mark.slow),
        pytest.param((1, 1, 2, 2), marks=pytest.mark.slow),
        pytest.param((2, 1, 2, 1), marks=pytest.mark.slow),
    ],
    ids=grid_id,
)
def test_split_sequence_equals_the_single_process_model(pools, cfg_name, grid):
    _run_matrix(pools, cfg_name, grid)


@pytest.mark.parametrize(
    "cfg_name,grid",
    [
        pytest.param("llama_gqa4", (1, 2, 4, 1), marks=pytest.mark.slow),
        pytest.param("gpt", (2, 1, 2, 2), marks=pytest.mark.slow),
        ("llama_gqa4", (1, 1, 1, 2)),
    ],
    ids=grid_id,
)
def test_split_sequence_on_eight_ranks_and_without_z(pools, cfg_name, grid):
    _run_matrix(pools, cfg_name, grid)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_split_sequence_under_recomputation(pools, recompute):
    _run_matrix(pools, "llama_gqa4", (1, 2, 2, 1), recompute)


def _layer_input():
    torch.manual_seed(3)
    attn = Attention(32, 8, 2, bias=False, rope_theta=10000.0, context_parallel=True)
    return attn, activations.shard_sequence(torch.randn(1, SEQ, 32, requires_grad=True))


def _keys_attended(grid):
    """The key lengths of every attention kernel call of one split-sequence attention layer on this rank."""
    attn, x = _layer_input()
    lengths = []
    kernel = kernels.attention_with_lse

    def counting(q, k, v, causal):
        lengths.append(k.shape[2])
        return kernel(q, k, v, causal)

    kernels.attention_with_lse = counting
    try:
        attn(x)
    finally:
        kernels.attention_with_lse = kernel
    return lengths


def _prefix_pieces(r, g_z, c):
    """The key lengths of z-rank r's prefix kernel calls, read in place from the gathered keys
    (nn/context.py's module docstring): head chunk r, the heads of ranks before it (none on rank 0);
    tail chunk 2·G_z−1−r, every head, then the tails of ranks after it (none on the last rank)."""
    return ([r * c] if r else []) + [g_z * c] + ([(g_z - 1 - r) * c] if r < g_z - 1 else [])


def test_every_z_rank_attends_to_the_same_number_of_keys(pools):
    """Causal balance: z-rank r's chunks r and 2·G_z−1−r read C keys each on the diagonal and r·C and
    (2·G_z−1−r)·C in their prefixes (none for chunk 0; the tail's in two pieces, every head chunk
    and the tails after r): (2·G_z+1)·C on every rank."""
    g_z, c = 4, SEQ // 8
    got = pools(4).run((1, 1, 4, 1), _keys_attended)
    assert got == [[c, c] + _prefix_pieces(r, g_z, c) for r in range(g_z)]
    assert {sum(lengths) for lengths in got} == {(2 * g_z + 1) * c}


def _events(grid):
    """The order of the key/value collectives' issue and wait and of the attention kernel calls (diagonal:
    causal, prefix: not) in one forward and backward of a split-sequence attention layer."""
    attn, x = _layer_input()
    events = []
    originals = kernels.attention_with_lse, kernels.attention_with_lse_backward

    def forward(q, k, v, causal):
        events.append(("forward", "diagonal" if causal else "prefix"))
        return originals[0](q, k, v, causal)

    def backward(grad, q, k, v, out, lse, causal):
        events.append(("backward", "diagonal" if causal else "prefix"))
        return originals[1](grad, q, k, v, out, lse, causal)

    class Watched:
        def __init__(self, handle, tag):
            self.handle, self.tag = handle, tag

        def wait(self):
            events.append(("wait", self.tag))
            return self.handle.wait()

    def watch(issue):
        def issued(tensor, axis, dim=0, tag="", **kwargs):
            handle = issue(tensor, axis, dim=dim, tag=tag, **kwargs)
            if tag not in (Term.CP_KV, Term.CP_KV_GRAD):  # the layer's other collectives (E10f, E10b, E11)
                return handle
            events.append(("issue", tag))
            return Watched(handle, tag)

        return issued

    kernels.attention_with_lse, kernels.attention_with_lse_backward = forward, backward
    grid.comm.all_gather, grid.comm.reduce_scatter = watch(grid.comm.all_gather), watch(grid.comm.reduce_scatter)
    try:
        attn(x).sum().backward()
    finally:
        kernels.attention_with_lse, kernels.attention_with_lse_backward = originals
        del grid.comm.all_gather, grid.comm.reduce_scatter  # the class's methods again
    return events


def test_the_key_value_collectives_overlap_the_diagonal_attention(pools):
    """Forward: the all-gather of K, V is issued before both diagonal parts and waited on after them,
    before any prefix. Backward: every prefix's backward runs first, then the reduce-scatter of the
    gathered K, V's gradient is issued, and both diagonals' backward run before it is waited on."""
    for rank, events in enumerate(pools(2).run((1, 1, 2, 1), _events)):
        prefixes = len(_prefix_pieces(rank, 2, 1))  # rank 0: chunk 0 has none, chunk 3's in two pieces
        gather = [("issue", Term.CP_KV)] + [("forward", "diagonal")] * 2 + [("wait", Term.CP_KV)]
        scatter = [("issue", Term.CP_KV_GRAD)] + [("backward", "diagonal")] * 2 + [("wait", Term.CP_KV_GRAD)]
        want = gather + [("forward", "prefix")] * prefixes + [("backward", "prefix")] * prefixes + scatter
        assert events == want, f"rank {rank}: {events}"


def _shard_and_gather(grid):
    x = torch.arange(4 * SEQ * 3, dtype=torch.float32).reshape(4, SEQ, 3)
    part = activations.shard_sequence(x)
    z, g_z = grid.coord("z"), grid.size("z")
    d, g_d = grid.coord("data"), grid.size("data")
    want = x[d * 4 // g_d : (d + 1) * 4 // g_d].index_select(1, activations.sequence_positions(SEQ, z, g_z))
    return torch.equal(part, want), torch.equal(activations.gather_sequence(part), x)


@pytest.mark.parametrize("grid", [(1, 1, 2, 2), (1, 2, 2, 1), (1, 1, 4, 1)], ids=grid_id)
def test_shard_and_gather_sequence_round_trip(pools, grid):
    assert pools(4).run(grid, _shard_and_gather) == [(True, True)] * 4


def _length_errors(grid):
    model = Transformer(LLAMA_GQA, context_parallel=True)
    return value_errors(
        {
            "shard": lambda: activations.shard_sequence(torch.zeros(2, 10, dtype=torch.long)),
            "forward": lambda: model(torch.zeros(1, 5, dtype=torch.long)),  # 5 tokens of S = 10 per rank
        }
    )


def test_a_length_that_does_not_split_raises_on_every_rank(pools):
    for msgs in pools(2).run((1, 1, 2, 1), _length_errors):
        for case, msg in msgs.items():
            assert msg is not None, f"{case}: no error for S = 10 on G_z = 2"
            assert "S = 10" in msg and "G_z = 2" in msg and "8 or 12" in msg, f"{case}: {msg}"


def test_the_planner_prices_the_split_sequence():
    """Grid validity, attention work per rank and the gathered keys and values kept for backward."""
    cfg = LLAMA_GQA.replace(seq_len=4096)
    cp = Workload(cfg, 2, "float32", context_parallel=True)
    plain = Workload(cfg, 2, "float32")
    shape = GridShape(1, 2, 4, 2)  # 2 sequences over data 2, each one's tokens over z 4
    assert cp.grid_problems(shape) == [] and plain.grid_problems(shape) != []
    assert cp.grid_problems(GridShape(1, 1, 4, 4)) == [
        "the batch (sequences per step) = 2 is not divisible by G_data = 4"
    ]
    assert cp.local_tokens(shape) == 4096 // 4 and cp.local_sequences(shape) == 0.25
    kv = 4096 * 2 * (cfg.kv_heads // 2) * cfg.head_dim  # one whole sequence's keys and values of 1 kv head
    assert block_saved(cp, shape)["attention"] - block_saved(plain, shape)["attention"] == kv
    assert block_saved(cp, shape, "full")["attention"] == 0
    with pytest.raises(ValueError, match="seq_len = 4097 is odd"):
        Workload(cfg.replace(seq_len=4097), 2, context_parallel=True)


def _cuda_kernels_on_host(monkeypatch, layouts):
    """Stand-ins for the CUDA memory-efficient kernels that keep their contracts on the host: the
    forward returns out in the kernel's own (b, L, h, d) layout and lse padded to 32 rows; the
    backward reads ``out`` at row stride h·d whatever its strides (``o_strideM()``), as the kernel
    does for fp16/bf16, and records whether ``out`` had that layout."""

    def forward(q, k, v, causal):
        scores = kernels._scores(q, k, causal)
        lse = scores.logsumexp(-1)
        out = kernels.kernel_layout((scores - lse.unsqueeze(-1)).exp().to(v.dtype) @ v)
        padded = lse.new_zeros(*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32)
        padded[..., : lse.shape[-1]] = lse
        return out, padded

    def backward(grad, q, k, v, out, lse, causal):
        b, h, rows, d = out.shape
        layouts.append(out.transpose(1, 2).is_contiguous())
        read = torch.as_strided(out, (b, h, rows, d), (out.stride(0), d, h * d, 1), out.storage_offset())
        p = (kernels._scores(q, k, causal) - lse.unsqueeze(-1)).exp()
        g32 = grad.float()
        ds = p * (g32 @ v.float().transpose(-2, -1) - (g32 * read.float()).sum(-1, keepdim=True))
        scale = d**-0.5
        return (ds @ k.float()) * scale, (ds.transpose(-2, -1) @ q.float()) * scale, p.transpose(-2, -1) @ g32

    monkeypatch.setattr(kernels, "kernel_for", lambda q, k, causal: kernels.EFFICIENT)
    monkeypatch.setattr(kernels, "_efficient_attention", forward)
    monkeypatch.setattr(kernels, "_efficient_attention_backward", backward)


@pytest.mark.parametrize("chunks", [(1, 2), (0, 3)])
def test_the_cuda_backward_kernel_receives_out_in_its_own_layout(monkeypatch, chunks):
    """On CUDA, context parallelism's backward hands the merged (or sliced) attention output to the
    memory-efficient kernel, which reads it at row stride heads·head_dim (docs/context.md). With
    stand-ins that read it exactly so, every call gets that layout and the gradients equal the host
    kernel's — several local heads and GQA 4, where the (b, h, L, d)-contiguous output of a merge
    would be misread (or read past its end)."""

    torch.manual_seed(0)
    q = torch.randn(2, 8, 8, 16, dtype=torch.float64, requires_grad=True)  # (b, hq, 2·C, d), C = 4
    k = torch.randn(2, 2, 16, 16, dtype=torch.float64, requires_grad=True)  # (b, hkv, S, d)
    v = torch.randn(2, 2, 16, 16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 8, 8, 16, dtype=torch.float64)
    expected = torch.autograd.grad(prefix_attention(q, k, v, chunks), (q, k, v), grad)
    layouts: list[bool] = []
    _cuda_kernels_on_host(monkeypatch, layouts)
    got = torch.autograd.grad(prefix_attention(q, k, v, chunks), (q, k, v), grad)
    for g, e in zip(got, expected):
        assert rel_err(g, e) <= TOL
    assert layouts and all(layouts)


# -- the kernel seam: which kernel runs, grouped-query heads without key/value copies ------------------


def test_the_kernel_chooser_picks_by_device_dtype_and_head_dim():
    """Flash where torch says it runs (CUDA, fp16/bf16, head_dim a multiple of 8 up to 256), the
    memory-efficient kernel on CUDA otherwise (fp32, flash unsupported or switched off), the host's
    flash kernel on the host, fp32 matmuls elsewhere (another device, or a head_dim the CUDA kernels
    cannot take)."""
    choose = kernels.choose_kernel
    for dtype in (torch.bfloat16, torch.float16):
        assert choose("cuda", dtype, 64, True) == kernels.FLASH
        assert choose("cuda", dtype, 256, True) == kernels.FLASH
        assert choose("cuda", dtype, 64, False) == kernels.EFFICIENT  # old GPU, or enable_flash_sdp(False)
        assert choose("cuda", dtype, 512, True) == kernels.EFFICIENT
        assert choose("cuda", dtype, 12, True) == kernels.MATH
    assert choose("cuda", torch.float32, 64, True) == kernels.EFFICIENT
    assert choose("cpu", torch.bfloat16, 64, True) == kernels.HOST_KERNEL
    assert choose("cpu", torch.float32, 12, False) == kernels.HOST_KERNEL
    assert choose("xpu", torch.bfloat16, 64, False) == kernels.MATH
    q = torch.zeros(1, 4, 8, 16)
    assert kernels.kernel_for(q, q[:, :2], True) == kernels.HOST_KERNEL
    meta = torch.zeros(1, 4, 8, 16, device="meta", dtype=torch.bfloat16)
    assert kernels.kernel_for(meta, meta, False) == kernels.MATH
    assert kernels.NATIVE_GQA == {kernels.FLASH}


def _dense_causal(q, k, v):
    """The reference: causal attention of the whole sequence, key/value heads repeated (b, hq, S, d)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _qkv(groups, seq=SEQ, kv_heads=2, d=16, batch=2, dtype=torch.float64):
    gen = torch.Generator().manual_seed(groups)
    shapes = [(batch, kv_heads * groups, seq, d), (batch, kv_heads, seq, d), (batch, kv_heads, seq, d)]
    return [torch.randn(s, generator=gen, dtype=dtype, requires_grad=True) for s in shapes]


def _flash_on_host(monkeypatch, calls):
    """Stand-ins for torch's CUDA flash ops (``aten._scaled_dot_product_flash_attention`` and its
    backward) keeping their contract on the host: native grouped-query heads (k and v with fewer
    heads), dense sequences (no cumulative lengths, max lengths the sequences'), lse (b, h, Lq) read
    as contiguous by the backward. Records each call's (query heads, key/value heads, causal)."""
    aten = torch.ops.aten

    def forward(q, k, v, dropout, causal):
        calls.append((q.shape[1], k.shape[1], causal))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout, causal)
        return out, lse, None, None, q.shape[2], k.shape[2], torch.empty(2), torch.empty(()), torch.empty(0)

    def backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout, causal, seed, offset):
        assert lse.is_contiguous(), "the flash backward reads lse without strides"
        assert (cum_q, cum_k, max_q, max_k, dropout) == (None, None, q.shape[2], k.shape[2], 0.0)
        calls.append((q.shape[1], k.shape[1], causal))
        groups = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, kk, vv, out, lse, 0.0, causal)
        return dq, dk.unflatten(1, (-1, groups)).sum(2), dv.unflatten(1, (-1, groups)).sum(2)

    monkeypatch.setattr(kernels, "kernel_for", lambda q, k, causal: kernels.FLASH)
    monkeypatch.setattr(aten, "_scaled_dot_product_flash_attention", forward)
    monkeypatch.setattr(aten, "_scaled_dot_product_flash_attention_backward", backward)


@pytest.mark.parametrize("kernel", [kernels.HOST_KERNEL, kernels.MATH, kernels.FLASH])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("g_z", [2, 4])
def test_split_attention_equals_causal_attention(monkeypatch, kernel, groups, g_z):
    """Every z-rank's two query chunks against the whole sequence's keys (prefix_attention: the split
    attention once the keys are gathered) equal causal attention of the whole sequence in out, dq, dk
    and dv (fp64), for GQA ratios 1, 2 and 4 on each kernel path; on flash (stood in for on the host)
    the causal squares get the key/value heads as they are, and the prefixes one query sequence per
    key/value head."""
    q, k, v = _qkv(groups)
    grad = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(9))
    ref = _dense_causal(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    calls: list[tuple[int, int, bool]] = []
    if kernel == kernels.FLASH:
        _flash_on_host(monkeypatch, calls)
    else:
        monkeypatch.setattr(kernels, "kernel_for", lambda q, k, causal: kernel)
    got_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for z in range(g_z):
        chunks = activations.sequence_chunks(z, g_z)
        at = activations.sequence_positions(SEQ, z, g_z)
        out = prefix_attention(q.index_select(2, at), k, v, chunks)
        assert rel_err(out, ref.index_select(2, at)) <= TOL, f"rank {z}: out"
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad.index_select(2, at))
        for acc, g in zip(got_grads, (dq, dk, dv)):
            acc += g
    for name, got, want in zip("qkv", got_grads, ref_grads):
        assert rel_err(got, want) <= TOL, f"d{name}"
    if kernel == kernels.FLASH:
        hq, hkv = q.shape[1], k.shape[1]
        assert {c for c in calls if c[2]} == {(hq, hkv, True)}  # native grouped-query heads
        assert {c for c in calls if not c[2]} == {(hkv, hkv, False)}  # a group's queries as one sequence


class _Made(TorchDispatchMode):
    """Records every tensor an aten op returns while active: (elements, storage address, storage bytes)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.append((t.numel(), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return out

    def largest(self) -> int:
        return max(n for n, _, _ in self.made)

    def storages(self, nbytes: int) -> set[int]:
        """The addresses of the storages of at least ``nbytes`` that returned tensors live in."""
        return {at for _, at, size in self.made if size >= nbytes}


@pytest.mark.parametrize("kernel", [kernels.HOST_KERNEL, kernels.MATH])
def test_grouped_query_heads_never_repeat_the_prefix_keys(monkeypatch, kernel):
    """GQA ratio 4, G_z = 4, rank 0 (chunks 0 and 7: a prefix of 7 chunks): no tensor made in forward
    or backward is larger than q or the whole sequence's keys — the prefix's keys and values
    repeated for their query heads (or their gradients) would be 3.5 times that."""
    monkeypatch.setattr(kernels, "kernel_for", lambda q, k, causal: kernel)
    q, k, v = _qkv(4)
    local = q.detach()[:, :, :4].clone().requires_grad_()  # (b, 8, 2·C, d), C = 2
    bound = max(local.numel(), k.numel())
    repeated_prefix = q.shape[0] * q.shape[1] * 14 * q.shape[3]
    assert repeated_prefix > 3 * bound

    with _Made() as made:
        out = prefix_attention(local, k, v, (0, 7))
        torch.autograd.grad(out, (local, k, v), torch.ones_like(out))
    assert made.largest() <= bound


def _storages_of_gathered_size(grid, groups):
    """Distinct storages of at least the gathered keys' and values' size made by split attention's
    forward and by its backward, and the largest tensor either makes, on this rank."""
    b, hkv, c2, d = 2, 2, SEQ // grid.size("z"), 16
    gen = torch.Generator().manual_seed(grid.coord("z"))
    q = torch.randn(b, hkv * groups, c2, d, generator=gen, requires_grad=True)
    k, v = (torch.randn(b, hkv, c2, d, generator=gen, requires_grad=True) for _ in range(2))
    gathered = 2 * b * hkv * SEQ * d
    with _Made() as fwd:
        out = split_sequence_attention(q, k, v, grid)
    with _Made() as bwd:
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    nbytes = gathered * q.element_size()
    new_in_backward = bwd.storages(nbytes) - fwd.storages(nbytes)  # not views of the kept gathered buffer
    largest = max(fwd.largest(), bwd.largest())
    return len(fwd.storages(nbytes)), len(new_in_backward), largest, max(q.numel(), gathered)


def test_the_key_value_gather_is_read_in_place(pools):
    """On G_z = 2 (MHA): the forward makes one buffer of the gathered keys' and values' size (the
    all-gather's) and reads every prefix from it in place, the backward one (the gradient buffer the
    reduce-scatter reads as it is): no global-order copy, no permuted copy either way."""
    for rank, (fwd, bwd, _, _) in enumerate(pools(2).run((1, 1, 2, 1), _storages_of_gathered_size, 1)):
        assert (fwd, bwd) == (1, 1), f"rank {rank}: {fwd} forward and {bwd} backward buffers of the gathered size"


def test_grouped_query_heads_repeat_no_gathered_keys(pools):
    """GQA ratio 8 on G_z = 2: no tensor made in the split attention's forward or backward is larger
    than q or the gathered keys and values (rank 0's tail chunk's prefix of 3 chunks, repeated for its
    query heads, would be 1.5 times that)."""
    for rank, (_, _, largest, bound) in enumerate(pools(2).run((1, 1, 2, 1), _storages_of_gathered_size, 8)):
        assert largest <= bound, f"rank {rank}: a tensor of {largest} elements (bound {bound})"
