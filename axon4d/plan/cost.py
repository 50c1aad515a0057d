"""Predicted time of one training step on one grid: compute + communication − overlap (docs/design.md §3, §4, §6).

For every linear layer kind of the ``Workload`` the collectives are exactly the list
``axon4d.geometry.linear_collectives`` returns (E8–E13, normal or transposed layout) — the same
list the communication log is tested against — each priced by ``Machine.comm_time`` on its axis
(group size and rank stride from E1, ``axis_geometry``) with the time model of §3. GEMMs are
priced from the machine's measured throughput at the local shapes; attention, elementwise work and
the optimizer from their own calibrations (§6). ``LayerCost`` is one layer kind's run.

What overlap hides (§4) is ``axon4d.plan.schedule``'s credit over the layers' windows.

Interference: where the machine measured it (``Machine.interference_time``; a host whose ranks
share CPU cores), every collective also costs the compute its ring traffic's bytes take, hidden
or not: interference = κ · Σ ``machine.ring_traffic`` over the step's collectives.

The step is then the sum of three parts and a per-collective cost, weighted by the machine's
in-step scale for the world size (``Machine.step_scale``, fitted by ``axon4d.plan.stepfit`` from
measured steps; 1, 1, 1, 0 for a machine without step calibration):

    step = k_c · (compute + optimizer + interference)
           + k_a · exposed activation all-reduces (E8, E9, embedding lookup)
           + k_w · exposed weight and gradient collectives (E10–E13, replicated gradients)
           + k_n · collectives issued per step (each chunk of E8 is one)
"""

from __future__ import annotations

import dataclasses

from axon4d.geometry import Collective, Term, chunk_sizes, linear_collectives, weight_shard_numel
from axon4d.plan.machine import Machine, ring_traffic
from axon4d.plan.memory import local_param_count
from axon4d.plan.schedule import Window, credit
from axon4d.plan.workload import LinearSpec, Workload
from axon4d.policy import OverlapPolicy
from axon4d.shape import GridShape

#: Collectives that move activations on the critical path; every other one moves weights or gradients.
ACTIVATION_TERMS = frozenset({Term.E8, Term.E9, Term.EMBEDDING})
#: The embedding layer's own collectives (priced with its layer; the other edge collectives apart).
EMBEDDING_TERMS = frozenset({Term.EMBEDDING, Term.EMBEDDING_GRAD})
#: Share of attention's forward + backward seconds that is forward (fwd:bwd ≈ 1:2.3 for flash-style kernels).
ATTENTION_FORWARD = 0.3
#: Overlap mechanisms that hide activation collectives (the rest hide weight/gradient collectives).
ACTIVATION_MECHANISMS = frozenset({"chunks", "oar"})


def axis_geometry(shape: GridShape, axis: str) -> tuple[int, int]:
    """(ranks in one group of ``axis``, distance between consecutive members) — E1, x innermost."""
    x, y, z, d = shape.as_tuple()
    return {
        "x": (x, 1),
        "y": (y, x),
        "z": (z, x * y),
        "data": (d, x * y * z),
        "batch": (z * d, x * y),
        "world": (x * y * z * d, 1),
    }[axis]


#: The planner is told which mechanisms are on with the library's own policy (axon4d.policy).
Overlap = OverlapPolicy


def describe(policy: OverlapPolicy) -> str:
    """The mechanisms that are on, e.g. "oag,oar,ors,odp,chunks=4" ("off" when none): the policy's
    own string form (``OverlapPolicy.spec``), which ``OverlapPolicy.parse`` reads back."""
    return policy.spec()


