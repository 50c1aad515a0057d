"""Protects the overlap scheduler (axon4d/overlap.py, docs/design.md §4): with any mechanism on — OAG
(and keep-for-backward), OAR, ORS, ODP (per layer and bucketed), chunked forward all-reduce — or all
of them, several training steps give the same outputs and gradients as with overlap off (bitwise
in fp32 where the reduction order is unchanged), .grad is complete when backward() returns
(also when micro-batches accumulate), and the collectives issued are exactly what
axon4d.layout.geometry says for that policy."""

from collections import Counter

import pytest
import torch

import axon4d
from axon4d.config import get_config
from axon4d.device import environment
from axon4d.layout.geometry import Op, Term, linear_collectives, weight_block_shape
from axon4d.options.overlap_policy import OverlapPolicy
from axon4d.plan import Workload, load
from axon4d.plan.layers import collectives
from axon4d.plan.scenario import Scenario

# a transformer-shaped chain: normal → transposed → normal → transposed
SPECS = [(32, 48, True, False), (48, 32, True, True), (32, 64, False, False), (64, 32, True, True)]
LEAD = (8, 6)  # (batch, sequence)
CHUNKED = dict(forward_chunks=3, min_chunk_kb=0)  # tiny test tensors: chunk anyway

POLICIES = {
    "off": OverlapPolicy.off(),
    "oag": OverlapPolicy.only("oag"),
    "oag_keep": OverlapPolicy.only("oag", oag_keep=True),
    "oag_deep": OverlapPolicy.only("oag", oag_depth=3),  # three layers' blocks gathered ahead
    "oar": OverlapPolicy.only("oar"),
    "ors": OverlapPolicy.only("ors"),
    "ors_deep": OverlapPolicy.only("ors", ors_inflight=3),  # three reduce-scatters left in flight
    "odp": OverlapPolicy.only("odp"),
    "odp_bucket": OverlapPolicy.only("odp", bucket_mb=1.0),
    "chunks": OverlapPolicy.only("chunks", **CHUNKED),
    "all": OverlapPolicy(**CHUNKED),
    "all_keep_bucket": OverlapPolicy(oag_keep=True, bucket_mb=1.0, **CHUNKED),
    "all_deep_bucket": OverlapPolicy(ors_inflight=2, oag_depth=2, bucket_mb=1.0, **CHUNKED),
}
# the only policies that change the order of a floating-point reduction
REORDERING = {"chunks", "all", "all_keep_bucket", "all_deep_bucket", "odp_bucket"}


def _train(grid, policy, steps=3, input_grad=True):
    """Run ``steps`` SGD steps of the chain under ``policy``; return outputs, grads and the log of
    the last step. Step 0 accumulates two micro-batches into .grad before the update."""
    grid.scheduler.configure(policy)
    torch.manual_seed(0)
    layers = [axon4d.Linear(i, o, bias=b, transpose=t) for i, o, b, t in SPECS]
    params = [p for layer in layers for p in layer.parameters()]
    v = axon4d.shard_features(torch.randn(SPECS[-1][1]), layers[-1].out_axis)
    outs, grads, tags = [], [], []
    for step in range(steps):
        grid.comm.log.clear()
        for _ in range(2 if step == 0 else 1):
            x = axon4d.shard_input(torch.randn(*LEAD, SPECS[0][0])).requires_grad_(input_grad)
            y = x
            for layer in layers:
                y = layer(y)
            (y * v).sum().div(y.numel() // y.shape[-1]).backward()
            outs.append(y.detach().clone())
        grads.append([p.grad.clone() for p in params])  # complete as soon as backward() returned
        tags.append([r.tag for r in grid.comm.log.records])
        with torch.no_grad():
            for p in params:
                p -= 0.1 * p.grad
                p.grad = None
    counted = Counter((r.op, r.axis, r.payload_bytes) for r in grid.comm.log.records)
    return {"outs": outs, "grads": grads, "counted": counted, "tags": tags}


def _all_policies(grid):
    return {name: _train(grid, policy) for name, policy in POLICIES.items()}


def _expected(shape, policy):
    tokens = LEAD[0] * LEAD[1] // shape.size("batch")
    expected = Counter()
    for i, o, b, t in SPECS:
        for c in linear_collectives(
            i,
            o,
            tokens,
            shape,
            transpose=t,
            bias=b,
            cache_weight=policy.oag_keep,
            forward_chunks=policy.forward_chunks,
            min_chunk_bytes=policy.chunking(accelerator=False)[0],
        ):
            expected[(c.op, c.axis, c.payload_bytes)] += 1
    bucketed = policy.bucket_bytes(accelerator=False) > 0
    # every shard fits one bucket: one all-reduce per step over data (E12, under ORS or ODP) and,
    # under ODP, one over batch of the biases (E13)
    for axis, on in (("data", shape.data > 1), ("batch", shape.size("batch") > 1 and policy.odp)):
        if bucketed and on:
            merged = [(k, n) for k, n in expected.items() if k[1] == axis]
            for k, _ in merged:
                del expected[k]
            expected[(Op.ALL_REDUCE, axis, sum(k[2] * n for k, n in merged))] += 1
    return expected


@pytest.mark.parametrize("grid", [(2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 2, 2)])
@pytest.mark.slow
def test_every_mechanism_alone_and_all_together_give_the_gradients_of_overlap_off(pools, grid):
    shape = axon4d.GridShape(*grid)
    for rank, res in enumerate(pools(8).run(grid, _all_policies, timeout=300)):
        ref = res["off"]
        for name, got in res.items():
            assert got["counted"] == _expected(shape, POLICIES[name]), f"{name}: bytes differ from volume"
            pairs = list(zip(got["outs"], ref["outs"])) + [
                (g, r) for gs, rs in zip(got["grads"], ref["grads"]) for g, r in zip(gs, rs)
            ]
            for g, r in pairs:
                if name in REORDERING:
                    torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=f"{name} rank {rank}")
                else:
                    assert torch.equal(g, r), f"{name} on grid {grid} rank {rank}: not bitwise equal"


