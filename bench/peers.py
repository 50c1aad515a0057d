"""axon4d side by side with what a user would pick instead: DTensor tensor parallelism, FSDP2, DDP
and one process (issue 18, item 1).

Workloads (fp32; one step = forward, backward and a plain SGD update, ``torch.optim.SGD`` with
lr 1e-4, no momentum, the same for every implementation; the loss is ``(y · v).sum()`` over the
rank's tokens divided by their count, so every implementation gets the gradient of the mean):

- ``mlp``: Linear 2048→8192, GELU, Linear 8192→2048 (biases), 2048 tokens (8 × 256);
- ``llama``: one Llama block (RMSNorm, GQA attention with rotary, SwiGLU MLP; no biases), hidden
  1024, 16 heads, 8 key/value heads (8, not 4: DTensor TP splits whole key/value heads, so 4 could
  not run at 8 ranks), ffn 2816 (the Llama rule), 2048 tokens (8 × 256);
- ``20B``: one GPT block of the 20B width (axon4d.config.SIZES["20B"]: hidden 7168, 56 heads, ffn
  28672, LayerNorm, GELU, biases) at 128 tokens (8 sequences × 16, so data parallelism can give
  each of 8 ranks a whole sequence; one step is ~0.5 TFLOP).

The modules are axon4d's own (axon4d.nn.mlp.MLP, axon4d.nn.block.TransformerBlock) and their
single-process references (DenseMLP, DenseBlock), which the peers parallelize:

- ``axon4d``: the planner's grid and overlap knobs for this workload (only its linear layers,
  fp32, SGD) on ``--machine``: ``axon4d.plan.auto.choose(..., overlap="auto")``, what
  ``axon4d.init(grid="auto")`` runs; ``--overlap`` sets the policy instead. ``--grids 1,4,1,1;2,2,1,1`` adds named
  grids as ``axon4d(x,y,z,d)``, each with the knobs the planner tunes for it
  (``choose_overlap``). Input ``shard_input`` of the full batch. The JSON records every grid and
  policy run.
- ``dtensor``: Megatron tensor parallelism with ``parallelize_module`` on a 1-D mesh of all ranks:
  q, k, v and MLP up/gate ``ColwiseParallel``, o and MLP down ``RowwiseParallel`` (both with
  ``use_local_output=True``, the default), attention head counts divided by the ranks; norms
  replicated. Every rank sees every token.
- ``fsdp2``: ``fully_shard`` on every Linear, then on the root (each Linear's all-gather is
  prefetched while the one before computes). ``reshard_after_forward=False`` for mlp and llama
  (one all-gather per parameter per step: fastest), True for 20B (full-width Linears of all ranks
  held at once do not fit the host). Each rank gets 1/R of the sequences.
- ``ddp``: ``DistributedDataParallel`` (``gradient_as_bucket_view=True``, 25 MB buckets), 1/R of
  the sequences.
- A peer whose estimated memory (``too_big``) exceeds 80% of what the host has available is
  skipped and reported as n/a, with the reason in the JSON: on a 23 GiB host, DDP for 20B at 4 and
  8 ranks and FSDP2 for 20B at 8 ranks.
- ``dense``: the reference module in one process (rank 0) with R threads
  (``torch.set_num_threads(R)``), while the other ranks wait in a barrier.

Every parallel implementation is built the way it runs: on the meta device, parallelized, then
materialized (``to_empty``) and filled — from the single-process module's weights for the check,
randomly for timing. Before any timing, each is checked against the single-process module (same
seed, same weights, same input): forward output, input gradient and every parameter gradient
within ``TOL`` relative to the reference's largest entry; a mismatch aborts. For ``20B`` the check
runs at width/8 (hidden 896, the same 56 heads, ffn 3584, same tokens and grids): full-width
gradients gathered on every rank do not fit the host.

Timing: ``--rounds`` interleaved rounds; each round builds and runs every implementation once, in
an order rotated by one each round; per implementation ``--warmup`` untimed steps, then ``--steps``
steps, each after a barrier, each taking the slowest rank's time; per round the median step. The
result per implementation is the median over rounds. One thread per rank.

Paired steps (``--pairs``, default 8): rounds minutes apart see the shared host at different
speeds (in the 4-rank loopback run of docs/results/performance.md the one-process step moved by
up to 16% between rounds). So after the rounds, axon4d and the best peer by those medians are built
at once and stepped alternately (A B, B A, A B, …); each pair's
ratio axon4d / peer sees the host at one speed. The JSON records every pair and the median
ratio (``paired``), and the driver prints it beside the headline.

    .venv/bin/python bench/peers.py --ranks 2,4,8                         # loopback (gloo)
    .venv/bin/python bench/peers.py --link 1gbit --nodes 2 --intra 10gbit --ranks 8   # emulated cluster (root)
    .venv/bin/python bench/peers.py --quick --ranks 2                     # tiny sizes, checks the script

Ranks are spawned by ``axon4d.measure.spawn.run_local`` on loopback and by bench/cluster.py's
``Cluster`` on the emulated cluster. The planner prices the loopback runs with
bench/results/planner_machine_local.json, the one-level cluster with planner_machine_cluster_1gbit.json
and two nodes with planner_machine_cluster_2node_1gbit.json (``--machine`` to change). Results: ``bench/results/peers_<link>.json`` and ``.png``
(``_<N>nodes`` added with --nodes N, ``_quick`` with --quick; the JSON with the result header of
bench/common.py); the last lines, one per setting:

    peers: ranks = R, link = L, workload = W, axon4d = A s, dtensor = D s, fsdp2 = F s, ddp = P s, dense = S s
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import sys
import time
import traceback
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import common  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from axon4d.measure.spawn import run_local  # noqa: E402

PEERS = ["axon4d", "dtensor", "fsdp2", "ddp", "dense"]
WORKLOADS = ["mlp", "llama", "20B"]
TOL = 1e-4  # max |got − ref| / max |ref| (floored at 1e-3), fp32
LR = 1e-4
# FSDP2 warns that a wrapped Linear returns a view (in-place ops on it would skip its hooks); these
# modules apply none to their Linears' outputs
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


# -- workloads -------------------------------------------------------------------------------------
def workload(name: str, quick: bool) -> dict[str, Any]:
    """Shape of workload ``name``: kind ("mlp"/"block"), config fields, batch × seq, and the
    config its correctness check runs at."""
    from axon4d.config import ModelConfig, get_config

    if name == "mlp":
        h, f, b, s = (256, 1024, 4, 16) if quick else (2048, 8192, 8, 256)
        # no attention runs; 16 heads only so that the planner's head rule lets y split the block
        cfg = ModelConfig(n_layers=1, hidden=h, n_heads=16, ffn_hidden=f, vocab_size=128, seq_len=s, name="mlp")
        return {"kind": "mlp", "cfg": cfg, "check_cfg": cfg, "batch": b, "seq": s}
    if name == "llama":
        h, b, s = (128, 4, 16) if quick else (1024, 8, 256)
        cfg = ModelConfig(
            n_layers=1, hidden=h, n_heads=16, n_kv_heads=8, vocab_size=128, seq_len=s, arch="llama", name="llama"
        )
        return {"kind": "block", "cfg": cfg, "check_cfg": cfg, "batch": b, "seq": s}
    if name == "20B":
        b, s = (8, 8) if quick else (8, 16)
        cfg = get_config("20B", n_layers=1, vocab_size=128, seq_len=s)
        if quick:
            cfg = cfg.replace(hidden=448)  # 56 heads of 8
        check = cfg.replace(hidden=cfg.hidden // 8, ffn_hidden=4 * cfg.hidden // 8)
        return {"kind": "block", "cfg": cfg, "check_cfg": check, "batch": b, "seq": s}
    raise ValueError(f"workload {name!r}: choose from {', '.join(WORKLOADS)}")


def dense_module(kind: str, cfg: Any, device: str | None = None) -> nn.Module:
    """The single-process module: DenseMLP (GELU, biases) or DenseBlock."""
    from axon4d.nn.block import DenseBlock
    from axon4d.nn.mlp import DenseMLP

    if kind == "mlp":
        return DenseMLP(cfg.hidden, cfg.ffn, gated=False, bias=True, device=device)
    return DenseBlock(cfg, device=device)


def param_bytes(kind: str, cfg: Any) -> int:
    with torch.device("meta"):
        return sum(p.numel() * 4 for p in dense_module(kind, cfg).parameters())


def planner_workload(spec: dict) -> Any:
    """What the planner prices: exactly this workload's linear layers (an MLP alone, or one block
    without embedding and head), fp32, SGD."""
    from axon4d.plan.workload import LinearSpec, Workload

    @dataclasses.dataclass(frozen=True)
    class MLPOnly(Workload):
        def linears(self) -> list[LinearSpec]:
            m = self.model
            # the planner's memory walk names a block's four layers: the attention pair runs 0 times
            return [
                LinearSpec("qkv", m.hidden, 3 * m.hidden, False, True, 0),
                LinearSpec("attn_out", m.hidden, m.hidden, True, True, 0),
                LinearSpec("mlp_up", m.hidden, m.ffn, False, True, 1),
                LinearSpec("mlp_down", m.ffn, m.hidden, True, True, 1),
            ]

    w = workload(spec["workload"], spec["quick"])
    kw: dict[str, Any] = dict(dtype="float32", optimizer="sgd", embedding=False, head=False)
    if w["kind"] == "mlp":
        return MLPOnly(w["cfg"], w["batch"], attention=False, norms=False, **kw)
    return Workload(w["cfg"], w["batch"], **kw)


def axon4d_setups(spec: dict, world: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    """name → (grid, overlap policy) of every axon4d implementation: "axon4d" the planner's grid
    and knobs (what ``axon4d.init(grid="auto")`` does with its default ``overlap="auto"``), and each
    ``--grids`` grid of ``world`` ranks with the knobs the planner tunes for it. ``--overlap``
    overrides the knobs."""
    from axon4d.grid.shape import GridShape
    from axon4d.plan import auto

    wl, machine, rank = planner_workload(spec), spec["machine"], dist.get_rank()
    given = spec["overlap"] or None
    best = auto.choose(world, workload=wl, machine=machine, overlap=given or "auto", rank=rank)
    out = {"axon4d": (best.shape.as_tuple(), given or best.overlap)}
    for g in spec["grids"]:
        if len(g) == 4 and g[0] * g[1] * g[2] * g[3] == world:
            shape = GridShape.parse(tuple(g), world)
            policy = given or auto.choose_overlap(shape, workload=wl, machine=machine, rank=rank)
            out[f"axon4d({','.join(map(str, g))})"] = (tuple(g), policy)
    return out


# -- one implementation, built, run and checked ----------------------------------------------------
@dataclasses.dataclass
class Built:
    """An implementation ready to step: module, this rank's input and loss weights, and how to get
    full tensors back (forward output, input gradient, parameter gradients) for the check."""

    module: nn.Module
    x: torch.Tensor
    v: torch.Tensor
    gather_out: Any
    input_grad: Any  # (x.grad) -> full input gradient of the mean loss
    grads: Any  # () -> {dense name: full gradient}
    close: Any = None
    active: bool = True  # False on the ranks that only wait (dense on ranks > 0)


def _gather_rows(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def _fill(module: nn.Module, state: dict[str, torch.Tensor] | None, names: dict[str, str] | None = None) -> None:
    """Fill every parameter (local shard of a DTensor) from the dense ``state`` — each rank slices
    its own shard, no communication — or, with ``state`` None, randomly (timing)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in module.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if state is None:
            local.normal_(0.0, 0.02) if p.dim() > 1 else local.fill_(1.0 if "norm" in name else 0.0)
            continue
        full = state[(names or {}).get(name, name)]
        if isinstance(p, DTensor):
            full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        local.copy_(full)


