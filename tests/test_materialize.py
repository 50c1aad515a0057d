"""Protects sharded construction and loading: no rank ever builds or reads the whole model.

- ``axon4d.materialize``: a ``Transformer`` built on the meta device and materialized for a seed
  holds exactly (``torch.equal``) what ``Transformer.from_dense(init_dense_(DenseTransformer(cfg),
  seed))`` holds, for GPT and Llama (GQA), with and without MoE blocks, on grids of 1, 2, 3, 4 and
  8 ranks — among them z shards
  that pad a weight block — with the default tiling and one small enough to cut every tensor into
  many tiles; its gradients equal the reference's (the replicated parameters' hooks survive), and
  replicas agree. One rank of a 1024-rank 80B job, and of a 1024-rank ``moe-1t`` job, on a fake
  process group allocates exactly the planner's ``local_param_count`` and no more memory than that.
- ``axon4d.parallelize.load_pretrained_``: a small Llama (GQA) and GPT-2 (Conv1D, packed q|k|v,
  tied head) saved by ``save_pretrained`` — one file, and sharded with an index — load into
  ``auto_parallelize``d meta models on grids of 4 ranks; logits and loss equal the original's, and
  every rank read, through safetensors' slices, exactly its shards' elements.
"""

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import axon4d
from axon4d.config import ModelConfig
from axon4d.layout.tiled_init import Tiling
from axon4d.models.transformer import DenseTransformer, Transformer
from axon4d.nn.linear import Linear

GPT = ModelConfig(n_layers=2, hidden=18, n_heads=2, vocab_size=66, seq_len=8, arch="gpt")
LLAMA = ModelConfig(
    n_layers=2, hidden=16, n_heads=4, n_kv_heads=2, ffn_hidden=40, vocab_size=64, seq_len=8, arch="llama"
)
SMALL_TILES = Tiling(elements=24, max_cols=5)  # many tiles per tensor, none aligned with a block
SEED = 1234


def _padded(model) -> bool:
    """Whether some 3D layer's block does not split evenly over z on this grid (shards padded)."""
    g = model.grid
    return any(
        m.shard_numel * g.size("z") != m.block_shape[0] * m.block_shape[1]
        for m in model.modules()
        if isinstance(m, Linear)
    )


