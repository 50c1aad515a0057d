"""Protects hierarchical context parallelism (docs/context.md, "Hierarchical: z and data"): each
sequence split over z × data together (``context_parallel_axes="z,data"``, the ``batch`` axis).

- the option: "z" and "z,data" (any spelling of the pair) name z and batch; anything else, or the
  axes without context parallelism, is a ValueError naming the choices;
- exactness: every rank holds every sequence's chunks (data ranks share sequences), and the logits,
  the loss and every gradient equal the one-process model (fp32, ≤ 1e-5 relative) in both modes,
  with and without packed documents, on (1,1,2,2), (1,2,2,2) and (1,1,4,2) (G = 4 and 8), under
  selective and full recomputation, and at 16K tokens on (1,1,4,2); the key/value collectives run
  over batch, not z; the training job with ``--context-parallel-axes z,data``;
- the layout: the chunks each rank holds and ``gather_sequence`` putting them back.
"""

import pytest
import torch
from harness import value_errors
from test_context import TOL, grid_id, rel_err
from test_context_documents import DOCS, LLAMA, SEQ, _long_docs
from test_context_ring import LONG, LONG_LLAMA

from axon4d import activations
from axon4d.layout.geometry import Term
from axon4d.models.transformer import DenseTransformer, Transformer

AXES = "z,data"


def test_the_axes_option_names_z_or_z_and_data():
    assert activations.context_axis("z") == "z"
    for spelling in ("z,data", "data,z", "z·data", " z , data "):
        assert activations.context_axis(spelling) == "batch"
    msgs = value_errors(
        {
            "x": lambda: activations.context_axis("x"),
            "off": lambda: Transformer(LLAMA, context_parallel_axes=AXES, device="meta"),
        }
    )
    assert "'z' (sequences over data) or 'z,data'" in msgs["x"]
    assert "without context_parallel" in msgs["off"]


def _check(grid, cases):
    """Each case (mode, recompute, packed documents) against one process: the largest relative error
    of the logits, the loss and every gradient, and the (tag, axis) of the key/value collectives."""
    out = []
    for mode, recompute, packed in cases:
        torch.manual_seed(7)
        dense = DenseTransformer(LLAMA)
        model = Transformer.from_dense(dense, context_parallel=mode, context_parallel_axes=AXES, recompute=recompute)
        ids, targets = (torch.randint(0, LLAMA.vocab_size, (2, SEQ)) for _ in range(2))
        docs = DOCS if packed else None
        ref = dense.loss(ids, targets, docs)
        ref.backward()
        shard = lambda t: activations.shard_sequence(t, documents=docs, axes=AXES)  # noqa: E731
        mine = None if docs is None else activations.shard_documents(docs, axes=AXES)
        grid.comm.log.clear()
        loss = model.loss(shard(ids), shard(targets), mine)
        loss.backward()
        kv = {(r.tag, r.axis) for r in grid.comm.log.records if r.tag.startswith("cp_kv")}
        logits = activations.gather_features(model(shard(ids), mine), "y")
        errs = {"logits": rel_err(activations.gather_sequence(logits, documents=docs, axes=AXES), dense(ids, docs))}
        mean = grid.comm.all_reduce(loss.detach().reshape(1).clone(), "batch").wait() / grid.size("batch")
        errs["loss"] = rel_err(mean, ref.detach().reshape(1))
        got = dict(model.to_dense(grads=True).named_parameters())
        for name, p in dense.named_parameters():
            errs[f"{name}.grad"] = rel_err(got[name].grad, p.grad)
        out.append((errs, kv, shard(torch.arange(SEQ)[None].expand(2, SEQ)).tolist()))
    return out


KV = {
    "all-gather": {(Term.CP_KV, "batch"), (Term.CP_KV_GRAD, "batch")},
    "ring": {(Term.CP_KV_RING, "batch"), (Term.CP_KV_RING_GRAD, "batch")},
}


