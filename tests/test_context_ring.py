"""Protects context parallelism's ring mode (docs/context.md, "Ring mode"; axon4d/nn/context_ring.py):

- the communication op: ``Communicator.shift`` sends to the next rank of an axis and receives from
  the previous one, logged once with the bytes sent; two of different tags may be in flight at once;
- visibility: which of a held rank's key chunks each query chunk attends to, from global chunk
  indices, and that every rank attends to (2·G_z+1)·C keys (the causal balance);
- exactness: the ring attention alone equals causal attention of the whole sequence (fp32, GQA
  2:1) at 16K tokens on 8 ranks with G_z = 4 and 8, in out, dq, dk and dv; a GQA Llama with
  ``context_parallel="ring"`` equals the single-process model in logits, loss and every gradient
  (≤ 1e-5 relative), also under selective recomputation;
- memory: no tensor made by the ring attention's forward or backward is larger than the keys and
  values of two chunks' worth of each rank's tokens (the all-gather mode's gathered buffer is G_z×);
- traffic: per layer, G_z − 1 key/value shifts in forward, G_z − 1 more and G_z gradient shifts in
  backward, each of 2·b·(S/G_z)·hkv·d·4 bytes.
"""

import re

import pytest
import torch
from test_context import SEQ, TOL, _check_model, grid_id, rel_err
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from axon4d import activations
from axon4d.config import ModelConfig
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import Op, Term
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.nn.context import split_sequence_attention
from axon4d.nn.context_ring import ring_sequence_attention, visible
from axon4d.options.context_mode import context_mode

RING_TERMS = (Term.CP_KV_RING, Term.CP_KV_RING_GRAD)


def _shifts(grid):
    comm = grid.comm
    comm.log.clear()
    z = grid.coord("z")
    a = comm.shift(torch.full((2, 3), float(z)), "z", tag=Term.CP_KV_RING)
    b = comm.shift(torch.arange(4.0) + 10 * z, "z", tag=Term.CP_KV_RING_GRAD)  # both in flight
    one = comm.shift(torch.ones(5), "x", tag="ring")  # an axis of one rank: nothing moves
    records = [(r.op, r.axis, r.payload_bytes, r.tag) for r in comm.log.records]
    return a.wait(), b.wait(), one.wait(), records, z


def test_shift_passes_to_the_next_rank_and_is_logged_once(pools):
    for a, b, one, records, z in pools(4).run((1, 1, 4, 1), _shifts):
        came_from = (z - 1) % 4
        assert torch.equal(a, torch.full((2, 3), float(came_from)))
        assert torch.equal(b, torch.arange(4.0) + 10 * came_from)
        assert torch.equal(one, torch.ones(5))
        assert records == [(Op.SHIFT, "z", 24, Term.CP_KV_RING), (Op.SHIFT, "z", 16, Term.CP_KV_RING_GRAD)]


def test_the_mode_option_keeps_the_bool_api():
    assert context_mode(False) is None and context_mode(None) is None
    assert context_mode(True) == "all-gather" and context_mode("all-gather") == "all-gather"
    assert context_mode("ring") == "ring"
    with pytest.raises(ValueError, match="ring"):
        context_mode("rings")


@pytest.mark.parametrize("g_z", [1, 2, 4, 8])
def test_each_rank_sees_the_same_number_of_keys_in_the_ring(g_z):
    for z in range(g_z):
        mine = activations.sequence_chunks(z, g_z)
        blocks = 0
        for s in range(g_z):
            held = activations.sequence_chunks((z - s) % g_z, g_z)
            for h in range(2):
                for start, n, causal in visible(mine[h], held):
                    assert all(held[start + i] <= mine[h] for i in range(n))
                    assert causal == (held[start] == mine[h]) and (n == 1 or not causal)
                    blocks += n
                    if causal:
                        assert s == 0
            if s:  # two C × C blocks on every step after the first
                assert sum(n for h in range(2) for _, n, _ in visible(mine[h], held)) == 2
        assert blocks == 2 * g_z + 1  # (2·G_z + 1)·C keys: the all-gather mode's balance


LONG = 16384


def _long_qkv():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(1, h, LONG, 16, generator=gen) for h in (2, 1, 1)]  # GQA 2:1, head_dim 16