def build(peer: str, spec: dict, ctx: dict, ref: nn.Module | None) -> Built:
    """``peer`` on this rank, filled from ``ref``'s weights (check) or randomly (``ref`` None)."""
    w = workload(spec["workload"], spec["quick"])
    cfg = w["check_cfg"] if ref is not None else w["cfg"]
    kind, world, rank = w["kind"], dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    x_full = torch.randn(w["batch"], w["seq"], cfg.hidden, generator=gen)
    v = torch.randn(cfg.hidden, generator=gen)
    state = {k: t.detach() for k, t in ref.named_parameters()} if ref is not None else None

    if peer.startswith("axon4d"):
        import axon4d
        from axon4d.nn.block import TransformerBlock
        from axon4d.nn.mlp import MLP

        shape, policy = ctx["axon4d"][peer]
        grid = axon4d.init(grid=shape, overlap=policy)
        if kind == "mlp":
            mod: nn.Module = MLP(cfg.hidden, cfg.ffn, gated=False, bias=True, grid=grid)
        else:
            mod = TransformerBlock(cfg, grid=grid)
        if ref is not None:
            mod.load_dense_(ref)  # type: ignore[operator]
        x = axon4d.shard_input(x_full).requires_grad_()
        batch = grid.size("batch")
        return Built(
            mod,
            x,
            axon4d.shard_features(v, "x"),
            lambda y: axon4d.gather_batch(axon4d.gather_features(y, "x")),
            lambda g: axon4d.gather_batch(axon4d.gather_features(g, "x")) / batch,
            lambda: {n: p.grad for n, p in mod.to_dense(grads=True).named_parameters()},  # type: ignore[operator]
            axon4d.shutdown,
        )

    if peer == "dense":
        if rank != 0:
            return Built(nn.Module(), x_full, v, None, None, None, active=False)
        mod = dense_module(kind, cfg)
        _fill(mod, state)
        torch.set_num_threads(world)
        return Built(
            mod,
            x_full.requires_grad_(),
            v,
            lambda y: y,
            lambda g: g,
            lambda: {n: p.grad for n, p in mod.named_parameters()},
            lambda: torch.set_num_threads(1),
        )

    mesh = ctx["mesh"]
    with torch.device("meta"):
        mod = dense_module(kind, cfg)
    if peer == "dtensor":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        col, row = ColwiseParallel(), RowwiseParallel()
        if kind == "mlp":
            plan = {"up": col, "down": row}
        else:
            plan = {f"attn.{n}": col for n in ("q_proj", "k_proj", "v_proj")} | {"attn.o_proj": row}
            plan |= {"mlp.up": col, "mlp.gate": col, "mlp.down": row} if cfg.gated else {"mlp.up": col, "mlp.down": row}
            mod.attn.n_heads //= world  # type: ignore[union-attr, operator]  # the heads of this rank's q, k, v columns
            mod.attn.n_kv_heads //= world  # type: ignore[union-attr, operator]
        parallelize_module(mod, mesh, plan)
        mod.to_empty(device="cpu")
        _fill(mod, state)
        return Built(
            mod,
            x_full.requires_grad_(),
            v,
            lambda y: y,
            lambda g: g,
            lambda: {n: _full(p.grad) for n, p in mod.named_parameters()},
        )

    # data parallel peers: each rank takes 1/world of the sequences
    x = x_full.chunk(world)[rank].clone().requires_grad_()
    if peer == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        reshard = fsdp_reshard(spec)
        for m in mod.modules():
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(mod, mesh=mesh, reshard_after_forward=reshard)
        mod.to_empty(device="cpu")
        _fill(mod, state)
        return Built(
            mod,
            x,
            v,
            _gather_rows,
            lambda g: _gather_rows(g) / world,
            lambda: {n: _full(p.grad) for n, p in mod.named_parameters()},
        )
    if peer == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        mod.to_empty(device="cpu")
        _fill(mod, state)
        ddp = DistributedDataParallel(mod, gradient_as_bucket_view=True)
        return Built(
            ddp,
            x,
            v,
            _gather_rows,
            lambda g: _gather_rows(g) / world,
            lambda: {n: p.grad for n, p in mod.named_parameters()},
        )
    raise ValueError(f"implementation {peer!r}: choose from {', '.join(PEERS)} or axon4d(x,y,z,d)")


