"""What one training step of a transformer asks of one rank, as the planner sees it (docs/design.md §2, §6).

A ``Workload`` is a model (``ModelConfig``), a global batch of sequences and a precision: the
compute ``dtype`` and the precision preset (``precision``, a name of ``axon4d.options.precision.NAMED``)
that says what every collective moves (``axon4d.layout.geometry.wire_dtype``) — by default "fp32" for
float32 and "bf16-fp32-reduce" for bfloat16 (the training job's ``--precision auto`` on an
accelerator: bf16 compute, fp32 master weights and gradient reductions). Its linear
layers are the block's layers in the layouts the block really uses — QKV normal, attention output
transposed, MLP up normal, MLP down transposed (``ModelConfig.linear_shapes()``) — repeated
``n_layers`` times, plus at the edges:

- the token embedding as ``axon4d.nn.VocabParallelEmbedding`` holds it: a (vocab/G_y, hidden/G_x)
  block replicated over z and data; the lookup's partial rows are all-reduced over y and the
  table's gradient over batch (``edge_collectives``);
- the output head, a normal layer hidden → vocab without bias (vocab-parallel logits over y).

Parameters replicated over batch (norms, position embeddings, an MoE layer's router) have their
gradients all-reduced over batch, one collective per tensor.

A Mixture-of-Experts model (``n_experts`` > 0, docs/moe.md) has in each block, instead of the dense
MLP, the MoE layer — placed by ``axon4d.plan.moe_placement``, priced by ``axon4d.plan.moe_cost``
(its collectives and compute) and ``axon4d.plan.moe_memory`` (its weights and what it saves) under
a stated routing assumption (uniform routing, ``imbalance`` for the busiest rank) — and its shared
experts as an MLP of Linear layers (``block_shapes``); its placement rules join the grid's
(``rules``), and its FLOPs count the active path only (``flops``).

With ``context_parallel`` (docs/context.md) the tokens of each sequence are split head–tail over z
and whole sequences over data only: a rank still holds B·S/(G_data·G_z) tokens, so every linear
layer is priced as before, and each layer adds the all-gather over z of the keys and values of the
rank's own key/value heads (forward) and the reduce-scatter of their gradients (backward). ``rules`` lists the divisibility rules a grid must satisfy
for this workload (§1) as the layers state them (``axon4d.grid.rules``); ``grid_problems`` says which a
grid breaks, and the search evaluates the same rules on every grid at once.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

from axon4d.config import ModelConfig
from axon4d.device import DTYPES
from axon4d.grid import rules as grid_rules
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.shape import GridShape
from axon4d.layout.geometry import (
    Collective,
    Op,
    Term,
    data_part_numel,
    layer_axes,
    norm_statistics_wire,
    wire_element_size,
)
from axon4d.options.context_mode import MODES, context_axis
from axon4d.options.precision import NAMED, Precision
from axon4d.plan.blocks import block_kinds, kind_shapes
from axon4d.plan.moe_placement import moe_rules, placement

#: optimizers the planner prices: name → fp32 state bytes per parameter (master weights aside)
OPTIMIZERS = {"adam": 8, "sgd": 0}
#: the precision a workload of each compute dtype trains in when none is named: fp32 on the host,
#: the training job's default on an accelerator (``axon4d.options.precision.AUTO_ACCELERATOR``) for bfloat16
DEFAULT_PRECISION = {"float32": "fp32", "bfloat16": "bf16-fp32-reduce"}


def dtype_name(dtype: object) -> str:
    """The name ``DTYPES`` gives ``dtype`` (e.g. "bfloat16")."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def unmixed_precision(dtype: str) -> str:
    """The preset whose collectives move what a model whose parameters are ``dtype`` itself moves
    on a grid without mixed precision (``axon4d.measure.probe.ProbeModel``: no fp32 masters, its
    gradients reduced in ``dtype``): "fp32" for float32, "bf16" for bfloat16."""
    return "fp32" if dtype == "float32" else "bf16"


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """One linear layer kind of the step: shape, layout, and how many times it runs."""

    name: str
    in_features: int
    out_features: int
    transpose: bool
    bias: bool
    count: int
    input_grad: bool = True  # False for the embedding (token ids have no gradient)
    embedding: bool = False  # a lookup: no forward GEMM, a scatter-add for dW

    def local(self, shape: GridShape) -> tuple[int, int]:
        """(in/G_in, out/G_out) features of this rank's block."""
        in_axis, out_axis = layer_axes(self.transpose)
        return self.in_features // shape.size(in_axis), self.out_features // shape.size(out_axis)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, a global batch (sequences per step), the training precision and the optimizer
    (``OPTIMIZERS``: "adam", two fp32 states per parameter; "sgd", plain SGD without momentum, none).

    ``dtype`` is the compute dtype and ``precision`` the preset (``axon4d.options.precision.NAMED``) — what
    the collectives move; give either, or both when they agree: ``dtype`` alone takes
    ``DEFAULT_PRECISION`` ("fp32", "bf16-fp32-reduce"), ``precision`` alone its compute dtype,
    neither bfloat16 with "bf16-fp32-reduce". A precision whose compute dtype is not ``dtype``
    (e.g. "fp32" with dtype bfloat16) is a ValueError. ``dtype`` is filled in when left out;
    ``precision`` stays as given ("": by ``dtype``, so ``dataclasses.replace(wl, dtype="float32")``
    trains in fp32) and ``preset`` is its resolved name. ``Scenario.fp8_gather`` turns
    "bf16-fp32-reduce" into "bf16-fp8-gather" (``scenario.step_precision``). ``async_save``: the job
    keeps a host snapshot of its state for asynchronous checkpoints (``axon4d.plan.host_memory``)."""

    model: ModelConfig
    batch: int
    dtype: str = ""  # "": the precision's compute dtype (bfloat16 when neither is given)
    embedding: bool = True
    head: bool = True
    attention: bool = True
    norms: bool = True
    optimizer: str = "adam"
    context_parallel: bool = False
    #: with ``context_parallel``, how keys and values reach the ranks: "all-gather" or "ring"
    #: (``axon4d.options.context_mode``; ignored without it)
    context_mode: str = "all-gather"
    #: with ``context_parallel``, the axes each sequence is split over: "z" (sequences over data) or
    #: "z,data" (hierarchical: over z and data together, the batch axis; ``options.context_mode``)
    context_axes: str = "z"
    #: packed documents (docs/context.md): each sequence holds documents of this many tokens (the
    #: last one shorter where it does not divide S), attention only within each; 0: one document
    document_tokens: int = 0
    async_save: bool = False  # the job checkpoints with --async-save: a pinned snapshot (plan.host_memory)
    accelerator: bool = False  # the step runs on accelerators (a Scenario sets it from its machine): ``norm_kernel``
    precision: str = ""  # as given; "": DEFAULT_PRECISION of dtype (``preset``)
    imbalance: float = 1.0  # MoE: the busiest rank's rows over the mean under uniform routing (plan.moe_placement)
    #: MoE: where the experts run (axon4d.grid.expert_layout; text is parsed); the default: over batch, split over x·y
    expert_layout: ExpertLayout = ExpertLayout()
    #: under FP8 GEMMs, layer kinds (``layer_kind``) whose choice is made already, (kind, FP8?) each:
    #: in a block kind's step of a mixed model, the choice the model's blocks of both kinds made
    #: together (``axon4d.plan.fp8.kind_choices``, ``Scenario.kinds``), whatever this kind's own price
    decided_kinds: tuple[tuple[str, bool], ...] = ()

    def __post_init__(self) -> None:
        self._resolve_precision()
        object.__setattr__(self, "expert_layout", ExpertLayout.parse(self.expert_layout))  # frozen: set once
        if self.model.moe and self.context_parallel:
            raise ValueError(
                "context parallelism with Mixture-of-Experts layers is not priced (nor tested in the runtime): "
                "use context_parallel=False for an MoE model"
            )
        context_axis(self.context_axes)  # a ValueError naming the choices
        if self.context_mode not in MODES:
            raise ValueError(
                f"context_mode = {self.context_mode!r}: choose one of {', '.join(MODES)} (docs/context.md)"
            )
        if (
            isinstance(self.document_tokens, bool)
            or not isinstance(self.document_tokens, int)
            or not (0 <= self.document_tokens <= self.model.seq_len)
        ):
            raise ValueError(
                f"document_tokens = {self.document_tokens!r}: the tokens of each packed document, a whole number from "
                f"1 to the sequence length {self.model.seq_len} (0: one document per sequence)"
            )
        if isinstance(self.imbalance, bool) or not isinstance(self.imbalance, numbers.Real) or self.imbalance < 1:
            raise ValueError(
                f"imbalance = {self.imbalance!r}: the busiest rank's MoE rows over the mean is a number ≥ 1 "
                "(1: uniform routing, e.g. 1.25 for a rank 25% above the mean)"
            )
        if self.context_parallel and self.model.seq_len % 2:
            raise ValueError(
                f"seq_len = {self.model.seq_len} is odd, but context parallelism cuts each sequence into 2·G_z equal "
                f"chunks (an even count for any G_z); use seq_len = {self.model.seq_len - 1} or "
                f"{self.model.seq_len + 1}, or context_parallel=False"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not priced; use one of {list(OPTIMIZERS)}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, numbers.Integral):
            raise TypeError(f"batch = {self.batch!r} ({type(self.batch).__name__}) must be a whole number of sequences")
        if self.batch < 1:
            raise ValueError(f"batch = {self.batch}: need at least one sequence per step, e.g. --batch 8")

    def _resolve_precision(self) -> None:
        """Fill in ``dtype`` and ``precision`` from each other (class docstring); refuse a dtype no
        precision computes in and a precision that contradicts the dtype, naming the value."""
        if self.precision and self.precision not in NAMED:
            raise ValueError(f"precision {self.precision!r} is not supported; use one of {', '.join(NAMED)}")
        dtype = self.dtype or (dtype_name(NAMED[self.precision].compute) if self.precision else "bfloat16")
        if dtype not in DEFAULT_PRECISION:
            raise ValueError(
                f"dtype {dtype!r} is not supported; use one of {sorted(DEFAULT_PRECISION)} (no precision computes "
                "in float16: without loss scaling its gradients underflow)"
            )
        precision = self.precision or DEFAULT_PRECISION[dtype]
        compute = dtype_name(NAMED[precision].compute)
        if compute != dtype:
            raise ValueError(
                f"precision {precision!r} computes in {compute}, not dtype {dtype!r}: give dtype={compute!r} or leave "
                f"dtype out (presets computing in {dtype}: "
                f"{', '.join(n for n, p in NAMED.items() if dtype_name(p.compute) == dtype)})"
            )
        object.__setattr__(self, "dtype", dtype)  # frozen: set once, here

    @property
    def element_size(self) -> int:
        """Bytes of one element of the compute dtype (activations, the weights a GEMM uses)."""
        return DTYPES[self.dtype].itemsize

    @property
    def preset(self) -> str:
        """The precision's name: ``precision``, or by ``dtype`` where none was given (``DEFAULT_PRECISION``)."""
        return self.precision or DEFAULT_PRECISION[self.dtype]

    @property
    def dtypes(self) -> Precision:
        """The ``Precision`` of ``preset``: what each collective moves (``geometry.wire_dtype``)."""
        return NAMED[self.preset]

    @property
    def tokens(self) -> int:
        return self.batch * self.model.seq_len

    def norm_kernel(self, shape: GridShape, recompute: str = "none") -> str:
        """How the blocks' norms run on ``shape`` (axon4d.nn.norm): "torch" — a torch kernel that
        keeps its (widened) input and per-token statistics: LayerNorm (GPT) with the features whole
        on a rank (G_x = 1), and RMSNorm's ``F.rms_norm`` on an accelerator (``accelerator``; one
        H200's offloaded bytes per block, bench/results/gpu_check_nvidia_h200.json, are this within
        0.2%); "split" — axon4d's fused split norm, one autograd Function around one all-reduce over
        x each way (G_x > 1); "chain" — elementwise ops (``F.rms_norm`` on the host; balanced
        recomputation keeps the statistics and re-runs ``normalize``). "none" without norms."""
        if not self.norms:
            return "none"
        if recompute == "balanced":
            return "chain"
        if shape.x > 1:
            return "split"
        return "chain" if self.model.arch == "llama" and not self.accelerator else "torch"

    def fused_norms(self, shape: GridShape, recompute: str = "none") -> bool:
        """Whether each norm keeps only its input and its per-token statistics for backward (the
        next GEMM keeps its output): torch's fused LayerNorm and axon4d's split norm
        (``norm_kernel``), not the elementwise chain."""
        return self.norm_kernel(shape, recompute) in ("torch", "split")

    def norm_statistics(self) -> int:
        """Per-token fp32 statistics one norm keeps: mean and 1/std (LayerNorm), 1/rms (RMSNorm)."""
        return 1 if self.model.arch == "llama" else 2

    def local_tokens(self, shape: GridShape) -> int:
        """b = B·S/(G_data·G_z): tokens on one rank (whole sequences split over batch, or, with
        ``context_parallel``, sequences over data and each one's tokens over z)."""
        return self.tokens // shape.size("batch")

    def local_sequences(self, shape: GridShape) -> float:
        """Sequences' worth of causal attention one rank computes: b/S — whole sequences, or with
        ``context_parallel`` B/G_data sequences of which the head–tail split gives each z-rank 1/G_z
        of the causal work."""
        if self.context_parallel:
            return self.local_tokens(shape) / self.model.seq_len
        return self.local_tokens(shape) // self.model.seq_len

    def context_collectives(self, shape: GridShape) -> list[Collective]:
        """With ``context_parallel``, per layer on one rank, the collectives over z that bring attention
        the keys and values of the rank's n_kv/G_y key/value heads (docs/context.md), each in the
        compute dtype (``geometry.wire_dtype``: the attention backward's dK, dV are too):

        - "all-gather": the all-gather of its B/G_data whole sequences' keys and values (forward,
          payload B/G_data · S · 2 · n_kv/G_y · head_dim · e bytes) and the reduce-scatter of their
          gradients (backward, the same payload); each moves φ(G_z) of it;
        - "ring" (``axon4d.nn.context_ring``): G_z − 1 shifts of the rank's own keys and values
          (forward, payload b · 2 · n_kv/G_y · head_dim · e for its b tokens), in backward G_z − 1
          shifts of them again and G_z of their gradients' accumulators (the last one's trip home).
          Selective recomputation's forward ring again is ``recompute.rerun_collectives``'.

        Over z, or over the batch axis (z × data) for hierarchical context parallelism
        (``context_axes`` "z,data"), with G_z·G_data in place of G_z."""
        m = self.model
        g, axis = self.context_group(shape), self.context_axis
        if g == 1:
            return []
        keys, grads = (wire_element_size(self.dtypes, t) for t in self.context_terms)
        own = self.context_kv_elements(shape)
        if self.context_mode == "ring":
            kv_f = Collective(Op.SHIFT, axis, own * keys, "forward", Term.CP_KV_RING)
            kv_b = dataclasses.replace(kv_f, phase="backward")
            grad = Collective(Op.SHIFT, axis, own * grads, "backward", Term.CP_KV_RING_GRAD)
            return [kv_f] * ((g - 1) * m.n_layers) + [kv_b] * ((g - 1) * m.n_layers) + [grad] * (g * m.n_layers)
        whole = own * g
        return [Collective(Op.ALL_GATHER, axis, whole * keys, "forward", Term.CP_KV)] * m.n_layers + [
            Collective(Op.REDUCE_SCATTER, axis, whole * grads, "backward", Term.CP_KV_GRAD)
        ] * m.n_layers

    @property
    def context_axis(self) -> str:
        """The grid axis each sequence is split over with ``context_parallel``: z, or batch (z × data)
        for hierarchical context parallelism (``context_axes`` "z,data")."""
        return context_axis(self.context_axes)

    def context_group(self, shape: GridShape) -> int:
        """G: the ranks each sequence is split over (1 without ``context_parallel``): G_z, or G_z·G_data."""
        return shape.size(self.context_axis) if self.context_parallel else 1

    def context_kv_elements(self, shape: GridShape) -> int:
        """Elements of the keys and values of a rank's own tokens and kv heads (n_kv/G_y) that context
        parallelism moves and keeps: b · 2 · n_kv/G_y · head_dim (0 without it)."""
        if not self.context_parallel:
            return 0
        return self.local_tokens(shape) * 2 * (self.model.kv_heads // shape.y) * self.model.head_dim

    @property
    def context_terms(self) -> tuple[Term, Term]:
        """The (keys and values, their gradients) terms of ``context_mode``'s collectives."""
        if self.context_mode == "ring":
            return Term.CP_KV_RING, Term.CP_KV_RING_GRAD
        return Term.CP_KV, Term.CP_KV_GRAD

    def kinds(self) -> list[tuple[Workload, float]]:
        """This step as steps of one block kind each (``block_kinds``), each with its share of the
        blocks: [(self, 1.0)] where every block is of one kind. A step of a mixed model is priced
        as the sum of its kinds' steps, each weighted by its share (``plan.cost.step_estimate``,
        ``plan.sent``, ``plan.memory``): every per-block term then counts each kind's blocks, and
        the edges (embedding, head), the same in every kind, count once."""
        kinds = block_kinds(self.model)
        if len(kinds) == 1 and kinds[0][0] is self.model:
            return [(self, 1.0)]
        n = self.model.n_layers
        return [(dataclasses.replace(self, model=m), count / n) for m, count in kinds]

    def linears(self) -> list[LinearSpec]:
        """Every linear layer kind of a step, in forward order, each with how many times it runs: a
        block's layers once per block of their kind — with dense blocks beside MoE blocks
        (``blocks.kind_shapes``: the dense blocks' MLP as ``blocks.DENSE_MLP``'s layers)."""
        return list(self._linears)

    @functools.cached_property
    def _linears(self) -> tuple[LinearSpec, ...]:
        """``linears``, made once per workload (the search asks it of each hundreds of times)."""
        m = self.model
        out = []
        if self.embedding:
            out.append(
                LinearSpec("embedding", m.vocab_size, m.hidden, True, False, 1, input_grad=False, embedding=True)
            )
        counts: dict[tuple[str, int, int, bool, bool], int] = {}
        for _, n, shapes in kind_shapes(m):
            for shape in shapes:
                counts[shape] = counts.get(shape, 0) + n
        out += [LinearSpec(n, i, o, t, b, count) for (n, i, o, t, b), count in counts.items()]
        if self.head:
            out.append(LinearSpec("head", m.hidden, m.vocab_size, False, False, 1))
        return tuple(out)

    def edge_collectives(self, shape: GridShape, zero: int = 0) -> list[Collective]:
        """Collectives of one step outside the linear layers, on one rank: the embedding's forward
        all-reduce over y (compute dtype) and its table's gradient all-reduce over batch; one
        gradient all-reduce over batch per replicated tensor (norm weights and biases, position
        embedding) — the gradients in the reduction dtype (fp32 masters' gradients: fp32 under
        "bf16-fp32-reduce", bf16 under "bf16"; ``geometry.wire_dtype``); an MoE layer's router
        gradient over batch and its expert replicas' over their axis — a reduce-scatter over data
        under ZeRO-2 (``zero``) where the replicas lie on data alone, as the scheduler issues it;
        the split norms' per-token sums over x, forward and backward (G_x > 1, ``norm_sums``); the
        vocabulary-parallel loss's all-gather of log-sum-exps and all-reduce of target logits over y
        (fp32; G_y > 1);
        with ``context_parallel``, attention's key/value collectives (``context_collectives``)."""
        m = self.model
        h_x = m.hidden // shape.x
        out: list[Collective] = []

        def add(op: Op, axis: str, elems: int, phase: str, term: Term, count: int = 1) -> None:
            if shape.size(axis) > 1:
                elem = wire_element_size(self.dtypes, term)
                out.extend([Collective(op, axis, elems * elem, phase, term)] * count)

        if self.embedding:
            add(Op.ALL_REDUCE, "y", self.local_tokens(shape) * h_x, "forward", Term.EMBEDDING)
            add(Op.ALL_REDUCE, "batch", m.vocab_size // shape.y * h_x, "backward", Term.EMBEDDING_GRAD)
            if m.arch == "gpt":
                add(Op.ALL_REDUCE, "batch", m.seq_len * h_x, "backward", Term.POSITION_GRAD)
        if self.norms:
            tensors = (2 if m.arch == "gpt" else 1) * (2 * m.n_layers + 1)
            add(Op.ALL_REDUCE, "batch", h_x, "backward", Term.NORM_GRAD, tensors)
        if m.moe:  # each MoE layer's router weight (E, hidden/G_x), its gradient averaged over batch
            add(Op.ALL_REDUCE, "batch", m.n_experts * h_x, "backward", Term.MOE_ROUTER_WEIGHT_GRAD, m.moe_layers)
            p = placement(m, shape, self.expert_layout)
            if p.dp_axis is not None:  # expert replicas: up and down's gradients summed over their axis
                block = p.local * p.hidden_x * p.ffn_y  # down's elements; up's are ups times as many
                scattered = zero == 2 and p.dp_axis == "data"  # ZeRO-2: each data rank receives its parts' sum
                for n in ((2 if m.gated else 1) * block, block):
                    if scattered:  # the scheduler's input: G_data parts of ⌈n/G_data⌉, the last zero-padded
                        add(
                            Op.REDUCE_SCATTER,
                            "data",
                            data_part_numel(n, shape.data) * shape.data,
                            "backward",
                            Term.MOE_EXPERT_WEIGHT_GRAD,
                            m.moe_layers,
                        )
                    else:
                        add(Op.ALL_REDUCE, p.dp_axis, n, "backward", Term.MOE_EXPERT_WEIGHT_GRAD, m.moe_layers)
        if self.norms:
            # the split norms' per-token sums over x, forward and backward: two per block, the final norm's
            norms = 2 * m.n_layers + (1 if self.head else 0)
            out += self.norm_sums(shape, Term.NORM_STATS, norms)
            out += self.norm_sums(shape, Term.NORM_STATS_GRAD, norms)
            if self.head and shape.y > 1:  # the vocabulary-parallel loss: log-sum-exps and target logits over y
                b = self.local_tokens(shape)
                f32 = wire_element_size(self.dtypes, Term.CE_LSE)
                out.append(Collective(Op.ALL_GATHER, "y", shape.y * b * f32, "forward", Term.CE_LSE))
                out.append(Collective(Op.ALL_REDUCE, "y", b * f32, "forward", Term.CE_TARGET))
        return out + self.context_collectives(shape)

    def norm_sums(self, shape: GridShape, term: Term, count: int) -> list[Collective]:
        """``count`` of the split norms' all-reduces ``term`` over x (G_x > 1; ``axon4d.nn.norm``):
        per token the values and dtype of ``geometry.norm_statistics_wire`` (LayerNorm's forward
        sums fp64, the rest fp32)."""
        if not self.norms or shape.x == 1:
            return []
        values, dtype = norm_statistics_wire(term, centred=self.model.arch == "gpt")
        payload = self.local_tokens(shape) * values * dtype.itemsize
        return [
            Collective(Op.ALL_REDUCE, "x", payload, "forward" if term == Term.NORM_STATS else "backward", term)
        ] * count

    def block_forward_collectives(self, shape: GridShape) -> list[Collective]:
        """The collectives outside the linear layers that every block's forward issues, on one rank,
        for all the blocks: its two norms' sums over x (G_x > 1) and, with context parallelism, the
        key/value all-gather over z — what full recomputation issues again (``plan.recompute``)."""
        kv = [c for c in self.context_collectives(shape) if c.phase == "forward"]
        return self.norm_sums(shape, Term.NORM_STATS, 2 * self.model.n_layers) + kv

    @property
    def attention_share(self) -> float:
        """The causal attention pairs the document mask leaves, over a whole sequence's: documents of
        D = ``document_tokens`` tokens (the last r = S mod D shorter) attend (S//D)·D(D+1)/2 + r(r+1)/2
        pairs of the S(S+1)/2 one document would (1 without documents)."""
        s, d = self.model.seq_len, self.document_tokens
        if not d or d >= s:
            return 1.0
        r = s % d
        return ((s // d) * d * (d + 1) + r * (r + 1)) / (s * (s + 1))

    def flops(self) -> float:
        """Model FLOPs of one step (6 per matmul parameter per token, plus causal attention — within
        each document for packed documents, ``attention_share``); in an
        MoE model the parameters a token passes through — its k routed experts, the shared ones and
        the router (``moe_cost.active_matmul_params``), not the experts it does not reach."""
        m = self.model
        matmul = sum(s.in_features * s.out_features * s.count for s in self.linears() if not s.embedding)
        if m.moe:  # the shared experts are among the linears; the router and k routed experts besides
            per_expert = ((2 if m.gated else 1) + 1) * m.hidden * m.expert_width
            matmul += m.moe_layers * (m.n_experts * m.hidden + m.experts_per_token * per_expert)
        att = 2 * 2 * m.n_layers * m.seq_len * m.hidden / 2 * self.attention_share if self.attention else 0.0
        return self.tokens * (6.0 * matmul + 3.0 * att)

    def rules(self) -> list[grid_rules.Rule]:
        """The §1 rules a grid must satisfy for this workload: whole sequences split over batch (with
        ``context_parallel``: over data, and S over 2·G_z), heads over y, and each linear layer kind's
        features over its input and output axes (the embedding's vocabulary over y and hidden features
        over x)."""
        m = self.model
        out = [grid_rules.batch(self.batch, "the batch (sequences per step)"), *grid_rules.heads(m.n_heads, m.kv_heads)]
        if self.context_parallel and self.context_axis == "z":  # sequences over data, each one's 2·G_z chunks over z
            out[0] = grid_rules.divisible(
                self.batch, "the batch (sequences per step)", ["data"], "context parallelism splits sequences over data"
            )
            out.append(
                grid_rules.divisible(
                    m.seq_len // 2,
                    "seq_len/2",
                    ["z"],
                    "context parallelism cuts each sequence into 2·G_z chunks, two per z-rank",
                )
            )
        elif self.context_parallel:  # hierarchical: every rank holds every sequence's 2 of 2·G_z·G_data chunks
            out[0] = grid_rules.divisible(
                m.seq_len // 2,
                "seq_len/2",
                ["z", "data"],
                "hierarchical context parallelism cuts each sequence into 2·G_z·G_data chunks, two per rank",
            )
        if m.moe:
            out += moe_rules(m, self.expert_layout)
        for s in self.linears():
            if s.embedding:
                out += grid_rules.embedding(s.in_features, s.out_features)
            else:
                out += grid_rules.linear(s.in_features, s.out_features, s.transpose, s.name)
        return out

    def grid_problems(self, shape: GridShape) -> list[str]:
        """The rules of ``rules`` that ``shape`` breaks, one line each (empty: the grid is valid)."""
        return [
            f"{r.what} = {r.value} is not divisible by {'·'.join(f'G_{a}' for a in r.axes)} = {r.divisor(shape)}"
            for r in self.rules()
            if not r.holds(shape)
        ]
