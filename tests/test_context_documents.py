"""Protects packed documents (docs/context.md, "Packed documents"; axon4d/data/documents.py,
axon4d/nn/context_documents.py):

- the layout: documents read from EOS tokens; bad layouts refused with a ValueError naming the rule;
- the spans: for every query chunk and key chunk, the spans the kernels run cover exactly the
  causal document mask (no pair twice, none missing, each causal span a square);
- the balance: one document gives head–tail back; packed ones are paired by attention work, and
  every rank's kernels attend exactly the (query, key) pairs of its chunks' work (no masked work);
- the reference: the one-process model with documents equals each document run on its own;
- exactness: under context parallelism in both modes (all-gather, ring) the logits, the loss and
  every gradient equal the one-process model with the same documents (fp32, ≤ 1e-5 relative), with
  GQA, rotary (Llama) and learned (GPT) positions, y and data splits, selective, balanced and full
  recomputation, on 8-rank grids with G_z = 4 — and at 16K tokens on (2,1,4,1) and (1,1,8,1);
  without context parallelism too (rows over data × z);
- the data path: ``axon4d train --packed-documents EOS`` follows the one-process run with the same
  documents, in both modes.
"""

import random

import pytest
import torch
from harness import value_errors
from test_context import TOL, grid_id, rel_err
from test_context_ring import LONG, LONG_LLAMA

from axon4d import activations
from axon4d.config import ModelConfig
from axon4d.data.documents import Documents, balance
from axon4d.device import attention as kernels
from axon4d.layout.geometry import Term
from axon4d.models.transformer import DenseTransformer, Transformer

SEQ = 32
LLAMA = ModelConfig(
    n_layers=2, hidden=32, n_heads=8, n_kv_heads=2, ffn_hidden=48, vocab_size=64, seq_len=SEQ, arch="llama"
)  # GQA ratio 4
GPT = ModelConfig(n_layers=2, hidden=32, n_heads=8, vocab_size=64, seq_len=SEQ, arch="gpt")
CONFIGS = {"llama": LLAMA, "gpt": GPT}
#: two rows of packed documents: boundaries inside chunks, on chunk edges, a document of one token
DOCS = Documents([[5, 11, 1, 3, 12], [20, 12]])


def test_documents_end_after_each_eos_token():
    eos = 9
    ids = torch.tensor([[1, 9, 2, 3, 9, 4], [9, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 9]])
    assert Documents.from_eos(ids, eos).lengths == ((2, 3, 1), (1, 5), (6,))
    docs = Documents([[2, 3, 1], [6]])
    assert docs.positions().tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert docs.rows(1, 2) == Documents([[6]])


def test_bad_layouts_are_refused_with_the_rule():
    dense = DenseTransformer(LLAMA)
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    msgs = value_errors(
        {
            "sums": lambda: Documents([[3, 5], [4, 5]]),
            "zero": lambda: Documents([[3, 0, 5]]),
            "fraction": lambda: Documents([[3.5, 4.5]]),
            "empty": lambda: Documents([]),
            "length": lambda: dense(ids, [[16, 8], [24]]),
            "rows": lambda: dense(ids, [[SEQ]]),
            "check": lambda: DOCS.check(2, 16, "the sequences to shard"),
        }
    )
    assert "sum to [8, 9]" in msgs["sums"] and "must sum to S" in msgs["sums"]
    assert "[3, 0, 5]" in msgs["zero"] and "[3.5, 4.5]" in msgs["fraction"] and "positive whole" in msgs["zero"]
    assert "one list of document lengths per sequence" in msgs["empty"]
    assert "2 sequences of 24 tokens" in msgs["length"] and "summing to 32" in msgs["length"]
    assert "describe 1 sequences of 32 tokens" in msgs["rows"] and "hold 2 sequences" in msgs["rows"]
    assert "the sequences to shard hold 2 sequences of 16 tokens" in msgs["check"]
    assert Documents(torch.tensor([[3, 5]])) == Documents([[3, 5]])