@pytest.mark.parametrize(
    "grid,cases",
    [
        ((1, 1, 2, 2), [("all-gather", "none", False), ("ring", "none", False), ("ring", "selective", True)]),
        ((1, 2, 2, 2), [("all-gather", "full", True), ("ring", "none", True)]),
        ((1, 1, 4, 2), [("all-gather", "none", False), ("ring", "none", False), ("all-gather", "none", True)]),
    ],
    ids=grid_id,
)
def test_a_sequence_split_over_z_and_data_equals_one_process(pools, grid, cases):
    world = grid[0] * grid[1] * grid[2] * grid[3]
    g = grid[2] * grid[3]
    for rank, per_case in enumerate(pools(world).run(grid, _check, cases)):
        for (mode, recompute, packed), (errs, kv, held) in zip(cases, per_case):
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, f"{mode} ({recompute}, documents {packed}) on {grid} rank {rank}: {bad}"
            assert kv == KV[mode], kv
            assert len(held) == 2 and len(held[0]) == SEQ // g  # every sequence, S/(G_z·G_data) tokens of each
            if not packed:  # head–tail over the batch coordinate d·G_z + z
                r = (rank // (grid[0] * grid[1] * grid[2])) * grid[2] + (rank // (grid[0] * grid[1])) % grid[2]
                assert held[0] == activations.sequence_positions(SEQ, r, g).tolist()


LONG_CASES = (("all-gather", False), ("ring", True))  # (mode, packed documents)


def _long(grid):
    """Loss and every gradient (rank 0's) of the GQA Llama at 16K tokens split over z × data, per case."""
    out = {}
    for mode, packed in LONG_CASES:
        torch.manual_seed(7)
        dense = DenseTransformer(LONG_LLAMA)
        ids, targets = (torch.randint(0, LONG_LLAMA.vocab_size, (1, LONG)) for _ in range(2))
        model = Transformer.from_dense(dense, context_parallel=mode, context_parallel_axes=AXES)
        del dense
        docs = _long_docs() if packed else None
        shard = lambda t: activations.shard_sequence(t, documents=docs, axes=AXES)  # noqa: E731
        loss = model.loss(shard(ids), shard(targets), docs)
        loss.backward()
        grads = {n: p.grad for n, p in model.to_dense(grads=True).named_parameters()}
        out[mode, packed] = (loss.detach(), grads if grid.rank == 0 else None)
    return out


@pytest.mark.slow  # 16K tokens, 8 ranks, two cases: ~40 s
def test_a_gqa_llama_at_16k_tokens_split_over_z_and_data_equals_one_process(pools):
    """(1,1,4,2), G = 8: all-gathered, and the ring with packed documents."""
    results = pools(8).run((1, 1, 4, 2), _long, timeout=600)
    for mode, packed in LONG_CASES:
        torch.manual_seed(7)
        dense = DenseTransformer(LONG_LLAMA)
        ids, targets = (torch.randint(0, LONG_LLAMA.vocab_size, (1, LONG)) for _ in range(2))
        ref = dense.loss(ids, targets, _long_docs() if packed else None)
        ref.backward()
        loss = torch.stack([r[mode, packed][0] for r in results]).mean()  # as many tokens on every rank
        assert rel_err(loss, ref.detach()) <= TOL, f"{mode}: loss {float(loss)} vs {float(ref)}"
        got = results[0][mode, packed][1]
        for name, p in dense.named_parameters():
            assert rel_err(got[name], p.grad) <= TOL, f"{mode}: {name}.grad"


def _summary(cfg_dict):
    from axon4d.train import TrainConfig, train

    return train(TrainConfig(**cfg_dict))


def test_the_training_job_splits_sequences_over_z_and_data(pools, tmp_path):
    """``axon4d train --context-parallel --context-parallel-axes z,data`` on (1,1,2,2) follows the
    one-process run (--compare-single, fp32, within 1e-5): all-gathered, and the ring with packed documents;
    the axes without --context-parallel are refused."""
    from axon4d.train import TrainConfig
    from tests.test_train import _base

    runs = {
        (mode, eos): dict(context_parallel=True, context_parallel_mode=mode, packed_documents=eos)
        for mode, eos in (("all-gather", -1), ("ring", 0))
    }
    for (mode, eos), kw in runs.items():
        cfg = _base(
            tmp_path / f"{mode}{eos}",
            grid="1,1,2,2",
            vocab_size=8,
            seq_len=16,
            batch_size=2,
            steps=2,
            compare_single=True,
            context_parallel_axes=AXES,
            **kw,
        )
        summary = pools(4).run(None, _summary, cfg)[0]
        assert summary["max_rel_diff"] < 1e-5, (mode, eos, summary["losses"], summary["single_process_losses"])
    with pytest.raises(ValueError, match="--context-parallel-axes z,data: give z or z,data, with --context-parallel"):
        TrainConfig(model="tiny", context_parallel_axes=AXES).check()