def _materialize(grid, cfg, dtype):
    from axon4d.materialize import init_dense_, materialize_

    out = {}
    for label, tiling in (("default", Tiling()), ("small", SMALL_TILES)):
        torch.manual_seed(0)  # the reference's construction draws differ from the meta model's: irrelevant
        dense = init_dense_(DenseTransformer(cfg, dtype=dtype), SEED, tiling=tiling)
        ref = Transformer.from_dense(dense)
        model = Transformer(cfg, device="meta", dtype=dtype)
        assert all(p.is_meta for p in model.parameters())
        materialize_(model, SEED, tiling=tiling)
        theirs = dict(ref.named_parameters())
        out[label] = {
            n: (torch.equal(p, theirs[n]), p.is_meta, p.dtype == dtype, p.device == grid.device)
            for n, p in model.named_parameters()
        }
    # the same model trains the same: gradients, averaged over batch by the hooks, equal the reference's
    ids = torch.randint(0, cfg.vocab_size, (24, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    grads = {}
    for m in (model, ref):
        m.loss(axon4d.shard_batch(ids[:, :-1]), axon4d.shard_batch(ids[:, 1:])).backward()
    theirs = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        ref_grad = theirs[n].grad.double()
        grads[n] = float((p.grad.double() - ref_grad).abs().max() / ref_grad.abs().max().clamp_min(1e-12))
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out, grads, _padded(model), grid.coords, values


def _cases(cfgs, world, grid, pads=(), slow=False):
    """(cfg, world, grid, whether its shards are padded) for each of ``cfgs`` (names: ``pads``)."""
    marks = [pytest.mark.slow] if slow else []
    return [
        pytest.param(CFGS[c], world, grid, c in pads, marks=marks, id=f"{c}-{'x'.join(map(str, grid))}") for c in cfgs
    ]


#: GPT with odd widths: 15·45 and 65·15 blocks do not split in two (z shards padded on 2 ranks)
ODD = ModelConfig(n_layers=2, hidden=15, n_heads=3, vocab_size=65, seq_len=8, arch="gpt")
#: MoE blocks: 4 experts top-2 (Llama: gated experts and a shared expert; GPT: neither)
MOE_LLAMA = LLAMA.replace(n_experts=4, experts_per_token=2, expert_ffn=12, shared_experts=1)
MOE_GPT = GPT.replace(n_experts=4, experts_per_token=2, expert_ffn=12)
CFGS = {"gpt": GPT, "llama": LLAMA, "odd": ODD, "moe-llama": MOE_LLAMA, "moe-gpt": MOE_GPT}


@pytest.mark.parametrize(
    "cfg,world,grid,padded",
    [
        *_cases(["gpt", "llama"], 1, (1, 1, 1, 1)),
        *_cases(["odd"], 2, (1, 1, 2, 1), pads={"odd"}),
        *_cases(["gpt", "llama"], 4, (1, 2, 2, 1)),
        *_cases(["moe-llama", "moe-gpt"], 4, (2, 1, 2, 1)),
        *_cases(["moe-llama"], 4, (1, 2, 1, 2)),
        *_cases(["moe-llama", "moe-gpt"], 8, (2, 2, 1, 2), slow=True),
        *_cases(["gpt", "llama"], 3, (1, 1, 3, 1), pads={"llama"}, slow=True),
        *_cases(["gpt", "llama"], 8, (2, 2, 2, 1), pads={"gpt"}, slow=True),
        *_cases(["gpt", "llama"], 8, (1, 2, 4, 1), pads={"gpt"}, slow=True),
    ],
)
def test_materialized_model_equals_the_dense_reference(pools, cfg, world, grid, padded):
    results = pools(world).run(grid, _materialize, cfg, torch.float32)
    for rank, (out, grads, was_padded, _, _) in enumerate(results):
        for label, params in out.items():
            bad = {n: v for n, v in params.items() if v != (True, False, True, True)}
            assert not bad, f"{cfg.arch} on {grid}, rank {rank}, {label} tiles: (equal, meta, dtype, device) {bad}"
        assert max(grads.values()) <= 1e-6, f"{cfg.arch} on {grid}, rank {rank}: gradients differ {grads}"
        assert was_padded == padded, f"{cfg.arch} on {grid}: padding expected {padded}"
    # replicas (the ranks of one (x, y) position and z index, over data) and the whole grid agree;
    # MoE experts are placed over data too (each rank its own: compared with the reference above)
    by_place = {}
    for *_, coords, values in results:
        key = (coords["x"], coords["y"], coords["z"])
        if key in by_place:
            assert all(torch.equal(by_place[key][n], v) for n, v in values.items() if ".experts." not in n)
        by_place[key] = values


def test_materialized_bf16_model_equals_the_dense_reference(pools):
    for out, *_ in pools(4).run((2, 1, 1, 2), _materialize, LLAMA, torch.bfloat16):
        for label, params in out.items():
            assert all(v == (True, False, True, True) for v in params.values()), (label, params)


def test_dense_initialisation_keeps_the_distributions():
    from axon4d.materialize import init_dense_

    cfg = GPT.replace(hidden=64, n_heads=4, vocab_size=256)
    dense, again, other = (init_dense_(DenseTransformer(cfg), seed) for seed in (7, 7, 8))
    same, different = dict(again.named_parameters()), dict(other.named_parameters())
    for name, p in dense.named_parameters():
        assert torch.equal(p, same[name]), name  # a seed defines the model
        if "norm" not in name:
            assert not torch.equal(p, different[name]), name
    for name, m in dense.named_modules():
        if isinstance(m, torch.nn.Linear):  # U(−1/√in, 1/√in): std = bound/√3
            bound = 1 / math.sqrt(m.in_features)
            assert abs(m.weight.std().item() * math.sqrt(3) / bound - 1) < 0.05, name
            assert all(p.abs().max() <= bound for p in m.parameters()), name
        elif isinstance(m, torch.nn.Embedding):  # N(0, 1) tokens, N(0, 0.02²) positions
            std = 0.02 if name == "pos_emb" else 1.0
            assert abs(m.weight.std().item() / std - 1) < 0.05 and abs(m.weight.mean().item()) < 0.05 * std, name
        elif isinstance(m, torch.nn.LayerNorm):
            assert torch.equal(m.weight, torch.ones_like(m.weight)) and torch.equal(m.bias, torch.zeros_like(m.bias))


# One rank of a 1024-rank job on torch's fake process group: an 80B model (160 GB in bf16) built
# on the meta device and materialized. It must hold the planner's parameter count per rank and
# raise peak resident memory by that (its shards) and no more. The kernels materializing runs are
# warmed up first: their first use pages in code, a fixed cost whatever the model's size.
_META_SCRIPT = r"""
import json, sys, time
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

name, grid, rank = sys.argv[1], tuple(json.loads(sys.argv[2])), int(sys.argv[3])
world = grid[0] * grid[1] * grid[2] * grid[3]
dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
import axon4d
from axon4d.layout import tiled_init
from axon4d.config import SIZES
from axon4d.materialize import materialize_
from axon4d.models.transformer import DenseTransformer, Transformer

axon4d.init(grid=grid)
model = Transformer(SIZES[name], device="meta", dtype=torch.bfloat16)


def peak_resident() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


# warm up the kernels materializing runs (their code pages count as resident)
w = torch.empty(64, 64, dtype=torch.bfloat16)
for init in (tiled_init.Init.uniform(1.0), tiled_init.Init.normal(1.0), tiled_init.Init.constant(1.0)):
    tiled_init.fill_(w, init, 0, "warm-up", (64, 64), 0, 0)
w.view(-1)[100:].zero_()
DenseTransformer(SIZES["tiny"], device="meta")  # what materialize_ builds for names and shapes
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak to the current resident size
before = peak_resident()
t0 = time.perf_counter()
materialize_(model, seed=0)
seconds = time.perf_counter() - t0
grown = peak_resident() - before
params = list(model.parameters())
print("RESULT", json.dumps({
    "numel": sum(p.numel() for p in params),
    "bytes": sum(p.numel() * p.element_size() for p in params),
    "meta": sum(p.is_meta for p in params),
    "finite": all(bool(torch.isfinite(p).all()) for p in params),
    "grown": grown,
    "seconds": seconds,
}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("name,grid", [("80B", (8, 4, 32, 1)), ("moe-1t", (4, 2, 4, 32))])
def test_materializing_allocates_only_this_ranks_shards(name, grid):
    from axon4d.config import SIZES
    from axon4d.grid.shape import GridShape
    from axon4d.plan import Workload, local_param_count

    rank = 1000
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-c", _META_SCRIPT, name, json.dumps(grid), str(rank)],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=root,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.split("RESULT", 1)[1])
    expected = local_param_count(Workload(SIZES[name], batch=1, dtype="bfloat16"), GridShape(*grid))
    assert got["numel"] == expected
    assert got["meta"] == 0 and got["finite"]
    whole = SIZES[name].n_params() * 2
    assert got["bytes"] * 500 < whole  # a 1/1024 share (plus replicated norms)
    assert got["grown"] <= got["bytes"] + 32 * 2**20, f"peak grew by {got['grown']} for {got['bytes']} bytes of shards"


# -- loading a saved Hugging Face model by slices ------------------------------------------------

HF_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
HF_GPT2 = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)


def _hf_model(family: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**HF_LLAMA))
    return GPT2LMHeadModel(GPT2Config(**HF_GPT2))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{family: (one-file directory, sharded directory, ids, logits, loss)} of random models."""
    out = {}
    for family in ("llama", "gpt2"):
        torch.manual_seed(0)
        model = _hf_model(family).eval()
        root = tmp_path_factory.mktemp(family)
        one, many = str(root / "one"), str(root / "many")
        model.save_pretrained(one)
        model.save_pretrained(many, max_shard_size="40KB")
        assert os.path.exists(os.path.join(many, "model.safetensors.index.json"))
        assert len(os.listdir(many)) > 3
        ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(input_ids=ids, labels=ids)
        out[family] = (one, many, ids, ref.logits, ref.loss)
    return out


def _load(grid, family, directory, ids):
    import safetensors

    from axon4d.parallelize import load_pretrained_
    from axon4d.parallelize.layers import ShardedLinear

    reads = []  # elements of every slice read

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            t = self.inner[index]
            reads.append(t.numel())
            return t

    class Handle:
        def __init__(self, inner):
            self.inner = inner

        def __enter__(self):
            self.opened = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.opened.keys()

        def get_slice(self, name):
            return Slice(self.opened.get_slice(name))

        def get_tensor(self, name):
            raise AssertionError("the loader must read slices, not whole tensors")

    real = safetensors.safe_open
    safetensors.safe_open = lambda *a, **k: Handle(real(*a, **k))
    try:
        with torch.device("meta"):
            model = _hf_model(family)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GPT-2's tied head is left whole, with a warning
            model = axon4d.auto_parallelize(model)
        built_on_meta = all(p.is_meta for p in model.parameters())
        load_pretrained_(model, directory)
    finally:
        safetensors.safe_open = real
    model.eval()
    left_on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    with torch.no_grad():
        out = model(input_ids=axon4d.shard_batch(ids), labels=axon4d.shard_batch(ids))
    logits = axon4d.gather_batch(out.logits)
    loss = grid.comm.all_reduce(out.loss.reshape(1).clone(), "batch").wait() / grid.size("batch")
    held = sum(p.numel() for p in model.parameters())
    padding = 0  # zeros past a block's end in the last z shard: in no checkpoint
    for m in model.modules():
        if isinstance(m, ShardedLinear):
            layer = m.inner
            block = layer.block_shape[0] * layer.block_shape[1]
            start = grid.coord("z") * layer.shard_numel
            padding += layer.shard_numel - max(0, min(layer.shard_numel, block - start))
    return built_on_meta, left_on_meta, logits, loss, sum(reads), held, padding


@pytest.mark.parametrize(
    "family,grid,files",
    [
        ("llama", (2, 2, 1, 1), "one"),
        ("llama", (1, 2, 2, 1), "many"),
        ("gpt2", (2, 2, 1, 1), "many"),
    ],
)
def test_loading_a_saved_model_reads_only_this_ranks_slices(pools, saved, family, grid, files):
    one, many, ids, ref_logits, ref_loss = saved[family]
    directory = one if files == "one" else many
    total = sum(p.numel() for p in _hf_model(family).parameters())
    for rank, (on_meta, left, logits, loss, read, held, padding) in enumerate(
        pools(4).run(grid, _load, family, directory, ids)
    ):
        assert on_meta and not left, (rank, left)
        assert float((logits - ref_logits).abs().max() / ref_logits.abs().max()) <= 1e-5
        assert float((loss - ref_loss).abs().max() / ref_loss.abs()) <= 1e-5
        assert read == held - padding, f"rank {rank} read {read} elements for {held} held ({padding} padding)"
        assert read < total / 2, f"rank {rank} read {read} of the model's {total} elements"