def test_each_rank_reads_its_documents_and_tokens_from_eos_tokens():
    """``rank_documents`` (the training job's batches): from a micro-batch (only its rows read) or a
    whole tensor, a rank's inputs, targets and documents are ``shard_sequence`` / ``shard_documents``
    of the whole batch's, under context parallelism over z and over z × data."""
    from test_data import _Rank, _same

    from axon4d.data.tokens import SyntheticTokens
    from axon4d.grid.shape import GridShape
    from axon4d.train.batches import MicroBatch, rank_documents

    data = SyntheticTokens(8, SEQ, seed=7, noise=0.5)  # vocabulary of 8: many tokens 0 end documents
    batch = data.global_batch(5, 4)
    full = batch.rows(0, 4)
    docs = Documents.from_eos(full[:, :-1], 0)
    assert all(len(row) > 1 for row in docs.lengths)
    for shape, axes in ((GridShape(1, 2, 4, 1), "z"), (GridShape(1, 1, 2, 2), "z"), (GridShape(1, 1, 2, 2), "z,data")):
        for rank in range(shape.world_size):
            grid = _Rank(shape, rank)
            want = [activations.shard_sequence(t, grid, documents=docs, axes=axes) for t in (full[:, :-1], full[:, 1:])]
            mine = activations.shard_documents(docs, grid, axes=axes)
            for source in (MicroBatch(batch, 0, 4), full):
                inputs, targets, got = rank_documents(source, grid, True, 0, axes)  # type: ignore[arg-type]
                assert _same(inputs, want[0]) and _same(targets, want[1]) and got == mine, (shape, axes, rank)


