"""Protects gradient accumulation and the replicated parameters' gradients in the overlap scheduler
(axon4d/scheduler, docs/design.md §4): over M micro-batches the data-axis reductions (E12, E13,
the replicated gradients over batch) run once per step — the data and batch axes move the same
bytes for M = 1 and M = 4 while E11 over z runs per micro-batch — and the gradients equal the
single-process model's over the same micro-batches, under every overlap policy; replicated
gradients are bucketed by kind (one all-reduce per bucket in the comm log), waited only when the
backward ends, and added to a gradient already in ``.grad`` (no zeroing between backward passes)."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from axon4d.layout.geometry import Term
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.train.batches import accumulate
from tests.test_blocks import GPT, LLAMA, TOL, _assert_small, _grad_errors

REPLICATED = (Term.NORM_GRAD, Term.EMBEDDING_GRAD, Term.POSITION_GRAD)
POLICIES = ["off", "all", "all,bucket_mb=64", "ors,ors_inflight=2"]


def _step(grid, cfg, micro, policy):
    """One step's gradients over ``micro`` micro-batches of 16 sequences: (errors against the dense
    model's, payload bytes per (axis, tag), records per tag)."""
    grid.scheduler.configure(policy)
    torch.manual_seed(7)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense)
    ids = torch.randint(0, cfg.vocab_size, (16, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    batches = ids.chunk(micro)
    grid.comm.log.clear()
    accumulate(model, batches, grid)
    records = grid.comm.log.records
    accumulate(dense, batches, None)
    nbytes = Counter()
    for r in records:
        nbytes[(r.axis, str(r.tag))] += r.payload_bytes
    return _grad_errors(dense, model.to_dense(grads=True)), nbytes, Counter(str(r.tag) for r in records)


def _accumulation(grid, cfg):
    out = {}
    for policy in POLICIES:
        one_err, one_bytes, _ = _step(grid, cfg, 1, policy)
        four_err, four_bytes, _ = _step(grid, cfg, 4, policy)
        out[policy] = (one_err, four_err, one_bytes, four_bytes)
    return out


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize(
    "world,grid",
    [
        (2, (1, 1, 1, 2)),
        (4, (1, 1, 2, 2)),
        pytest.param(8, (2, 1, 2, 2), marks=pytest.mark.slow),
        pytest.param(8, (1, 2, 2, 2), marks=pytest.mark.slow),
    ],
)
def test_micro_batches_reduce_over_data_once_and_match_the_dense_model(pools, cfg, world, grid):
    for rank in pools(world).run(grid, _accumulation, cfg):
        for policy, (one_err, four_err, one_bytes, four_bytes) in rank.items():
            _assert_small([one_err, four_err], TOL, f"{cfg.arch} on {grid} under {policy!r}")
            for axis in ("data", "batch"):  # the step's data-axis bytes do not depend on M
                one = {k: v for k, v in one_bytes.items() if k[0] == axis}
                assert one and one == {k: v for k, v in four_bytes.items() if k[0] == axis}, (policy, axis)
            if grid[2] > 1:  # E11 over z still runs once per micro-batch
                assert four_bytes[("z", "E11")] == 4 * one_bytes[("z", "E11")] > 0


def _bucketing(grid, cfg):
    counts = {}
    for policy in ("all,bucket_mb=0", "all,bucket_mb=64", "off"):
        _, _, counts[policy] = _step(grid, cfg, 1, policy)
    # the replicated gradients are waited on only when the backward ends: after the last dW GEMM
    _step(grid, cfg, 1, "all,bucket_mb=64")
    last_dw = max(end for name, _, end in grid.comm.log.spans if name == "bwd.dW")
    waits = [r.t_wait_start for r in grid.comm.log.records if r.tag in REPLICATED]
    return counts, bool(waits) and all(w is not None and w > last_dw for w in waits)


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_replicated_gradients_are_bucketed_by_kind_and_waited_at_the_end(pools, cfg):
    norms = cfg.n_layers * 2 + 1
    tensors = {Term.NORM_GRAD: norms * (2 if cfg.arch == "gpt" else 1), Term.EMBEDDING_GRAD: 1}
    if cfg.arch == "gpt":
        tensors[Term.POSITION_GRAD] = 1
    for counts, waited_late in pools(2).run((1, 1, 1, 2), _bucketing, cfg):
        for tag, n in tensors.items():
            assert counts["all,bucket_mb=0"][str(tag)] == n  # one all-reduce per tensor
            assert counts["all,bucket_mb=64"][str(tag)] == 1  # one per kind: the tiny model fits a bucket
            assert counts["off"][str(tag)] == n  # off: no buckets
        assert waited_late


def _twice(grid, cfg):
    """Two backward passes into the same .grad with no zeroing, the second accumulating."""
    torch.manual_seed(7)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense)
    gen = torch.Generator().manual_seed(2)
    first, second = (torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=gen) for _ in range(2))
    for m, g in ((model, grid), (dense, None)):
        accumulate(m, (first,), g)  # reduced at once
        accumulate(m, (second, first, second), g)  # two held micro-batches, then the reducing one
    return _grad_errors(dense, model.to_dense(grads=True))


