"""Seconds of a block's work beside its linear layers' GEMMs and collectives, on one rank (docs/design.md
§3, §6): core attention — whole sequences, or split over z (and data) by context parallelism, with
what its key/value collectives hide behind it (docs/context.md) — and the elementwise work after each
layer kind: norms, activations, residual adds and the loss (``block_extras``). ``axon4d.plan.cost``
adds them to the layers' runs (``axon4d.plan.layers``); ``axon4d.plan.recompute`` prices what a
mode runs again from them.
"""

from __future__ import annotations

from axon4d.grid.shape import GridShape
from axon4d.plan.blocks import mlp_width
from axon4d.plan.layers import priced
from axon4d.plan.scenario import Scenario
from axon4d.plan.workload import Workload

#: Share of attention's forward + backward seconds that is forward (fwd:bwd ≈ 1:2.3 for flash-style kernels).
ATTENTION_FORWARD = 0.3


def attention_seconds(sc: Scenario) -> tuple[float, float]:
    """(local, prefix) seconds of one block's core attention, forward + backward, on one rank.

    Whole sequences: every sequence's causal attention over this rank's heads (n/G_y), all local.
    Context parallelism (docs/context.md): per sequence and head, each of the rank's two query chunks
    of C = S/(2·G_z) tokens attends causally to its own chunk (a causal square of C, run while the
    keys and values of the other chunks are gathered: "local") and, unmasked, to the chunks before
    it — r·C and (2·G_z−1−r)·C keys on z-rank r ("prefix"); the slowest z-rank is priced. Hierarchical
    context parallelism (``Workload.context_axes`` "z,data"): the same over G = G_z·G_data ranks, each
    holding every sequence's two chunks of 2·G.

    Packed documents (``Workload.document_tokens`` D): whole sequences run causal squares of D, S/D
    per sequence; split, each part keeps its share of the pairs the document mask leaves
    (``Workload.attention_share``; the chunks are handed out by their work, axon4d.data.documents,
    so the ranks stay balanced)."""
    wl, shape, m, mod, world = sc.workload, sc.shape, sc.machine, sc.model, sc.world
    heads = mod.n_heads // shape.y
    docs = wl.document_tokens if 0 < wl.document_tokens < mod.seq_len else 0
    g = wl.context_group(shape)  # G_z, or G_z·G_data (hierarchical)
    if g == 1:
        units = wl.local_sequences(shape) * heads
        if docs:  # each sequence's documents: causal squares of D (the last of S mod D)
            whole, rest = divmod(mod.seq_len, docs)
            square = m.attention_time(docs, mod.head_dim, units * whole, wl.dtype, world)
            return square + (m.attention_time(rest, mod.head_dim, units, wl.dtype, world) if rest else 0.0), 0.0
        return m.attention_time(mod.seq_len, mod.head_dim, units, wl.dtype, world), 0.0
    units = sc.tokens * g // mod.seq_len * heads  # B/G_data sequences (hierarchical: B), this rank's heads
    c = mod.seq_len // (2 * g)
    local = 2 * m.attention_time(c, mod.head_dim, units, wl.dtype, world)
    prefix = max(
        sum(m.prefix_attention_time(c, j * c, mod.head_dim, units, wl.dtype, world) for j in (r, 2 * g - 1 - r))
        for r in range(g)
    )
    share = wl.attention_share
    return local * share, prefix * share


def context_hidden(sc: Scenario) -> float:
    """Seconds of the context-parallel key/value collectives hidden per step, each up to the
    machine's overlap efficiency (§4):

    - "all-gather" (axon4d.nn.context): the all-gather runs while the local causal squares' forward
      computes, the reduce-scatter of their gradients while the squares' backward does;
    - "ring" (axon4d.nn.context_ring): each forward shift travels while one ring step's attention
      computes (1/G_z of a block's); in backward each step's shift of the keys and values and of the
      accumulator before it travel together while the step's gradients compute, and the last
      accumulator's trip home is waited for at once. Selective recomputation's forward ring again
      (``recompute.rerun_collectives``) hides as the forward's does."""
    if not sc.context_collectives:
        return 0.0
    local, prefix = attention_seconds(sc)
    if sc.workload.context_mode == "ring":
        return sc.machine.overlap_efficiency * _ring_hidden(sc, local + prefix)
    fwd, bwd = ATTENTION_FORWARD * local, (1 - ATTENTION_FORWARD) * local
    hidden = 0.0
    for c in sc.context_collectives:
        seconds = priced(c, sc)[0]
        hidden += min(seconds, fwd if c.phase == "forward" else bwd)
    return sc.machine.overlap_efficiency * hidden