def _mask(docs: Documents, row: int) -> torch.Tensor:
    """(S, S) bool: query i sees key j — causal, within i's document."""
    s = docs.seq_len
    doc = torch.repeat_interleave(torch.arange(len(docs.lengths[row])), torch.tensor(docs.lengths[row]))
    return (doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()


def _random_docs(rng: random.Random, seq: int, rows: int, longest: int) -> Documents:
    out = []
    for _ in range(rows):
        row, left = [], seq
        while left:
            row.append(min(left, rng.randint(1, longest)))
            left -= row[-1]
        out.append(row)
    return Documents(out)


@pytest.mark.parametrize("g_z", [1, 2, 4])
def test_the_spans_cover_exactly_the_document_mask(g_z):
    rng = random.Random(g_z)
    parts, c = 2 * g_z, 6
    for longest in (1, 4, 7, 30, 100):
        docs = _random_docs(rng, parts * c, 3, longest)
        for row in range(docs.batch):
            mask = _mask(docs, row)
            for qc in range(parts):
                for kc in range(parts):
                    got = torch.zeros(c, c, dtype=torch.int)
                    for qa, qb, ka, kb, causal in docs.spans(row, qc, kc, c):
                        block = torch.ones(qb - qa, kb - ka, dtype=torch.int)
                        if causal:
                            assert (qa, qb) == (ka, kb) and qc == kc  # a square of the diagonal chunk
                            block = block.tril()
                        got[qa:qb, ka:kb] += block
                    want = mask[qc * c : (qc + 1) * c, kc * c : (kc + 1) * c]
                    assert torch.equal(got, want.int()), (docs, row, qc, kc)


def test_one_document_is_head_tail_and_packed_ones_are_handed_out_by_work():
    for g_z in (1, 2, 4, 8):
        # 4·G_z does not divide S = 6·G_z: two chunks per rank, head–tail for one document
        one = Documents([[6 * g_z]])
        assert one.per_rank(g_z) == 2 and balance(one, g_z) == pytest.approx(1.0)
        assert one.chunks(g_z) == (tuple((z, 2 * g_z - 1 - z) for z in range(g_z)),)
        # four chunks per rank where 4·G_z divides S; one document still balanced exactly
        four = Documents([[16 * g_z]])
        assert four.per_rank(g_z) == 4 and balance(four, g_z) == pytest.approx(1.0)
        held = sorted(k for z in range(g_z) for k in four.chunks(g_z)[0][z])
        assert held == list(range(4 * g_z))
    # two chunks per rank: the largest pair is the least any pairing of the chunks makes
    docs = Documents([[3, 14, 2, 9, 8]])
    assert docs.per_rank(2) == 2
    work = docs.chunk_work(0, 4)
    best = min(max(work[a] + work[b], work[c] + work[d]) for a, b, c, d in ((0, 1, 2, 3), (0, 2, 1, 3), (0, 3, 1, 2)))
    assert max(work[a] + work[b] for a, b in docs.chunks(2)[0]) == best
    with pytest.raises(ValueError, match="multiple of 8"):
        Documents([[3, 9]]).chunks(4)


def _balance_table():
    """docs/context.md's figures: max/mean attention work per z-rank at 16K tokens, 1 and 8 rows of
    documents of uniformly random length up to ``longest`` (seeded), head–tail against the
    work-balanced pairing."""
    table = {}
    for rows in (1, 8):
        rng = random.Random(rows)
        for longest in (1024, 4096, 16384):
            docs = _random_docs(rng, LONG, rows, longest)
            for g_z in (4, 8):
                table[rows, longest, g_z] = (balance(docs, g_z, head_tail=True), balance(docs, g_z))
    return table


def test_packed_documents_balance_better_than_head_tail():
    """``pytest tests/test_context_documents.py -k balance_better -s`` prints docs/context.md's table."""
    print("\nmax/mean attention work per z-rank, 16K tokens (head-tail, by work):")
    for (rows, longest, g_z), (head_tail, paired) in _balance_table().items():
        print(f"  {rows} rows, documents up to {longest}, G_z = {g_z}: {head_tail:.3f}, {paired:.3f}")
        assert paired <= head_tail + 1e-9
        assert paired < 1.07


def test_the_reference_runs_each_document_on_its_own():
    for cfg in (LLAMA, GPT):
        torch.manual_seed(1)
        dense = DenseTransformer(cfg)
        ids = torch.randint(0, cfg.vocab_size, (1, SEQ))
        got = dense(ids, [[5, 11, 16]])
        alone = torch.cat([dense(ids[:, a:b]) for a, b in ((0, 5), (5, 16), (16, SEQ))], dim=1)
        assert rel_err(got, alone) <= TOL
        assert rel_err(dense(ids), alone) > 0.01  # the documents matter


def _pairs_attended(grid):
    """The (query, key) pairs every attention kernel call of this rank computes (a causal square of
    L: L(L+1)/2), against its chunks' work, with packed documents and both modes."""
    torch.manual_seed(3)
    docs = DOCS.rows(0, 1)
    out = {}
    kernel = kernels.attention_with_lse
    for mode in ("all-gather", "ring"):
        pairs = [0]

        def counting(q, k, v, causal):
            n = q.shape[2]
            pairs[0] += n * (n + 1) // 2 if causal else n * k.shape[2]
            return kernel(q, k, v, causal)

        kernels.attention_with_lse = counting
        try:
            model = Transformer(LLAMA.replace(n_layers=1), context_parallel=mode)
            ids = torch.randint(0, 64, (1, SEQ))
            model(activations.shard_sequence(ids, documents=docs), docs)
        finally:
            kernels.attention_with_lse = kernel
        out[mode] = pairs[0]
    g_z = grid.size("z")
    work = docs.chunk_work(0, docs.per_rank(g_z) * g_z)
    return out, sum(work[k] for k in docs.chunks(g_z)[0][grid.coord("z")])


def _check(grid, cases):
    """Each case (cfg name, mode, recompute, context parallel) against one process with ``DOCS``:
    the largest relative error of the logits, the loss and every parameter gradient, and the tags of
    the key/value collectives that ran."""
    results = []
    for cfg_name, mode, recompute in cases:
        cfg = CONFIGS[cfg_name]
        torch.manual_seed(7)
        dense = DenseTransformer(cfg)
        model = Transformer.from_dense(dense, context_parallel=mode, recompute=recompute)
        ids, targets = (torch.randint(0, cfg.vocab_size, (2, SEQ)) for _ in range(2))
        ref = dense.loss(ids, targets, DOCS)
        ref.backward()
        grid.comm.log.clear()
        if mode:
            mine = activations.shard_documents(DOCS, grid)
            shard = lambda t: activations.shard_sequence(t, documents=DOCS)  # noqa: E731
            gather = lambda t: activations.gather_sequence(t, documents=DOCS)  # noqa: E731
        else:
            mine = activations.shard_documents(DOCS, grid, context_parallel=False)
            shard, gather = activations.shard_batch, activations.gather_batch
        loss = model.loss(shard(ids), shard(targets), mine)
        loss.backward()
        tags = {r.tag for r in grid.comm.log.records if r.tag.startswith("cp_kv")}
        errs = {"logits": rel_err(gather(activations.gather_features(model(shard(ids), mine), "y")), dense(ids, DOCS))}
        mean = grid.comm.all_reduce(loss.detach().reshape(1).clone(), "batch").wait() / grid.size("batch")
        errs["loss"] = rel_err(mean, ref.detach().reshape(1))
        got = dict(model.to_dense(grads=True).named_parameters())
        for name, p in dense.named_parameters():
            errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
        results.append((errs, tags))
    return results


KV_TAGS = {"all-gather": {Term.CP_KV, Term.CP_KV_GRAD}, "ring": {Term.CP_KV_RING, Term.CP_KV_RING_GRAD}, False: set()}


@pytest.mark.parametrize(
    "grid,cases",
    [
        ((1, 1, 2, 1), [("llama", "all-gather", "none"), ("llama", "ring", "none"), ("llama", "ring", "balanced")]),
        ((1, 2, 2, 1), [("llama", False, "none"), ("gpt", False, "selective")]),  # no context parallelism
        ((1, 2, 4, 1), [("llama", "all-gather", "none"), ("llama", "ring", "none")]),
        ((1, 1, 4, 2), [("llama", "ring", "selective"), ("gpt", "all-gather", "full")]),
    ],
    ids=grid_id,
)
def test_packed_documents_equal_the_single_process_model(pools, grid, cases):
    world = grid[0] * grid[1] * grid[2] * grid[3]
    for rank, per_case in enumerate(pools(world).run(grid, _check, cases)):
        for (cfg_name, mode, recompute), (errs, tags) in zip(cases, per_case):
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, f"{cfg_name} {mode} ({recompute}) on {grid} rank {rank}: {bad}"
            assert tags == (KV_TAGS[mode] if grid[2] > 1 else set()), tags


def test_each_rank_attends_exactly_its_chunks_work(pools):
    """No masked-out pair is computed: the kernels' (query, key) pairs on each rank are its two
    chunks' work, in both modes (an implementation masking whole blocks would compute more)."""
    for by_mode, work in pools(4).run((1, 1, 4, 1), _pairs_attended):
        assert by_mode == {"all-gather": work, "ring": work}


def _offloaded(grid):
    """The ring mode with every block offloaded (the offloader calls each block with the documents):
    the largest relative gradient error against one process."""
    torch.manual_seed(7)
    dense = DenseTransformer(LLAMA)
    model = Transformer(LLAMA, context_parallel="ring", offload=[0, 1]).load_dense_(dense)
    ids, targets = (torch.randint(0, LLAMA.vocab_size, (2, SEQ)) for _ in range(2))
    shard = lambda t: activations.shard_sequence(t, documents=DOCS)  # noqa: E731
    model.loss(shard(ids), shard(targets), activations.shard_documents(DOCS)).backward()
    dense.loss(ids, targets, DOCS).backward()
    got = dict(model.to_dense(grads=True).named_parameters())
    return max(rel_err(got[n].grad, p.grad) for n, p in dense.named_parameters())


def test_packed_documents_with_offloaded_blocks(pools):
    assert max(pools(2).run((1, 1, 2, 1), _offloaded)) <= TOL


def _on_kernels(grid):
    """The document attention alone (fp32, GQA 2:1, ``DOCS``) in both modes on the host kernel, then on
    stand-ins of the CUDA kernels keeping their contracts (test_context's: flash with native
    grouped-query heads and lse read contiguous; the memory-efficient kernel reading ``out`` in its
    own layout) and on fp32 matmuls: the largest relative error of out, dq, dk, dv against the host
    kernel's, per (mode, kernel), and whether the efficient kernel always got its layout."""
    from test_context import _cuda_kernels_on_host, _flash_on_host

    from axon4d.nn.context_documents import document_sequence_attention

    gen = torch.Generator().manual_seed(11)
    full = [torch.randn(2, h, SEQ, 8, generator=gen) for h in (4, 2, 2)]
    mine = activations.shard_documents(DOCS)
    q, k, v = (activations.shard_sequence(t.transpose(1, 2), documents=DOCS).transpose(1, 2) for t in full)
    grad = torch.randn(q.shape, generator=gen)

    def run(mode):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = document_sequence_attention(*leaves, grid, mine, ring=mode == "ring")
        return [out.detach(), *torch.autograd.grad(out, leaves, grad)]

    errs, layouts = {}, []
    for mode in ("all-gather", "ring"):
        want = run(mode)
        for kernel in (kernels.FLASH, kernels.EFFICIENT, kernels.MATH):
            patch = pytest.MonkeyPatch()
            if kernel == kernels.FLASH:
                _flash_on_host(patch, [])
            elif kernel == kernels.EFFICIENT:
                _cuda_kernels_on_host(patch, layouts)
            else:
                patch.setattr(kernels, "kernel_for", lambda q, k, causal: kernels.MATH)
            try:
                errs[mode, kernel] = max(rel_err(a, b) for a, b in zip(run(mode), want))
            finally:
                patch.undo()
    return errs, bool(layouts) and all(layouts)


def test_the_spans_run_on_the_gpu_kernels_stood_in_for_on_the_host(pools):
    """The CUDA branches of the kernel seam (flash, memory-efficient) and the fp32 matmuls, each on
    the document spans' strided views of queries and keys, equal the host kernel (fp32, both modes)."""
    for errs, layouts in pools(2).run((1, 1, 2, 1), _on_kernels):
        assert all(e <= TOL for e in errs.values()), errs
        assert layouts


def _long_docs():
    """One row of 16K tokens packed with documents of up to 6000 tokens (seeded)."""
    return _random_docs(random.Random(5), LONG, 1, 6000)


def _long_documents(grid):
    """Loss and every parameter's gradient of the GQA Llama at 16K tokens with packed documents, in
    both modes (rank 0's dense copies); the reference runs once, in the test's process."""
    docs = _long_docs()
    out = {}
    for mode in ("all-gather", "ring"):
        torch.manual_seed(7)
        dense = DenseTransformer(LONG_LLAMA)
        ids, targets = (torch.randint(0, LONG_LLAMA.vocab_size, (1, LONG)) for _ in range(2))
        model = Transformer.from_dense(dense, context_parallel=mode)
        del dense
        mine = activations.shard_documents(docs, grid)
        loss = model.loss(
            activations.shard_sequence(ids, documents=docs), activations.shard_sequence(targets, documents=docs), mine
        )
        loss.backward()
        grads = {n: p.grad for n, p in model.to_dense(grads=True).named_parameters()}
        out[mode] = (loss.detach(), grads if grid.rank == 0 else None)
    return out


@pytest.mark.slow  # 16K tokens, 8 ranks, both modes: ~40 s
@pytest.mark.parametrize("grid", [(2, 1, 4, 1), (1, 1, 8, 1)], ids=grid_id)
def test_a_gqa_llama_at_16k_tokens_with_packed_documents_equals_one_process(pools, grid):
    docs = _long_docs()
    assert len(docs.lengths[0]) > 3
    torch.manual_seed(7)
    dense = DenseTransformer(LONG_LLAMA)
    ids, targets = (torch.randint(0, LONG_LLAMA.vocab_size, (1, LONG)) for _ in range(2))
    ref = dense.loss(ids, targets, docs)
    ref.backward()
    results = pools(8).run(grid, _long_documents, timeout=600)
    for mode in ("all-gather", "ring"):
        loss = torch.stack([r[mode][0] for r in results]).mean()  # as many tokens on every rank
        assert rel_err(loss, ref.detach()) <= TOL, f"{mode}: loss {float(loss)} vs {float(ref)}"
        got = results[0][mode][1]
        for name, p in dense.named_parameters():
            assert rel_err(got[name], p.grad) <= TOL, f"{mode}: {name}.grad"


def test_the_training_job_trains_packed_documents_as_one_process(pools, tmp_path):
    """``axon4d train --packed-documents 0`` (vocabulary of 8: about one token in 8 ends a document)
    with context parallelism in both modes follows the one-process run with the same documents
    (--compare-single, fp32, within 1e-5), and differs from the run without documents."""
    from axon4d.train import TrainConfig, train
    from tests.test_train import _base

    def cfg(name, **kw):
        return _base(tmp_path / name, grid="1,1,2,1", vocab_size=8, seq_len=16, batch_size=2, steps=2, **kw)

    summaries = {
        mode: pools(2).run(
            None,
            _summary,
            cfg(mode, context_parallel=True, context_parallel_mode=mode, packed_documents=0, compare_single=True),
        )[0]
        for mode in ("all-gather", "ring")
    }
    plain = pools(2).run(None, _summary, cfg("plain", context_parallel=True))[0]
    for mode, summary in summaries.items():
        assert summary["max_rel_diff"] < 1e-5, (mode, summary["losses"], summary["single_process_losses"])
    assert summaries["ring"]["losses"] != plain["losses"]
    with pytest.raises(ValueError, match="--packed-documents -2"):
        TrainConfig(model="tiny", packed_documents=-2).check()
    del train


def _summary(cfg_dict):
    from axon4d.train import TrainConfig, train

    return train(TrainConfig(**cfg_dict))