class _Largest(TorchDispatchMode):
    """The largest tensor (elements) any op makes while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _ring_alone(grid, recompute):
    q, k, v = (activations.shard_sequence(t.transpose(1, 2)).transpose(1, 2) for t in _long_qkv())
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    gen = torch.Generator().manual_seed(4)
    grad = activations.shard_sequence(torch.randn(1, 2, LONG, 16, generator=gen).transpose(1, 2)).transpose(1, 2)
    grid.comm.log.clear()
    with _Largest() as forward:
        out = ring_sequence_attention(q, k, v, grid, recompute_core=recompute)
    with _Largest() as backward:
        out.backward(grad)
    records = [(r.op, r.payload_bytes, r.tag) for r in grid.comm.log.records]
    return out.detach(), q.grad, k.grad, v.grad, max(forward.largest, backward.largest), records


def _reference():
    """Causal attention of the whole sequence and its gradients, then this z-rank's tokens of each."""
    q, k, v = (t.requires_grad_() for t in _long_qkv())
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
    )
    gen = torch.Generator().manual_seed(4)
    out.backward(torch.randn(1, 2, LONG, 16, generator=gen))
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.slow  # ~20 s: 16K tokens, 8 ranks
@pytest.mark.parametrize("g_z,recompute", [(4, False), (8, False), (8, True)])
def test_ring_attention_equals_causal_attention_at_16k_tokens(pools, g_z, recompute):
    ref = _reference()
    grid = (1, 8 // g_z, g_z, 1) if g_z < 8 else (1, 1, 8, 1)
    results = pools(8).run(grid, _ring_alone, recompute, timeout=600)
    c = LONG // (2 * g_z)
    for rank, (*got, largest, records) in enumerate(results):
        z = GridShape(*grid).coordinate(rank, "z")
        positions = activations.sequence_positions(LONG, z, g_z)
        for name, a, full in zip(("out", "dq", "dk", "dv"), got, ref):
            assert rel_err(a, full.index_select(2, positions)) <= TOL, f"rank {rank} (z {z}) {name}"
        held = 2 * 2 * c * 16  # two chunks' keys and values of one kv head: what a shift moves
        assert largest <= held, f"rank {rank}: a tensor of {largest} elements (the whole sequence's K/V: {LONG * 32})"
        sent = [(Op.SHIFT, held * 4, Term.CP_KV_RING)] * (g_z - 1) * (3 if recompute else 2)
        sent += [(Op.SHIFT, held * 4, Term.CP_KV_RING_GRAD)] * g_z
        assert sorted(records, key=str) == sorted(sent, key=str)


def _largest_buffers(grid):
    """The largest tensor (bytes) each mode's attention makes in forward and in backward at 16K
    tokens: K/V buffers here (q is no larger than one rank's keys and values of 2 chunks)."""
    q, k, v = (activations.shard_sequence(t.transpose(1, 2)).transpose(1, 2) for t in _long_qkv())
    figures = {}
    for name, attend in (("all-gather", split_sequence_attention), ("ring", ring_sequence_attention)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with _Largest() as forward:
            out = attend(*leaves, grid)
        with _Largest() as backward:
            out.backward(torch.ones_like(out))
        figures[name] = (forward.largest * 4, backward.largest * 4)
    return figures


@pytest.mark.slow  # 16K tokens twice on 8 ranks
def test_the_ring_holds_key_value_buffers_of_two_chunks_not_the_sequence(pools):
    """docs/context.md's figure: ``pytest tests/test_context_ring.py -k two_chunks -s`` prints it."""
    g_z = 8
    c = LONG // (2 * g_z)
    kv_sequence = 2 * LONG * 16 * 4  # keys and values of the whole sequence: 1 kv head of 16, fp32
    for rank, figures in enumerate(pools(8).run((1, 1, g_z, 1), _largest_buffers, timeout=600)):
        if rank == 0:
            print(f"\nlargest buffer per rank, {LONG} tokens, G_z = {g_z}, K/V of the sequence {kv_sequence} B:")
            for name, (fwd, bwd) in figures.items():
                print(f"  {name}: forward {fwd} B, backward {bwd} B")
        assert figures["all-gather"] == (kv_sequence, kv_sequence)  # the gathered buffer, its gradients'
        assert figures["ring"] == (2 * 2 * c * 16 * 4,) * 2  # one rank's K/V (2 chunks) = kv_sequence / G_z


def _events(grid):
    """The order of shifts issued (K: keys and values, G: their gradients), their waits (k, g) and
    attention kernels (a: forward, b: backward) in one forward and backward on this rank."""
    from axon4d.device import attention as kernels

    events = []
    shift, fwd, bwd = grid.comm.shift, kernels.attention_with_lse, kernels.attention_with_lse_backward

    class Waited:
        def __init__(self, handle, letter):
            self.handle, self.letter = handle, letter

        def wait(self):
            events.append(self.letter)
            return self.handle.wait()

    def logged_shift(t, axis, tag):
        events.append("K" if tag == Term.CP_KV_RING else "G")
        return Waited(shift(t, axis, tag), "k" if tag == Term.CP_KV_RING else "g")

    def logged(kernel, letter):
        def call(*args):
            events.append(letter)
            return kernel(*args)

        return call

    grid.comm.shift = logged_shift
    kernels.attention_with_lse, kernels.attention_with_lse_backward = logged(fwd, "a"), logged(bwd, "b")
    try:
        q, k, v = (torch.randn(1, h, 8, 4, requires_grad=True) for h in (2, 1, 1))
        out = ring_sequence_attention(q, k, v, grid)
        events.append("|")
        out.sum().backward()
    finally:
        del grid.comm.shift
        kernels.attention_with_lse, kernels.attention_with_lse_backward = fwd, bwd
    return "".join(events)


def test_each_shift_travels_while_a_step_computes(pools):
    """Forward: the next keys' shift is issued before a step's kernels and waited on after them.
    Backward: the same, and each gradient accumulator is waited on only after the next step's
    kernels (then added and passed on); the last one, this rank's own, is waited on at the end."""
    for events in pools(4).run((1, 1, 4, 1), _events):
        forward, backward = events.split("|")
        assert re.fullmatch(r"(Ka+k){3}a+", forward), forward
        assert re.fullmatch(r"Kb+Gk(Kb+gGk){2}b+gGg", backward), backward


LONG_LLAMA = ModelConfig(
    n_layers=2, hidden=32, n_heads=2, n_kv_heads=1, ffn_hidden=48, vocab_size=64, seq_len=LONG, arch="llama"
)  # GQA 2:1, head_dim 16: 16K tokens in seconds


def _long_tokens():
    torch.manual_seed(7)
    dense = DenseTransformer(LONG_LLAMA)
    ids, targets = (torch.randint(0, LONG_LLAMA.vocab_size, (1, LONG)) for _ in range(2))
    return dense, ids, targets


def _long_ring_model(grid):
    """Loss and every parameter with its gradient of the ring-mode model at 16K tokens (rank 0's
    dense copy); the reference runs once, in the test's process."""
    dense, ids, targets = _long_tokens()
    model = Transformer.from_dense(dense, context_parallel="ring")
    del dense
    loss = model.loss(activations.shard_sequence(ids), activations.shard_sequence(targets))
    loss.backward()
    got = {n: (p.detach(), p.grad) for n, p in model.to_dense(grads=True).named_parameters()}
    tags = {r.tag for r in grid.comm.log.records}
    return loss.detach(), got if grid.rank == 0 else None, Term.CP_KV not in tags and Term.CP_KV_RING in tags


@pytest.mark.slow  # 16K tokens: the dense reference and 8 ranks, ~30 s
@pytest.mark.parametrize("grid", [(2, 1, 4, 1), (1, 1, 8, 1)], ids=grid_id)
def test_a_gqa_llama_at_16k_tokens_with_the_ring_mode_equals_one_process(pools, grid):
    dense, ids, targets = _long_tokens()
    ref = dense.loss(ids, targets)
    ref.backward()
    results = pools(8).run(grid, _long_ring_model, timeout=600)
    # each rank's loss is the mean over its tokens, as many on every rank: their mean is the global one
    loss = torch.stack([r[0] for r in results]).mean()
    assert rel_err(loss, ref.detach()) <= TOL, f"loss {float(loss)} vs {float(ref)}"
    assert all(r[2] for r in results)  # the ring's shifts ran, no all-gather
    got = results[0][1]
    for name, p in dense.named_parameters():
        assert rel_err(got[name][0], p) <= TOL, name
        assert rel_err(got[name][1], p.grad) <= TOL, f"{name}.grad"


LLAMA = ModelConfig(
    n_layers=2, hidden=32, n_heads=8, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=SEQ, arch="llama"
)  # GQA ratio 4


def _ring_model(grid, recompute):
    """test_context's model check with ``context_parallel="ring"``: errors, and the K/V terms logged."""
    return _check_model(grid, LLAMA, recompute, "ring", (Term.CP_KV, Term.CP_KV_GRAD, *RING_TERMS))


@pytest.mark.parametrize(
    "grid,recompute",
    [((1, 2, 4, 1), "none"), ((1, 1, 4, 2), "none"), ((1, 1, 2, 1), "selective"), ((1, 1, 2, 1), "full")],
    ids=grid_id,
)
def test_a_llama_with_the_ring_mode_equals_the_single_process_model(pools, grid, recompute):
    world = grid[0] * grid[1] * grid[2] * grid[3]
    for rank, (errs, kinds) in enumerate(pools(world).run(grid, _ring_model, recompute)):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"ring on {grid} ({recompute}) rank {rank}: {bad}"
        assert kinds == set(RING_TERMS), kinds  # no all-gather ran


MPI_RING = r"""
import os, torch, axon4d
from axon4d import activations
from axon4d.layout.geometry import Term
from axon4d.nn.context_ring import ring_sequence_attention
g = axon4d.init(grid=(1, 2, 4, 1), comm="mpi")
z = g.coord("z")
a = g.comm.shift(torch.full((3,), float(z)), "z", tag=Term.CP_KV_RING)
b = g.comm.shift(torch.full((2,), 10.0 + z), "z", tag=Term.CP_KV_RING_GRAD)  # both in flight
ok = torch.equal(a.wait(), torch.full((3,), float((z - 1) % 4)))
ok = ok and torch.equal(b.wait(), torch.full((2,), 10.0 + (z - 1) % 4))
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, h, 64, 8, generator=gen) for h in (4, 2, 2))
ref = [t.clone().requires_grad_() for t in (q, k, v)]
out = torch.nn.functional.scaled_dot_product_attention(
    ref[0], ref[1].repeat_interleave(2, 1), ref[2].repeat_interleave(2, 1), is_causal=True
)
out.sum().backward()
mine = [activations.shard_sequence(t.transpose(1, 2)).transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
o = ring_sequence_attention(*mine, g)
o.sum().backward()
pos = activations.sequence_positions(64, z, 4)
for got, full in zip([o] + [t.grad for t in mine], [out] + [t.grad for t in ref]):
    full = full.detach().index_select(2, pos)
    ok = ok and float((got.detach() - full).abs().max() / full.abs().max()) <= 1e-5
os.write(1, f"RING {g.rank} {ok}\n".encode())
axon4d.shutdown()
"""


@pytest.mark.slow  # an mpiexec -n 8 job
def test_the_ring_runs_on_the_mpi_transport(tmp_path):
    """The shift's Isend/Irecv pair and the ring attention over it, under mpiexec -n 8."""
    pytest.importorskip("mpi4py")
    import test_mpi

    if test_mpi._mpiexec() is None:
        pytest.skip("no mpiexec: install the [mpi] extra")
    script = tmp_path / "ring.py"
    script.write_text(MPI_RING)
    proc = test_mpi._run([str(script)], timeout=600)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("RING"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines == sorted(f"RING {r} True" for r in range(8)), proc.stdout[-3000:]


def test_the_training_job_runs_the_ring_mode_on_the_all_gather_mode_s_curve(pools, tmp_path):
    """``axon4d train --context-parallel --context-parallel-mode ring``: the same losses as the
    all-gather mode (fp32, within 1e-5); the mode without --context-parallel is refused."""
    from axon4d.train import TrainConfig
    from tests.test_train import _base, _run

    runs = {}
    for mode in ("all-gather", "ring"):
        cfg = _base(tmp_path / mode, grid="1,1,2,1", context_parallel=True, context_parallel_mode=mode)
        runs[mode] = pools(2).run(None, _run, cfg)[0]
    assert max(abs(a - b) / b for a, b in zip(runs["ring"], runs["all-gather"])) < 1e-5
    with pytest.raises(ValueError, match="--context-parallel-mode ring without --context-parallel"):
        TrainConfig(model="tiny", context_parallel_mode="ring").check()