@pytest.mark.slow
def test_oag_prefetches_the_next_layers_weight_from_the_second_step_on(pools):
    res = pools(8).run((2, 2, 2, 1), _all_policies, timeout=300)[0]

    def gathers_before_first_forward_all_reduce(tags):
        return tags[: tags.index(Term.E8)].count(Term.E10F)

    assert [gathers_before_first_forward_all_reduce(t) for t in res["off"]["tags"]] == [1, 1, 1]
    assert [gathers_before_first_forward_all_reduce(t) for t in res["oag"]["tags"]] == [1, 2, 2]
    # oag_depth=3: the first layer's block and the next three layers' (all of them) before any E8
    assert [gathers_before_first_forward_all_reduce(t) for t in res["oag_deep"]["tags"]] == [1, 4, 4]
    # keep-for-backward: the backward pass issues no gather at all
    keep = res["oag_keep"]["tags"][-1]
    assert keep.count(Term.E10F) == len(SPECS) and Term.E10B not in keep


def _without_input_grad(grid):
    return {name: _train(grid, POLICIES[name], input_grad=False)["counted"] for name in ("off", "oag", "oag_deep")}


@pytest.mark.slow
def test_oag_prefetches_nothing_a_backward_does_not_use(pools):
    # the first layer's input needs no gradient: its backward gathers no weight, so none is prefetched
    for counted in pools(8).run((2, 2, 2, 1), _without_input_grad):
        assert counted["oag"] == counted["off"] == counted["oag_deep"]