def forward_backward(b: Built) -> torch.Tensor:
    y = b.module(b.x)
    (y * b.v).sum().div(y.shape[0] * y.shape[1]).backward()
    return y


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-3))


def check(peer: str, spec: dict, ctx: dict) -> dict[str, float]:
    """Errors of ``peer`` against the single-process module (every rank computes the reference)."""
    w = workload(spec["workload"], spec["quick"])
    torch.manual_seed(spec["seed"])
    ref = dense_module(w["kind"], w["check_cfg"])
    b = build(peer, spec, ctx, ref)
    errs: dict[str, float] = {}
    if b.active:
        y = forward_backward(b)
        out, dx, grads = b.gather_out(y), b.input_grad(b.x.grad), b.grads()
        gen = torch.Generator().manual_seed(spec["seed"] + 1)  # the input and loss weights build() drew
        xr = torch.randn(w["batch"], w["seq"], w["check_cfg"].hidden, generator=gen).requires_grad_()
        vr = torch.randn(w["check_cfg"].hidden, generator=gen)
        yr = ref(xr)
        (yr * vr).sum().div(yr.shape[0] * yr.shape[1]).backward()
        errs = {"forward": rel_err(out, yr), "input_grad": rel_err(dx, xr.grad)}
        for n, p in ref.named_parameters():
            errs[f"{n}.grad"] = rel_err(grads[n], p.grad)
    if b.close:
        b.close()
    del b, ref
    gc.collect()
    dist.barrier()
    return errs