@dataclasses.dataclass
class LayerCost:
    """Seconds of one run of one linear layer kind (compute and each collective) on one rank."""

    spec: LinearSpec
    fwd: float  # forward GEMM + elementwise of the layer itself
    post_fwd: float  # non-GEMM forward work after the layer (attention, GELU, residual, loss)
    fwd_mm: float  # of which the forward GEMM (one per token chunk of E8)
    dx: float  # input-gradient GEMM dY·W
    dw: float  # weight-gradient GEMM dYᵀ·X (the embedding: zero-fill and scatter-add)
    bwd_ew: float  # the layer's own elementwise backward work (gradient buffers, bias gradient)
    post_bwd: float  # backward of the non-GEMM work after the layer
    comm: dict[Term, float]  # term (E8, E10f, E10b, E9, E11, E12, E13; the embedding's) -> seconds
    comm_axis: dict[Term, str]
    bytes_by_axis: dict[str, int]
    chunks: int = 1  # forward all-reduces E8 is issued as
    calls: int = 0  # collectives the layer issues per run
    fwd_calls: int = 0  # of which in the forward pass
    traffic: float = 0.0  # ring traffic bytes of its collectives per run (machine.ring_traffic)
    fwd_traffic: float = 0.0  # of which in the forward pass

    @property
    def compute_s(self) -> float:
        """Compute seconds of one run: forward, the work after it, and their backward."""
        return self.fwd + self.post_fwd + self.dx + self.dw + self.bwd_ew + self.post_bwd

    def window(self, repeated: bool) -> Window:
        """The layer as the overlap schedule sees it (``repeated``: one of the block's layers)."""
        return Window(
            self.spec.count,
            repeated,
            self.fwd + self.post_fwd,
            self.fwd_mm,
            self.post_bwd + self.dx + self.dw + self.bwd_ew,
            self.dw,
            self.chunks,
            self.comm,
        )

    def report(self, hidden_s: float) -> dict[str, float]:
        """One run's figures as ``TimeEstimate.layers`` gives them (``hidden_s``: what overlap hid)."""
        c = self.comm
        return {
            "count": self.spec.count,
            "compute_s": self.compute_s,
            "comm_s": sum(c.values()),
            "fwd_s": self.fwd + self.post_fwd,
            "fwd_comm_s": c.get(Term.E8, 0.0) + c.get(Term.E10F, 0.0),
            "fwd_collectives": self.fwd_calls,
            "fwd_traffic_bytes": self.fwd_traffic,
            "hidden_s": hidden_s,
            **{comm_field(k): v for k, v in c.items()},
        }


def comm_field(term: Term) -> str:
    """The field of ``LayerCost.report`` (``TimeEstimate.layers``) holding ``term``'s seconds, e.g. "comm_E8"."""
    return f"comm_{term.value}"


def _priced(c: Collective, shape: GridShape, m: Machine) -> tuple[float, float]:
    """(seconds, ring traffic bytes) of one collective on ``shape`` (§3's time model on its axis, E1)."""
    group, stride = axis_geometry(shape, c.axis)
    return (
        m.comm_time(c.op.value, group, stride, c.payload_bytes, shape.world_size),
        ring_traffic(c.op.value, group, c.payload_bytes),
    )