def _forward_matmuls(grid):
    """Forward GEMM spans of one normal (E8 over x) and one transposed (E8 over y) layer."""
    torch.manual_seed(0)
    counts = {}
    for transpose in (False, True):
        layer = axon4d.Linear(32, 32, transpose=transpose, grid=grid)
        x = torch.randn(12, 32 // grid.size("y" if transpose else "x"))
        grid.comm.log.clear()
        layer(x)
        counts[transpose] = sum(name == "fwd.matmul" for name, _, _ in grid.comm.log.spans)
    return counts


def test_forward_chunks_only_where_the_forward_all_reduce_has_peers(pools):
    # chunking splits the GEMM so each chunk's all-reduce overlaps the next; with no peer on the
    # layer's input axis there is no all-reduce, and the GEMM stays whole
    for counts in pools(2).run((2, 1, 1, 1), _forward_matmuls, overlap=OverlapPolicy(**CHUNKED)):
        assert counts == {False: 3, True: 1}
    for counts in pools(2).run((1, 2, 1, 1), _forward_matmuls, overlap=OverlapPolicy(**CHUNKED)):
        assert counts == {False: 1, True: 3}


def _policy_from_init(grid):
    return grid.scheduler.policy


def test_init_overlap_argument_and_context_manager(pools):
    for policy in pools(2).run((1, 1, 2, 1), _policy_from_init, overlap="oar,chunks"):
        assert policy == OverlapPolicy.only("oar", "chunks")
    for policy in pools(2).run((1, 1, 2, 1), _policy_from_init, overlap=False):
        assert policy == OverlapPolicy.off()


def test_policy_parsing_and_errors():
    assert OverlapPolicy.parse(None) == OverlapPolicy() == OverlapPolicy.parse("all")
    assert OverlapPolicy.parse({"oag": False}).oag is False
    with pytest.raises(ValueError, match="unknown overlap mechanisms \\['bogus'\\]"):
        OverlapPolicy.parse("oag,bogus")
    with pytest.raises(ValueError, match="unknown overlap options"):
        OverlapPolicy.parse({"bucket": 3})
    for bad in (dict(forward_chunks=0), dict(ors_inflight=0), dict(oag_depth=0)):
        with pytest.raises(ValueError, match="forward_chunks, ors_inflight and oag_depth must be >= 1"):
            OverlapPolicy(**bad)
    # strings carry knobs; with no mechanism named they tune the all-on policy
    assert OverlapPolicy.parse("all,oag_depth=3") == OverlapPolicy(oag_depth=3) == OverlapPolicy.parse("oag_depth=3")
    assert OverlapPolicy.parse("oag,ors,ors_inflight=2") == OverlapPolicy.only("oag", "ors", ors_inflight=2)
    assert OverlapPolicy.parse("chunks=8") == OverlapPolicy.only("chunks", forward_chunks=8)
    assert OverlapPolicy.parse("oag,keep") == OverlapPolicy.only("oag", oag_keep=True)
    assert OverlapPolicy.parse("all,oag_keep=1").oag_keep is True
    # knobs whose default is the automatic choice (None) take a value or "none"
    assert OverlapPolicy.parse("all,min_chunk_kb=0") == OverlapPolicy(min_chunk_kb=0.0)
    assert OverlapPolicy.parse("all,chunk_rows=64,min_chunk_kb=none") == OverlapPolicy(chunk_rows=64)
    with pytest.raises(ValueError, match=r"min_chunk_kb='x', expected a number or none"):
        OverlapPolicy.parse("all,min_chunk_kb=x")
    for policy in [
        OverlapPolicy(),
        OverlapPolicy.off(),
        OverlapPolicy.only("oag", oag_keep=True, oag_depth=2),
        OverlapPolicy(ors_inflight=3, forward_chunks=8),
        OverlapPolicy(bucket_mb=25.0, min_chunk_kb=0.5, chunk_rows=64),
        OverlapPolicy.only("odp", bucket_mb=0.0),
    ]:
        assert OverlapPolicy.parse(policy.spec()) == policy  # the planner's description reads back
    for bad, message in [
        ("oag,depth=2", "'depth' is not a knob"),
        ("oag_depth=x", "oag_depth='x', expected an integer"),
        ("off,oag", "'off' takes no mechanisms"),
        ("", "name 'all', 'off'"),
        ("oag=1", "'oag' is not a knob"),
    ]:
        with pytest.raises(ValueError, match=message):
            OverlapPolicy.parse(bad)
    # chunking: never below min_chunk_kb, never more chunks than rows, none without a peer
    assert OverlapPolicy(forward_chunks=4).chunk_count(1024, 4096, 2) == 4
    assert OverlapPolicy(forward_chunks=4).chunk_count(8, 40, 2) == 1
    assert OverlapPolicy(forward_chunks=4, min_chunk_kb=0).chunk_count(3, 40, 2) == 3
    assert OverlapPolicy(forward_chunks=4).chunk_count(1024, 4096, 1) == 1


def test_buckets_follow_the_device():
    """Where the policy leaves it to the device: one tensor per bucket on the host, 25 MiB on an
    accelerator (``DEVICE_BUCKET_MB``); the policy's own size wins on both; the grid's scheduler and
    ZeRO's buckets read the same size, and the planner prices its machine's device's."""
    policy = OverlapPolicy()
    assert policy.bucket_bytes(accelerator=False) == 0
    assert policy.bucket_bytes(accelerator=True) == 25 * 2**20
    for accelerator in (False, True):
        assert OverlapPolicy(bucket_mb=4).bucket_bytes(accelerator) == 4 * 2**20
        assert OverlapPolicy(bucket_mb=0).bucket_bytes(accelerator) == 0
    assert OverlapPolicy.parse("all,bucket_mb=none") == policy
    assert OverlapPolicy.parse("all,bucket_mb=0.5").bucket_bytes(accelerator=True) == 2**19
    with pytest.raises(ValueError, match="bucket_mb"):
        OverlapPolicy(bucket_mb=-1)


def test_forward_chunks_follow_the_device():
    """Where the policy leaves it to the device: on the host 256 KiB chunks of any rows; on an
    accelerator at least 1 MiB and whole blocks of 128 rows (GEMM tiles), the rest in the last
    chunk; the policy's own knobs win; the planner prices the chunks its machine's device makes."""
    policy = OverlapPolicy(forward_chunks=4)
    assert policy.chunking(accelerator=False) == (256 * 1024, 1)
    assert policy.chunking(accelerator=True) == (1024 * 1024, 128)
    assert OverlapPolicy(min_chunk_kb=64, chunk_rows=8).chunking(accelerator=True) == (64 * 1024, 8)
    row = 7168 * 2  # a 20B-wide bf16 row
    assert policy.chunk_sizes(4096, row, 2, accelerator=True) == [1024] * 4
    uneven = policy.chunk_sizes(1000, row, 2, accelerator=True)  # 7 blocks of 128 and 104 rows
    assert uneven == [256, 256, 256, 232] and sum(uneven) == 1000
    assert policy.chunk_sizes(1000, row, 2, accelerator=False) == [250] * 4
    assert policy.chunk_sizes(200, row, 2, accelerator=True) == [200]  # one block: no split
    assert policy.chunk_sizes(4096, 64, 2, accelerator=True) == [4096]  # 256 KiB in all: under 1 MiB
    for tokens in (1, 127, 128, 129, 1000, 4095, 8192):
        for accelerator in (False, True):
            sizes = policy.chunk_sizes(tokens, row, 2, accelerator)
            assert sum(sizes) == tokens and all(n > 0 for n in sizes)
            assert not accelerator or all(n % 128 == 0 for n in sizes[:-1])
    with pytest.raises(ValueError, match="chunk_rows"):
        OverlapPolicy(chunk_rows=0)
    # the planner: a GPU machine's E8 chunks are whole blocks of 128 rows
    wl = Workload(get_config("20B"), batch=1, dtype="bfloat16")
    shape = axon4d.GridShape(4, 2, 1, 1)
    sc = Scenario(wl, shape, load("h100"), policy)
    spec = next(s for s in wl.linears() if not s.embedding)
    e8 = [c.payload_bytes for c in collectives(spec, sc) if c.term == Term.E8]
    row_bytes = 2 * weight_block_shape(spec.in_features, spec.out_features, shape, spec.transpose)[0]
    tokens = [b // row_bytes for b in e8]
    assert len(tokens) == 4 and sum(tokens) == sc.tokens and all(t % 128 == 0 for t in tokens[:-1])


def _records_after_a_layer_dies(grid):
    """Train a → b, free a; return whether a was freed, the layers the scheduler still keeps
    records for, and the gathers over z of a step of b alone."""
    import gc
    import weakref

    torch.manual_seed(0)
    a, b = axon4d.Linear(16, 16), axon4d.Linear(16, 16)
    for _ in range(2):
        b(a(axon4d.shard_input(torch.randn(4, 16)).requires_grad_())).sum().backward()
    sched, freed = grid.scheduler, weakref.ref(a)
    del a
    gc.collect()
    kept = set(sched._next) | set(sched._prev) | set(sched._gathers_in_backward) | set(sched._prefetched)
    grid.comm.log.clear()
    b(axon4d.shard_input(torch.randn(4, 16)).requires_grad_()).sum().backward()
    return (
        freed() is None,
        [layer is b for layer in kept],
        sum(r.tag in (Term.E10F, Term.E10B) for r in grid.comm.log.records),
    )


def test_oag_records_go_with_their_layer(pools):
    # the prefetch order and prefetched blocks are kept per layer object, weakly. Keyed by id(), a
    # new layer that reused a freed layer's id inherited its successor and prefetched that layer's
    # block, on the ranks where the allocator happened to reuse the id (a collective mismatch seen
    # in a test that built one model after another; the reuse cannot be forced reliably here)
    for freed, kept, gathers in pools(2).run((1, 1, 2, 1), _records_after_a_layer_dies):
        assert freed  # the scheduler keeps no layer alive
        assert kept == [True]  # only b's own record is left
        assert gathers == 2  # b's forward and backward gathers; no prefetch from a's old links


def test_accelerator_jobs_get_one_hardware_queue_unless_the_user_says_otherwise():
    """CUDA_DEVICE_MAX_CONNECTIONS=1 where there is an accelerator (collectives start in issue order
    beside the GEMMs); nothing on the host; a value the user set is kept."""
    assert environment.overlap_connections_env({}, accelerator=True) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert environment.overlap_connections_env({}, accelerator=False) == {}
    assert environment.overlap_connections_env({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, accelerator=True) == {}