def timed_step(b: Built, opt: torch.optim.Optimizer | None) -> float:
    """One step (forward, backward, SGD update) after a barrier: the slowest rank's seconds
    (a rank where ``b`` is inactive only waits)."""
    dist.barrier()
    t0 = time.perf_counter()
    if b.active:
        forward_backward(b)
        opt.step()  # type: ignore[union-attr]
        opt.zero_grad(set_to_none=True)  # type: ignore[union-attr]
    dt = torch.tensor([time.perf_counter() - t0 if b.active else 0.0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def time_peer(peer: str, spec: dict, ctx: dict) -> list[float]:
    """``warmup`` + ``steps`` steps of ``peer``; each step's time is the slowest rank's."""
    b = build(peer, spec, ctx, None)
    opt = torch.optim.SGD(b.module.parameters(), lr=LR) if b.active else None
    times = [timed_step(b, opt) for _ in range(spec["warmup"] + spec["steps"])][spec["warmup"] :]
    if b.close:
        b.close()
    del b, opt
    gc.collect()  # hooks of FSDP2 and DDP hold reference cycles: free the model before the next one
    dist.barrier()
    return times


def time_pair(peers: tuple[str, str], spec: dict, ctx: dict) -> dict[str, list[float]]:
    """Both implementations built at once and stepped alternately, ``pairs`` times: pair i runs
    A then B for even i and B then A for odd i, so that drift in the host's speed (other tenants,
    clocks) lands on both sides of each ratio alike. Each step is a ``timed_step``, after
    ``warmup`` untimed steps of each."""
    built = {p: build(p, spec, ctx, None) for p in peers}
    opts = {p: torch.optim.SGD(b.module.parameters(), lr=LR) for p, b in built.items()}
    for _ in range(spec["warmup"]):
        for p in peers:
            timed_step(built[p], opts[p])
    times = common.paired({p: functools.partial(timed_step, built[p], opts[p]) for p in peers}, spec["pairs"])
    for b in built.values():
        if b.close:
            b.close()
    del built, opts
    gc.collect()
    dist.barrier()
    return times


def pair(best: str, spec: dict, ctx: dict) -> dict[str, Any]:
    """``time_pair`` of axon4d and ``best``: every step, each pair's ratio and their median."""
    times = time_pair(("axon4d", best), spec, ctx)
    ratios = [a / b for a, b in zip(times["axon4d"], times[best])]
    out = {"against": best, "steps_s": times, "ratios": ratios, "median_ratio": common.median(ratios)}
    if dist.get_rank() == 0:
        span = f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(
            f"  paired axon4d / {best}: median {out['median_ratio']:.3f} over {len(ratios)} pairs ({span})", flush=True
        )
    return out


def fsdp_reshard(spec: dict) -> bool:
    """FSDP2's ``reshard_after_forward``: False (one all-gather per parameter per step) but for
    the full 20B width, whose unsharded Linears of every rank at once do not fit the host."""
    if spec["fsdp_reshard"] == "auto":
        return spec["workload"] == "20B" and not spec["quick"]
    return spec["fsdp_reshard"] == "true"


def too_big(peer: str, spec: dict, world: int, also: float = 0.0) -> str:
    """Why ``peer`` would not fit the host's memory at ``world`` ranks ("" if it fits): a rough
    peak per rank (DDP: parameters, gradients and buckets; FSDP2: shards plus, resharding, the
    unsharded weights of two Linears and one gradient, else every unsharded parameter and
    gradient; a tensor-parallel split: its parameters and gradients), times the ranks, plus
    ``also`` bytes (another implementation held at once), against 80% of the memory available when
    the run started."""
    w = workload(spec["workload"], spec["quick"])
    total = param_bytes(w["kind"], w["cfg"])
    with torch.device("meta"):
        largest = max(
            m.weight.numel() * 4 for m in dense_module(w["kind"], w["cfg"]).modules() if isinstance(m, nn.Linear)
        )
    if peer == "ddp":
        need = world * 2.5 * total
    elif peer == "fsdp2":
        need = world * (2.5 * total / world + (3 * largest if fsdp_reshard(spec) else 2 * total))
    elif also:
        need = 2.5 * total
    else:
        return ""
    need += also
    limit = 0.8 * spec["mem_available"]
    return (
        f"needs ~{need / 2**30:.1f} GiB, over 80% of the {spec['mem_available'] / 2**30:.1f} GiB available"
        if need > limit
        else ""
    )


# -- on every rank ---------------------------------------------------------------------------------
def rank_main(grid: Any, spec: dict) -> dict:
    """Run the checks, then the rounds; rank 0 returns the record (``{"error": ...}`` on failure)."""
    try:
        return _rank_main(spec)
    except Exception:
        return {"error": traceback.format_exc()}


def _rank_main(spec: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import axon4d
    from axon4d.options.overlap_policy import OverlapPolicy

    axon4d.shutdown()  # run_local's data-parallel grid: each axon4d implementation builds its own
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    ctx: dict[str, Any] = {"mesh": init_device_mesh("cpu", (world,))}
    ctx["axon4d"] = axon4d_setups(spec, world) if "axon4d" in spec["peers"] else {}
    peers = list(ctx["axon4d"]) + [p for p in PEERS[1:] if p in spec["peers"]]
    skipped = {p: why for p in peers if (why := too_big(p, spec, world))}
    if rank == 0 and skipped:
        print(f"  skipped: {skipped}", flush=True)
    peers = [p for p in peers if p not in skipped]
    errors = {}
    for p in peers:
        if p == "dense":
            continue  # the reference itself
        errs = check(p, spec, ctx)
        bad = {k: e for k, e in errs.items() if not e <= TOL}
        if rank == 0:
            print(f"  check {p}: worst {max(errs.values(), default=0.0):.2e} over {len(errs)} tensors", flush=True)
        if bad:
            return {"error": f"{p} differs from the single-process module (tolerance {TOL}): {bad}"}
        errors[p] = max(errs.values(), default=0.0)
    runs: dict[str, list[list[float]]] = {p: [] for p in peers}
    for r in range(spec["rounds"]):
        for p in common.rotated(peers, r):
            runs[p].append(time_peer(p, spec, ctx))
            if rank == 0:
                print(f"  round {r} {p:16s} " + " ".join(f"{t:.3f}" for t in runs[p][-1]) + " s", flush=True)
    medians = {p: common.median_of_medians(rounds) for p, rounds in runs.items()}
    paired: dict[str, Any] = {}
    others = [p for p in peers if p in PEERS[1:-1]]  # DTensor, FSDP2, DDP: not the one-process reference
    if spec["pairs"] and "axon4d" in runs and others:
        best = min(others, key=lambda p: medians[p])
        w = workload(spec["workload"], spec["quick"])
        why = too_big(best, spec, world, also=2.5 * param_bytes(w["kind"], w["cfg"]))
        paired = {"against": best, "skipped": f"axon4d and {best} at once {why}"} if why else pair(best, spec, ctx)
    return {
        "axon4d": {
            p: {"grid": list(g), "overlap": OverlapPolicy.parse(o).spec()} for p, (g, o) in ctx["axon4d"].items()
        },
        "check_max_rel_err": errors,
        "skipped": skipped,
        "steps_s": runs,
        "median_s": medians,
        "paired": paired,
    }


def worker_main(spec_json: str) -> int:
    """Entry of a rank on the emulated cluster (torchrun's environment, from Cluster.launch)."""
    spec = json.loads(spec_json)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["timeout"]))
    result = rank_main(None, spec)
    if dist.get_rank() == 0:
        with open(spec["out"], "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    return 0


# -- the driver --------------------------------------------------------------------------------------
def run_setting(spec: dict, ranks: int, args: argparse.Namespace) -> dict:
    """One world of ``ranks`` on loopback (run_local) or the emulated cluster; rank 0's record."""
    if not args.link:
        return run_local(ranks, rank_main, spec)
    from cluster import Cluster

    out = f"/tmp/axon4d_peers_{os.getpid()}.json"
    spec = dict(spec, out=out)
    with Cluster(ranks, args.link, args.nodes, args.intra) as cluster:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
        code = cluster.run(cmd, env={"PYTHONPATH": ROOT}, timeout=args.timeout)
    if code != 0 or not os.path.exists(out):
        return {"error": f"a rank failed (exit {code}); see the output above"}
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def plot(records: list[dict], path: str, title: str) -> None:
    """One panel per setting: a row per workload, a column per rank count; axon4d in blue."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(dict.fromkeys(r["workload"] for r in records))
    cols = list(dict.fromkeys(r["ranks"] for r in records))
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(3.4 * len(cols) + 0.6, 2.9 * len(rows)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for rec in records:
        ax = axes[rows.index(rec["workload"])][cols.index(rec["ranks"])]
        ax.set_visible(True)
        names = list(rec["median_s"])
        colors = ["C0" if n.startswith("axon4d") else "C7" for n in names]
        ax.bar(range(len(names)), [rec["median_s"][n] for n in names], color=colors)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        ax.set_title(f"{rec['workload']}, {rec['ranks']} ranks", fontsize=9)
        ax.set_ylabel("step (s)", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,4,8", help="comma-separated world sizes")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"from {','.join(WORKLOADS)}")
    p.add_argument("--peers", default=",".join(PEERS), help=f"from {','.join(PEERS)}")
    p.add_argument("--grids", default="", help="extra axon4d grids x,y,z,d;x,y,z,d (those matching the world run)")
    p.add_argument("--overlap", default="", help="axon4d overlap policy (default: the library's)")
    p.add_argument(
        "--machine", help="planner machine file (default: bench/results/planner_machine_{local,cluster_1gbit}.json)"
    )
    p.add_argument(
        "--fsdp-reshard", choices=["auto", "true", "false"], default="auto", help="FSDP2 reshard_after_forward"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per implementation per round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--pairs", type=int, default=8, help="after the rounds, axon4d and the best peer stepped alternately (0: skip)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--link", help="emulated cluster with this (inter-node) link rate, e.g. 1gbit; needs root")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--intra", default=None, help="emulated cluster: link rate inside a node")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 round: checks that the script works")
    p.add_argument("--results", help="JSON to write (default bench/results/peers_<link>[_quick].json)")
    p.add_argument("--timeout", type=float, default=3000)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker_main(args.worker)
    head = common.header()
    sys.path.insert(0, HERE)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.pairs = 1, 2, 1, min(args.pairs, 2)
    link = args.link or "loopback"
    where = (
        "local"
        if not args.link
        else f"cluster_{args.nodes}node_{args.link}"
        if args.nodes > 1
        else f"cluster_{args.link}"
    )
    machine = args.machine or os.path.join(HERE, "results", f"planner_machine_{where}.json")
    if not os.path.exists(machine):
        p.error(f"no machine file {machine} for this setting: calibrate it (docs/planner.md) or give --machine")
    try:
        grids = [[int(s) for s in g.split(",")] for g in filter(None, args.grids.split(";"))]
    except ValueError:
        p.error(f"--grids {args.grids}: give grids as x,y,z,d separated by ';', e.g. 1,4,1,1;2,2,1,1")
    unknown = set(args.workloads.split(",")) - set(WORKLOADS) | set(args.peers.split(",")) - set(PEERS)
    if unknown:
        p.error(f"unknown workloads or peers {sorted(unknown)}: workloads {WORKLOADS}, peers {PEERS}")
    tag = link + (f"_{args.nodes}nodes" if args.nodes > 1 else "") + ("_quick" if args.quick else "")
    path = args.results or os.path.join(HERE, "results", f"peers_{tag}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    with open("/proc/meminfo") as f:  # read once here: every rank must decide what to skip alike
        mem_available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    records = []
    for ranks in [int(r) for r in args.ranks.split(",")]:
        for wl in args.workloads.split(","):
            spec = {
                "workload": wl,
                "quick": args.quick,
                "peers": args.peers.split(","),
                "grids": grids,
                "overlap": args.overlap,
                "machine": machine,
                "fsdp_reshard": args.fsdp_reshard,
                "rounds": args.rounds,
                "steps": args.steps,
                "warmup": args.warmup,
                "pairs": args.pairs,
                "seed": args.seed,
                "timeout": args.timeout,
                "mem_available": mem_available,
            }
            print(f"peers: {wl}, {ranks} ranks, {link}", flush=True)
            t0 = time.perf_counter()
            rec = run_setting(spec, ranks, args)
            if "error" in rec:
                raise SystemExit(f"peers: {wl} at {ranks} ranks on {link} failed:\n{rec['error']}")
            cfg = workload(wl, args.quick)
            rec.update(ranks=ranks, workload=wl, link=link, wall_s=time.perf_counter() - t0)
            rec["shape"] = {
                "cfg": dataclasses.asdict(cfg["cfg"]),
                "check_cfg": dataclasses.asdict(cfg["check_cfg"]),
                "batch": cfg["batch"],
                "seq": cfg["seq"],
            }
            records.append(rec)
    setting = {
        "link": link,
        "nodes": args.nodes,
        "intra": args.intra,
        "machine": machine,
        "axon4d_overlap": args.overlap or "the library's default",
        "fsdp_reshard_after_forward": args.fsdp_reshard,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "pairs": args.pairs,
        "optimizer": f"SGD lr {LR}, no momentum",
        "dtype": "float32",
        "quick": args.quick,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    common.save(path, {"setting": setting, "records": records}, head)
    png = path[: -len(".json")] + ".png"
    plot(records, png, f"step time, fp32, {link}")
    print(f"saved {path} and {png}")

    def s(rec: dict, name: str) -> str:
        t = rec["median_s"].get(name)
        return "n/a" if t is None else f"{t:.3f} s"

    for rec in records:
        pair = rec.get("paired") or {}
        if "median_ratio" in pair:
            print(
                f"paired: ranks = {rec['ranks']}, link = {link}, workload = {rec['workload']}, "
                f"axon4d / {pair['against']} = {pair['median_ratio']:.3f} over {len(pair['ratios'])} pairs"
            )
    for rec in records:
        print(
            f"peers: ranks = {rec['ranks']}, link = {link}, workload = {rec['workload']}, axon4d = {s(rec, 'axon4d')}, "
            f"dtensor = {s(rec, 'dtensor')}, fsdp2 = {s(rec, 'fsdp2')}, ddp = {s(rec, 'ddp')}, dense = {s(rec, 'dense')}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
