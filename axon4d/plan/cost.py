"""Predicted time of one training step on one grid: compute + communication − overlap (docs/design.md §3, §4, §6).

For every linear layer kind of the ``Workload`` the collectives are exactly the list
``axon4d.geometry.linear_collectives`` returns (E8–E13, normal or transposed layout) — the same
list the communication log is tested against — each priced by ``Machine.comm_time`` on its axis
(group size and rank stride from E1). GEMMs are priced from the machine's measured throughput at
the local shapes; attention, elementwise work and the optimizer from their own calibrations.

Overlap (§4) is credited per layer window, never more than the compute in that window times the
machine's ``overlap_efficiency``:

    forward window of layer i  = its GEMM + the non-GEMM work after it (attention, GELU, …)
        hides: OAG — layer i+1's Z all-gather (E10) prefetched;
               chunked E8 — (k−1)/k of layer i's forward all-reduce, within (k−1)/k of its GEMM
                 (k from ``geometry.forward_chunk_count``, as the layer chunks it)
    backward window of layer i = the non-GEMM backward work after layer i + its dX and dW GEMMs
        hides: OAR — layer i's E9 all-reduce, within its dW GEMM;
               ORS — layer i+1's E11 reduce-scatter; ODP — layer i+1's E12 (and E13) all-reduce;
               OAG — layer i−1's backward all-gather prefetched
    deeper overlap: with ``oag_depth`` d > 1 a gather is issued d layers ahead, so what of it the
        window before its layer could not hide may go into the spare of the d − 1 windows before
        that; with ``ors_inflight`` k > 1 a reduce-scatter may spill into the k − 1 backward
        windows after its own. Spare is handed out in the order the collectives were issued (one
        link, first come first served), over the repeated block in its steady state
        (``_deeper_overlap``)

Block layers are repeated n_layers times and their neighbours wrap around the block. Which
mechanisms are on is the library's own ``axon4d.overlap.OverlapPolicy`` (default: all on).

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
from typing import Any

from axon4d.shape import GridShape
from axon4d.policy import OverlapPolicy
from axon4d.plan.machine import Machine, ring_traffic
from axon4d.plan.workload import LinearSpec, Workload
from axon4d.geometry import chunk_sizes, linear_collectives, weight_shard_numel

#: Collectives that move activations on the critical path (their term keys); every other one
#: moves weights or gradients.
ACTIVATION_TERMS = frozenset({"E8", "E9", "embedding"})
#: Overlap mechanisms that hide activation collectives (the rest hide weight/gradient collectives).
ACTIVATION_MECHANISMS = frozenset({"chunks", "oar"})


def axis_geometry(shape: GridShape, axis: str) -> tuple[int, int]:
    """(ranks in one group of ``axis``, distance between consecutive members) — E1, x innermost."""
    x, y, z, d = shape.as_tuple()
    return {"x": (x, 1), "y": (y, x), "z": (z, x * y), "data": (d, x * y * z), "batch": (z * d, x * y),
            "world": (x * y * z * d, 1)}[axis]


#: The planner is told which mechanisms are on with the library's own policy (axon4d.overlap).
Overlap = OverlapPolicy


def parse_overlap(spec: Any) -> OverlapPolicy:
    """An overlap policy from anything ``OverlapPolicy.parse`` takes ("all", "off", "oag,oar", …)."""
    return OverlapPolicy.parse(spec)


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
    fwd_mm: float
    dx: float
    dw: float
    bwd_ew: float
    post_bwd: float  # backward of the non-GEMM work after the layer
    comm: dict[str, float]  # term key ("E8", "E10f", "E10b", "E9", "E11", "E12", "E13") -> seconds
    comm_axis: dict[str, str]
    bytes_by_axis: dict[str, int]
    chunks: int = 1  # forward all-reduces E8 is issued as
    calls: int = 0  # collectives the layer issues per run
    fwd_calls: int = 0  # of which in the forward pass
    traffic: float = 0.0  # ring traffic bytes of its collectives per run (machine.ring_traffic)
    fwd_traffic: float = 0.0  # of which in the forward pass


def _layer_cost(spec: LinearSpec, wl: Workload, shape: GridShape, m: Machine, ov: OverlapPolicy) -> LayerCost:
    world, dt, elem = shape.world_size, wl.dtype, wl.element_size
    b = wl.local_tokens(shape)
    in_l, out_l = spec.local(shape)
    shard = weight_shard_numel(spec.in_features, spec.out_features, shape, spec.transpose)
    n_w = shard * shape.z
    ew = m.elementwise_time
    bwd_ew = ew((2 * n_w + 2 * shard + (b * out_l if spec.bias else 0)) * elem, world) + 8 * m.op_overhead_s
    comm: dict[str, float] = {}
    axes: dict[str, str] = {}
    by_axis: dict[str, int] = {}
    chunks = calls = fwd_calls = 0
    traffic = fwd_traffic = 0.0
    if spec.embedding:  # the lookup's all-reduce over y and the table's gradient all-reduce over batch
        collectives = [c for c in wl.edge_collectives(shape) if c.term.startswith("embedding")]
    else:
        collectives = linear_collectives(spec.in_features, spec.out_features, b, shape, transpose=spec.transpose,
                                         bias=spec.bias, element_size=elem, cache_weight=ov.oag_keep,
                                         forward_chunks=ov.forward_chunks, min_chunk_bytes=int(ov.min_chunk_kb * 1024))
    for c in collectives:
        if c.term == "E9" and not spec.input_grad:
            continue
        group, stride = axis_geometry(shape, c.axis)
        key = c.term + ("f" if c.term == "E10" and c.phase == "forward" else "b" if c.term == "E10" else "")
        chunks += c.term == "E8"
        calls += 1
        fwd_calls += c.phase == "forward"
        comm[key] = comm.get(key, 0.0) + m.comm_time(c.op.value, group, stride, c.payload_bytes, world)
        moved = ring_traffic(c.op.value, group, c.payload_bytes)
        traffic += moved
        fwd_traffic += moved if c.phase == "forward" else 0.0
        axes[key] = c.axis
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
    return LayerCost(spec, fwd, 0.0, fwd_mm, dx, dw, bwd_ew, 0.0, comm, axes, by_axis, chunks, calls, fwd_calls,
                     traffic, fwd_traffic)


def _block_extras(wl: Workload, shape: GridShape, m: Machine) -> dict[str, tuple[float, float]]:
    """Non-GEMM (forward, backward) seconds following each layer kind in forward order."""
    mod, world, elem = wl.model, shape.world_size, wl.element_size
    b = wl.local_tokens(shape)
    ew = m.elementwise_time
    h_x = mod.hidden // shape.x
    ffn_y = mod.ffn // shape.y
    out: dict[str, tuple[float, float]] = {}
    if wl.attention:
        units = (b // mod.seq_len) * (mod.n_heads // shape.y)
        att = m.attention_time(mod.seq_len, mod.head_dim, units, wl.dtype, world)
        out["qkv"] = (att * 0.3, att * 0.7)  # fwd:bwd ≈ 1:2.3 for flash-style kernels (heads → features is a view)
    residual = (ew(3 * b * h_x * elem, world), ew(3 * b * h_x * elem, world))  # add; grad fan-out sum
    out["attn_out"] = residual
    out["mlp_down"] = residual
    act = m.activation_time(b * ffn_y * (2 if mod.gated else 1), world)
    out["mlp_up"] = (act[0], act[1])
    if wl.norms:  # the norm before QKV and MLP-up: ~5 passes forward, ~8 backward over (b, hidden/G_x)
        norm = (ew(5 * b * h_x * elem, world), ew(8 * b * h_x * elem, world))
        for k in ("attn_out", "mlp_down"):
            out[k] = (out[k][0] + norm[0], out[k][1] + norm[1])
    if wl.head:
        vocab_y = mod.vocab_size // shape.y
        out["head"] = (ew(3 * b * vocab_y * 4, world), ew(3 * b * vocab_y * 4, world))  # loss on fp32 logits
    return out


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
        return (self.compute_s + self.interference_s, self.activation_comm_s - act_hidden,
                self.comm_s - self.activation_comm_s - (self.hidden_s - act_hidden))

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


def step_time(wl: Workload, shape: GridShape, machine: Machine, overlap: OverlapPolicy = OverlapPolicy(),
              params_local: int | None = None) -> TimeEstimate:
    """Predicted seconds of one forward + backward + optimizer step on ``shape`` (one rank)."""
    layers = [_layer_cost(s, wl, shape, machine, overlap) for s in wl.linears()]
    extras = _block_extras(wl, shape, machine)
    for lc in layers:
        lc.post_fwd, lc.post_bwd = extras.get(lc.spec.name, (0.0, 0.0))
    eff = machine.overlap_efficiency
    block = [i for i, lc in enumerate(layers) if lc.spec.count == wl.model.n_layers and not lc.spec.embedding
             and lc.spec.name != "head"]

    def neighbour(i: int, step: int) -> LayerCost | None:
        if i in block:
            pos = block.index(i) + step
            return layers[block[pos % len(block)]]
        j = i + step
        return layers[j] if 0 <= j < len(layers) else None

    hidden = {"oag": 0.0, "oar": 0.0, "ors": 0.0, "odp": 0.0, "chunks": 0.0}
    spare_f: dict[int, float] = {}  # window -> capacity left after the one-window credits below
    spare_b: dict[int, float] = {}
    short: dict[str, dict[int, float]] = {"oag_f": {}, "oag_b": {}, "ors": {}}  # window -> not yet hidden
    compute = matmul = comm = activation_comm = traffic = 0.0
    calls = 0
    comm_by_axis: dict[str, float] = {}
    bytes_by_axis: dict[str, int] = {}
    per_layer: dict[str, dict[str, float]] = {}
    for i, lc in enumerate(layers):
        n = lc.spec.count
        c = lc.comm
        # forward window
        cap = eff * (lc.fwd + lc.post_fwd)
        h_f = 0.0
        if lc.chunks > 1:
            k = lc.chunks
            h = min(c["E8"] * (k - 1) / k, eff * lc.fwd_mm * (k - 1) / k, cap)
            hidden["chunks"] += n * h
            h_f += h
        nxt = neighbour(i, +1)
        if overlap.oag and nxt is not None:
            h = min(nxt.comm.get("E10f", 0.0), cap - h_f)
            hidden["oag"] += n * h
            h_f += h
            short["oag_f"][i] = nxt.comm.get("E10f", 0.0) - h
        spare_f[i] = cap - h_f
        # backward window
        cap = eff * (lc.post_bwd + lc.dx + lc.dw + lc.bwd_ew)
        h_b = 0.0
        if overlap.oar and "E9" in c:
            h = min(c["E9"], eff * lc.dw, cap)
            hidden["oar"] += n * h
            h_b += h
        later = neighbour(i, +1)  # its backward ran just before this layer's
        if later is not None:
            if overlap.ors:
                h = min(later.comm.get("E11", 0.0), cap - h_b)
                hidden["ors"] += n * h
                h_b += h
                short["ors"][i] = later.comm.get("E11", 0.0) - h
            if overlap.odp:
                h = min(later.comm.get("E12", 0.0) + later.comm.get("E13", 0.0), cap - h_b)
                hidden["odp"] += n * h
                h_b += h
        earlier = neighbour(i, -1)
        if overlap.oag and earlier is not None and not overlap.oag_keep:
            h = min(earlier.comm.get("E10b", 0.0), cap - h_b)
            hidden["oag"] += n * h
            h_b += h
            short["oag_b"][i] = earlier.comm.get("E10b", 0.0) - h
        spare_b[i] = cap - h_b
        layer_compute = lc.fwd + lc.post_fwd + lc.dx + lc.dw + lc.bwd_ew + lc.post_bwd
        compute += n * layer_compute
        matmul += n * (lc.fwd_mm + lc.dx + lc.dw)
        comm += n * sum(c.values())
        activation_comm += n * sum(t for key, t in c.items() if key in ACTIVATION_TERMS)
        calls += n * lc.calls
        traffic += n * lc.traffic
        for key, t in c.items():
            comm_by_axis[lc.comm_axis[key]] = comm_by_axis.get(lc.comm_axis[key], 0.0) + n * t
        for axis, nb in lc.bytes_by_axis.items():
            bytes_by_axis[axis] = bytes_by_axis.get(axis, 0) + n * nb
        per_layer[lc.spec.name] = {"count": n, "compute_s": layer_compute, "comm_s": sum(c.values()),
                                   "fwd_s": lc.fwd + lc.post_fwd, "fwd_comm_s": c.get("E8", 0.0) + c.get("E10f", 0.0),
                                   "fwd_collectives": lc.fwd_calls, "fwd_traffic_bytes": lc.fwd_traffic,
                                   "hidden_s": h_f + h_b, **{f"comm_{k}": v for k, v in c.items()}}
    if block:
        for mech, window, h in _deeper_overlap(block, spare_f, spare_b, short, overlap):
            n = layers[window].spec.count
            hidden[mech] += n * h
            per_layer[layers[window].spec.name]["hidden_s"] += h
    for c in wl.edge_collectives(shape):  # replicated parameters' gradients: waited on in their hooks
        if c.term.startswith("embedding"):
            continue
        group, stride = axis_geometry(shape, c.axis)
        t_c = machine.comm_time(c.op.value, group, stride, c.payload_bytes, shape.world_size)
        comm += t_c
        calls += 1
        traffic += ring_traffic(c.op.value, group, c.payload_bytes)
        comm_by_axis[c.axis] = comm_by_axis.get(c.axis, 0.0) + t_c
        bytes_by_axis[c.axis] = bytes_by_axis.get(c.axis, 0) + c.payload_bytes
    if params_local is None:
        from axon4d.plan.memory import local_param_count

        params_local = local_param_count(wl, shape)
    opt = machine.optimizer_time(params_local, shape.world_size)
    return TimeEstimate(
        compute_s=compute + opt, matmul_s=matmul, optimizer_s=opt, comm_s=comm, hidden_s=sum(hidden.values()),
        comm_by_axis=comm_by_axis, bytes_by_axis=bytes_by_axis, hidden_by_mechanism=hidden, layers=per_layer,
        activation_comm_s=activation_comm, collectives=calls, traffic_bytes=traffic,
        interference_s=machine.interference_time(traffic, shape.world_size), scale=machine.step_scale_for(shape.world_size),
    )


def _deeper_overlap(block: list[int], spare_f: dict[int, float], spare_b: dict[int, float],
                    short: dict[str, dict[int, float]], overlap: OverlapPolicy) -> list[tuple[str, int, float]]:
    """(mechanism, window, seconds) hidden beyond the one-window credits of ``step_time``.

    ``block`` lists the repeated layers' indices in forward order; ``spare_f``/``spare_b`` map each
    to the capacity its forward/backward window has left; ``short`` maps each window to what of the
    collective credited there is still exposed: "oag_f" the next layer's forward gather, "oag_b"
    the previous layer's backward gather, "ors" the later layer's reduce-scatter. With
    ``oag_depth`` d a gather was issued d − 1 windows before the one credited, and may use those
    windows' spare; with ``ors_inflight`` k a reduce-scatter may use the k − 1 backward windows
    after its own. The block is unrolled over enough repetitions that the middle one sees the
    steady state (every window has neighbours on both sides); its credits are returned, per run of
    the block. Each window's spare goes to the collectives in the order they were issued."""
    d = overlap.oag_depth if overlap.oag else 1
    k = overlap.ors_inflight if overlap.ors else 1
    reach = max(d, k) - 1
    if reach == 0:
        return []
    size = len(block)
    periods = 4 * -(-reach // size) + 1
    middle = range((periods // 2) * size, (periods // 2 + 1) * size)
    out: list[tuple[str, int, float]] = []
    mechanism = {"oag_f": "oag", "oag_b": "oag", "ors": "ors"}

    def hand_out(order: list[int], spare: dict[int, float], jobs: list[tuple[int, str, int, range]]) -> None:
        """``jobs``: (issue position, mechanism, owner position, window positions), in any order;
        positions index the unrolled ``order`` (layer indices, in the pass's own order)."""
        left = [spare[order[t % size]] for t in range(periods * size)]
        for _, mech, owner, windows in sorted(jobs, key=lambda j: (j[0], j[2])):
            need = short[mech][order[owner % size]]
            for t in windows:
                if need <= 0:
                    break
                if 0 <= t < len(left) and left[t] > 0:
                    h = min(need, left[t])
                    left[t] -= h
                    need -= h
                    if owner in middle:
                        out.append((mechanism[mech], order[t % size], h))

    if d > 1 and short["oag_f"]:  # the gather credited at window t was issued at window t − d + 1
        hand_out(block, spare_f, [(t - d + 1, "oag_f", t, range(t - d + 1, t))
                                  for t in range(periods * size) if block[t % size] in short["oag_f"]])
    backward = block[::-1]
    jobs = []
    if d > 1 and short["oag_b"]:
        jobs += [(t - d + 1, "oag_b", t, range(t - d + 1, t))
                 for t in range(periods * size) if backward[t % size] in short["oag_b"]]
    if k > 1 and short["ors"]:  # issued just before window t, left running for k − 1 more windows
        jobs += [(t - 1, "ors", t, range(t + 1, t + k))
                 for t in range(periods * size) if backward[t % size] in short["ors"]]
    if jobs:
        hand_out(backward, spare_b, jobs)
    return out