def _ring_hidden(sc: Scenario, attention: float) -> float:
    """Seconds of the ring's shifts that run behind attention in one step (``context_hidden``), from
    one block's ``attention`` seconds (forward + backward), split evenly over its G_z ring steps."""
    g_z, layers = sc.workload.context_group(sc.shape), sc.model.n_layers
    fwd_step, bwd_step = ATTENTION_FORWARD * attention / g_z, (1 - ATTENTION_FORWARD) * attention / g_z
    kv, grad = (next(c for c in sc.context_collectives if c.term == t) for t in sc.workload.context_terms)
    kv_s, grad_s = priced(kv, sc)[0], priced(grad, sc)[0]
    forward = (g_z - 1) * min(kv_s, fwd_step)
    backward = (g_z - 1) * min(kv_s + grad_s, bwd_step)
    again = forward if sc.recompute in ("selective", "full") else 0.0  # the forward's ring run again
    return layers * (forward + backward + again)


def norm_passes(wl: Workload, shape: GridShape, recompute: str = "none") -> tuple[int, int]:
    """(forward, backward) passes over its (b, hidden/G_x) activations of one norm
    (axon4d.nn.norm, ``Workload.norm_kernel``): ~2 and ~3 for torch's fused LayerNorm (G_x = 1);
    ~5 and ~8 for the elementwise chain (RMSNorm with G_x = 1, and both under balanced
    recomputation, which keeps the statistics); the fused split norm (G_x > 1) scaled from the
    chain's by the kernels torch's profiler counts over the activations — LayerNorm 7 and 12
    against the chain's 9 and 14: ~4 and ~7; RMSNorm 3 and 8 against 7 and 10: ~2 and ~6."""
    kind = wl.norm_kernel(shape, recompute)
    if kind == "torch":
        return (2, 3)
    if kind == "split":
        return (2, 6) if wl.model.arch == "llama" else (4, 7)
    return (5, 8)


def block_extras(sc: Scenario) -> dict[str, tuple[float, float]]:
    """Non-GEMM (forward, backward) seconds following each layer kind in forward order, priced
    without recomputation (what a mode runs again is ``axon4d.plan.recompute``'s)."""
    wl, shape, m, mod = sc.workload, sc.shape, sc.machine, sc.model
    world, elem, b = sc.world, sc.element_size, sc.tokens
    ew = m.elementwise_time
    h_x = mod.hidden // shape.x
    ffn_y = mlp_width(mod) // shape.y
    out: dict[str, tuple[float, float]] = {}
    if wl.attention:
        att = sum(attention_seconds(sc))
        out["qkv"] = (att * ATTENTION_FORWARD, att * (1 - ATTENTION_FORWARD))  # heads → features is a view
    residual = (ew(3 * b * h_x * elem, world), ew(3 * b * h_x * elem, world))  # add; grad fan-out sum
    out["attn_out"] = residual
    out["mlp_down"] = residual
    act = m.activation_time(b * ffn_y * (2 if mod.gated else 1), world)
    out["mlp_up"] = (act[0], act[1])
    if wl.norms:  # the norm before QKV and MLP-up, passes over (b, hidden/G_x) (``norm_passes``)
        fwd, bwd = norm_passes(wl, shape)
        norm = (ew(fwd * b * h_x * elem, world), ew(bwd * b * h_x * elem, world))
        for k in ("attn_out", "mlp_down"):
            out[k] = (out[k][0] + norm[0], out[k][1] + norm[1])
    if "mlp_down" not in {s.name for s in sc.linears}:  # an MoE block without shared experts: no MLP
        after = out.pop("mlp_down")  # the residual add and the norm: after attention's output instead
        out.pop("mlp_up")
        out["attn_out"] = (out["attn_out"][0] + after[0], out["attn_out"][1] + after[1])
    if wl.head:
        vocab_y = mod.vocab_size // shape.y
        out["head"] = (ew(3 * b * vocab_y * 4, world), ew(3 * b * vocab_y * 4, world))  # loss on fp32 logits
    return out