def layer_cost(
    spec: LinearSpec,
    wl: Workload,
    shape: GridShape,
    m: Machine,
    ov: OverlapPolicy,
    post: tuple[float, float] = (0.0, 0.0),
) -> LayerCost:
    """One run of ``spec`` on one rank of ``shape``; ``post``: the (forward, backward) seconds of the
    non-GEMM work after it (``_block_extras``)."""
    world, dt, elem = shape.world_size, wl.dtype, wl.element_size
    b = wl.local_tokens(shape)
    in_l, out_l = spec.local(shape)
    shard = weight_shard_numel(spec.in_features, spec.out_features, shape, spec.transpose)
    ew = m.elementwise_time
    # the gradient shard scaled by 1/G_batch in place (read and write; none when G_batch = 1), and the
    # bias gradient's sum over tokens; dW itself is computed straight into E11's input (no copy)
    scaled = 2 * shard if shape.size("batch") > 1 else 0
    bwd_ew = ew((scaled + (b * out_l if spec.bias else 0)) * elem, world) + 8 * m.op_overhead_s
    comm: dict[Term, float] = {}
    axes: dict[Term, str] = {}
    by_axis: dict[str, int] = {}
    chunks = calls = fwd_calls = 0
    traffic = fwd_traffic = 0.0
    if spec.embedding:  # the lookup's all-reduce over y and the table's gradient all-reduce over batch
        collectives = [c for c in wl.edge_collectives(shape) if c.term in EMBEDDING_TERMS]
    else:
        collectives = linear_collectives(
            spec.in_features,
            spec.out_features,
            b,
            shape,
            transpose=spec.transpose,
            bias=spec.bias,
            element_size=elem,
            cache_weight=ov.oag_keep,
            forward_chunks=ov.forward_chunks,
            min_chunk_bytes=int(ov.min_chunk_kb * 1024),
        )
    for c in collectives:
        if c.term == Term.E9 and not spec.input_grad:
            continue
        chunks += c.term == Term.E8
        calls += 1
        fwd_calls += c.phase == "forward"
        seconds, moved = _priced(c, shape, m)
        comm[c.term] = comm.get(c.term, 0.0) + seconds
        traffic += moved
        fwd_traffic += moved if c.phase == "forward" else 0.0
        axes[c.term] = c.axis
        by_axis[c.axis] = by_axis.get(c.axis, 0) + c.payload_bytes
    chunks = max(chunks, 1)
    if spec.embedding:
        table = (spec.in_features // shape.y) * (spec.out_features // shape.x)
        fwd_mm, dx = 0.0, 0.0
        fwd = ew(4 * b * out_l * elem, world)  # gather rows, mask
        dw = ew((2 * table + 2 * b * out_l) * elem, world)  # zero-fill the table, scatter-add rows
    else:  # the forward GEMM runs as one GEMM per token chunk of E8 (axon4d.nn.linear)
        fwd_mm = sum(m.matmul_time("nt", rows, in_l, out_l, dt, world) for rows in chunk_sizes(b, chunks))
        fwd = fwd_mm + (ew(2 * b * out_l * elem, world) if spec.bias else 0.0)
        dx = m.matmul_time("nn", b, out_l, in_l, dt, world) if spec.input_grad else 0.0
        dw = m.matmul_time("tn", out_l, b, in_l, dt, world)
    return LayerCost(
        spec,
        fwd,
        post[0],
        fwd_mm,
        dx,
        dw,
        bwd_ew,
        post[1],
        comm,
        axes,
        by_axis,
        chunks,
        calls,
        fwd_calls,
        traffic,
        fwd_traffic,
    )


def attention_seconds(wl: Workload, shape: GridShape, m: Machine) -> tuple[float, float]:
    """(local, prefix) seconds of one block's core attention, forward + backward, on one rank.

    Whole sequences: every sequence's causal attention over this rank's heads (n/G_y), all local.
    Context parallelism (docs/context.md): per sequence and head, each of the rank's two query chunks
    of C = S/(2·G_z) tokens attends causally to its own chunk (a causal square of C, run while the
    keys and values of the other chunks are gathered: "local") and, unmasked, to the chunks before
    it — r·C and (2·G_z−1−r)·C keys on z-rank r ("prefix"); the slowest z-rank is priced."""
    mod, world = wl.model, shape.world_size
    heads = mod.n_heads // shape.y
    if not (wl.context_parallel and shape.z > 1):
        return m.attention_time(mod.seq_len, mod.head_dim, wl.local_sequences(shape) * heads, wl.dtype, world), 0.0
    units = wl.local_tokens(shape) * shape.z // mod.seq_len * heads  # B/G_data sequences, this rank's heads
    c = mod.seq_len // (2 * shape.z)
    local = 2 * m.attention_time(c, mod.head_dim, units, wl.dtype, world)
    prefix = max(
        sum(m.prefix_attention_time(c, j * c, mod.head_dim, units, wl.dtype, world) for j in (r, 2 * shape.z - 1 - r))
        for r in range(shape.z)
    )
    return local, prefix


def context_hidden(wl: Workload, shape: GridShape, m: Machine) -> float:
    """Seconds of the context-parallel key/value collectives hidden per step: the all-gather runs
    while the local causal squares' forward computes, the reduce-scatter of their gradients while
    the squares' backward does (axon4d.nn.context), each hidden up to the machine's overlap
    efficiency (§4)."""
    collectives = wl.context_collectives(shape)
    if not collectives:
        return 0.0
    local = attention_seconds(wl, shape, m)[0]
    fwd, bwd = ATTENTION_FORWARD * local, (1 - ATTENTION_FORWARD) * local
    hidden = 0.0
    for c in collectives:
        seconds = _priced(c, shape, m)[0]
        hidden += min(seconds, fwd if c.phase == "forward" else bwd)
    return m.overlap_efficiency * hidden


def norm_passes(wl: Workload, shape: GridShape, recompute: str = "none") -> tuple[int, int]:
    """(forward, backward) passes over its activations of one norm (axon4d.nn.norm): ~5 and ~8 for
    the elementwise chain around the statistics, ~2 and ~3 for LayerNorm with G_x = 1, which is
    torch's fused kernel — except under balanced recomputation, which keeps the statistics and so
    takes the chain."""
    return (2, 3) if wl.fused_norms(shape, recompute) else (5, 8)


def _block_extras(wl: Workload, shape: GridShape, m: Machine) -> dict[str, tuple[float, float]]:
    """Non-GEMM (forward, backward) seconds following each layer kind in forward order."""
    mod, world, elem = wl.model, shape.world_size, wl.element_size
    b = wl.local_tokens(shape)
    ew = m.elementwise_time
    h_x = mod.hidden // shape.x
    ffn_y = mod.ffn // shape.y
    out: dict[str, tuple[float, float]] = {}
    if wl.attention:
        att = sum(attention_seconds(wl, shape, m))
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
    if wl.head:
        vocab_y = mod.vocab_size // shape.y
        out["head"] = (ew(3 * b * vocab_y * 4, world), ew(3 * b * vocab_y * 4, world))  # loss on fp32 logits
    return out


def recomputed_seconds(wl: Workload, shape: GridShape, m: Machine, recompute: str) -> float:
    """Forward work one block runs again in backward under ``selective`` or ``balanced``
    recomputation (docs/design.md §5; ``full`` re-runs whole layers, priced by the search).

    selective: core attention's forward (its ``ATTENTION_FORWARD`` share of forward + backward).
    balanced: the activation and the two norms' normalisation, each twice — once when the consuming
    GEMM's backward re-makes its input, once in the op's own backward — and, where LayerNorm would
    otherwise be torch's fused kernel (G_x = 1), the two norms' elementwise chain instead.
    """
    mod, world, elem = wl.model, shape.world_size, wl.element_size
    b = wl.local_tokens(shape)
    if recompute == "selective":
        if not wl.attention:
            return 0.0
        return ATTENTION_FORWARD * sum(attention_seconds(wl, shape, m))
    if recompute == "balanced":
        act = m.activation_time(b * mod.ffn // shape.y * (2 if mod.gated else 1), world)[0]
        h_x = mod.hidden // shape.x
        normalize = m.elementwise_time(3 * b * h_x * elem, world) if wl.norms else 0.0
        # the step prices each norm by ``norm_passes`` without recomputation; balanced takes the chain
        chain = sum(norm_passes(wl, shape, "balanced")) - sum(norm_passes(wl, shape))
        unfused = m.elementwise_time(chain * b * h_x * elem, world) if wl.norms else 0.0
        return 2 * (act + 2 * normalize) + 2 * unfused
    return 0.0


@dataclasses.dataclass
class TimeEstimate:
    """Predicted seconds of one step on one rank, and where they go.

    ``compute_s``, ``comm_s`` and ``hidden_s`` are the unscaled model; ``step_s`` weights the three
    parts (compute, exposed activation collectives, exposed weight/gradient collectives) and the
    number of collectives by ``scale`` — the machine's in-step scale (``Machine.step_scale``)."""

    compute_s: float  # GEMMs, attention, elementwise work and the optimizer
    matmul_s: float
    optimizer_s: float
    comm_s: float  # all collectives as if serial
    hidden_s: float  # the part of comm_s overlap hides
    comm_by_axis: dict[str, float]
    bytes_by_axis: dict[str, int]
    hidden_by_mechanism: dict[str, float]
    layers: dict[str, dict[str, float]]
    activation_comm_s: float = 0.0  # the part of comm_s in ACTIVATION_TERMS
    collectives: int = 0  # issued per step on one rank (the communication log's count)
    traffic_bytes: float = 0.0  # ring traffic of those collectives (machine.ring_traffic)
    interference_s: float = 0.0  # compute lost to that traffic (Machine.interference_time)
    scale: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 0.0)  # (k_c, k_a, k_w, k_n s per collective)

    @property
    def parts(self) -> tuple[float, float, float]:
        """(compute with interference, exposed activation collectives, exposed weight/gradient
        collectives), unscaled."""
        act_hidden = sum(v for k, v in self.hidden_by_mechanism.items() if k in ACTIVATION_MECHANISMS)
        return (
            self.compute_s + self.interference_s,
            self.activation_comm_s - act_hidden,
            self.comm_s - self.activation_comm_s - (self.hidden_s - act_hidden),
        )

    @property
    def step_s(self) -> float:
        k_c, k_a, k_w, k_n = self.scale
        compute, activation, weight = self.parts
        return k_c * compute + k_a * activation + k_w * weight + k_n * self.collectives

    @property
    def exposed_comm_s(self) -> float:
        return self.comm_s - self.hidden_s

    @property
    def hidden_pct(self) -> float:
        return 100.0 * self.hidden_s / self.comm_s if self.comm_s > 0 else 0.0


@dataclasses.dataclass
class _Totals:
    """The per-step sums on one rank, as layers and collectives are added (unscaled seconds)."""

    compute: float = 0.0
    matmul: float = 0.0
    comm: float = 0.0
    activation_comm: float = 0.0  # the part of comm in ACTIVATION_TERMS
    traffic: float = 0.0
    calls: int = 0
    comm_by_axis: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes_by_axis: dict[str, int] = dataclasses.field(default_factory=dict)

    def add_layer(self, lc: LayerCost) -> None:
        """Every run of one layer kind: its compute, GEMMs and collectives."""
        n, c = lc.spec.count, lc.comm
        self.compute += n * lc.compute_s
        self.matmul += n * (lc.fwd_mm + lc.dx + lc.dw)
        self.comm += n * sum(c.values())
        self.activation_comm += n * sum(t for term, t in c.items() if term in ACTIVATION_TERMS)
        self.calls += n * lc.calls
        self.traffic += n * lc.traffic
        for term, t in c.items():
            axis = lc.comm_axis[term]
            self.comm_by_axis[axis] = self.comm_by_axis.get(axis, 0.0) + n * t
        for axis, nb in lc.bytes_by_axis.items():
            self.bytes_by_axis[axis] = self.bytes_by_axis.get(axis, 0) + n * nb

    def add_collective(self, c: Collective, seconds: float, traffic: float) -> None:
        """One collective outside the layers, priced (``_priced``) and never hidden."""
        self.comm += seconds
        self.calls += 1
        self.traffic += traffic
        self.comm_by_axis[c.axis] = self.comm_by_axis.get(c.axis, 0.0) + seconds
        self.bytes_by_axis[c.axis] = self.bytes_by_axis.get(c.axis, 0) + c.payload_bytes


def _repeated(spec: LinearSpec, wl: Workload) -> bool:
    """Whether ``spec`` is one of the block's layers, repeated n_layers times."""
    return spec.count == wl.model.n_layers and not spec.embedding and spec.name != "head"


def step_time(
    wl: Workload,
    shape: GridShape,
    machine: Machine,
    overlap: OverlapPolicy = OverlapPolicy(),
    params_local: int | None = None,
) -> TimeEstimate:
    """Predicted seconds of one forward + backward + optimizer step on ``shape`` (one rank).

    ``params_local``: the rank's parameter elements (``memory.local_param_count``, computed when None)."""
    extras = _block_extras(wl, shape, machine)
    layers = [layer_cost(s, wl, shape, machine, overlap, extras.get(s.name, (0.0, 0.0))) for s in wl.linears()]
    hidden = credit([lc.window(_repeated(lc.spec, wl)) for lc in layers], overlap, machine.overlap_efficiency)
    hidden_cp = context_hidden(wl, shape, machine)
    totals = _Totals()
    for lc in layers:
        totals.add_layer(lc)
    for c in wl.edge_collectives(shape):  # replicated parameters' gradients: waited on in their hooks
        if c.term not in EMBEDDING_TERMS:  # the embedding's are its layer's (``layer_cost``)
            totals.add_collective(c, *_priced(c, shape, machine))
    if params_local is None:
        params_local = local_param_count(wl, shape)
    opt = machine.optimizer_time(params_local, shape.world_size, wl.optimizer)
    return TimeEstimate(
        compute_s=totals.compute + opt,
        matmul_s=totals.matmul,
        optimizer_s=opt,
        comm_s=totals.comm,
        hidden_s=hidden.total + hidden_cp,
        comm_by_axis=totals.comm_by_axis,
        bytes_by_axis=totals.bytes_by_axis,
        hidden_by_mechanism={**hidden.by_mechanism, **({"context": hidden_cp} if hidden_cp else {})},
        layers={lc.spec.name: lc.report(h) for lc, h in zip(layers, hidden.per_window)},
        activation_comm_s=totals.activation_comm,
        collectives=totals.calls,
        traffic_bytes=totals.traffic,
        interference_s=machine.interference_time(totals.traffic, shape.world_size),
        scale=machine.step_scale_for(shape.world_size),
    )