@pytest.mark.parametrize("world,grid", [(2, (1, 1, 1, 2)), (4, (2, 1, 1, 2))])
def test_gradients_already_in_grad_are_added_to(pools, world, grid):
    _assert_small(pools(world).run(grid, _twice, LLAMA), TOL, f"llama on {grid}")


def _persistent_buckets(grid, cfg):
    """Three steps under 64 MB buckets (the third of two micro-batches): per step, the errors
    against the dense model, the number of distinct storages the weight shards' gradients are
    slices of, the E12 all-reduces, and the concatenations of the shards into a bucket."""
    grid.scheduler.configure("all,bucket_mb=64")
    torch.manual_seed(7)
    dense = DenseTransformer(cfg)
    model = Transformer.from_dense(dense)
    gen = torch.Generator().manual_seed(3)
    out = []
    for step in range(3):
        ids = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=gen)
        batches = ids.chunk(2 if step == 2 else 1)
        for m in (model, dense):
            m.zero_grad(set_to_none=True)
        grid.comm.log.clear()
        with _CountCats(sum(p.numel() for p in _shards(model))) as cats:
            accumulate(model, batches, grid)
        accumulate(dense, batches, None)
        storages = {p.grad.untyped_storage().data_ptr() for p in _shards(model)}
        e12 = sum(1 for r in grid.comm.log.records if r.tag == Term.E12)
        out.append((_grad_errors(dense, model.to_dense(grads=True)), len(storages), e12, cats.count))
    return out


def _shards(model):
    return [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 1 and "norm" not in n]


class _CountCats(TorchDispatchMode):
    """Counts the concatenations whose result has ``numel`` elements (the shards' bucket)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default and out.numel() == self.numel:
            self.count += 1
        return out


@pytest.mark.parametrize("world,grid", [(2, (1, 1, 1, 2)), (4, (1, 1, 2, 2))])
def test_bucketed_shards_are_written_in_place_from_the_second_step(pools, world, grid):
    for steps in pools(world).run(grid, _persistent_buckets, LLAMA):
        _assert_small([errs for errs, _, _, _ in steps], TOL, f"llama on {grid}")
        assert [e12 for _, _, e12, _ in steps] == [1, 1, 1]  # the tiny model's shards fill one bucket
        assert [n for _, n, _, _ in steps] == [1, 1, 1]  # every shard's gradient a slice of it
        # step 1 concatenates its shards; from step 2 the reduce-scatters (G_z > 1) or the dW GEMMs
        # (G_z = 1) write into the buffer learned from the step before: no concatenation
        assert [cats for _, _, _, cats in steps] == [1, 0, 0]
