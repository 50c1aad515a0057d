"""What one training step of a transformer asks of one rank, as the planner sees it (docs/design.md §2, §6).

A ``Workload`` is a model (``ModelConfig``), a global batch of sequences and a dtype. Its linear
layers are the block's layers in the layouts the block really uses — QKV normal, attention output
transposed, MLP up normal, MLP down transposed (``ModelConfig.linear_shapes()``) — repeated
``n_layers`` times, plus at the edges:

- the token embedding as ``axon4d.nn.VocabParallelEmbedding`` holds it: a (vocab/G_y, hidden/G_x)
  block replicated over z and data; the lookup's partial rows are all-reduced over y and the
  table's gradient over batch (``edge_collectives``);
- the output head, a normal layer hidden → vocab without bias (vocab-parallel logits over y).

Parameters replicated over batch (norms, position embeddings) have their gradients all-reduced
over batch, one collective per tensor. ``rules`` lists the divisibility rules a grid must satisfy
for this workload (§1) as the layers state them (``axon4d.rules``); ``grid_problems`` says which a
grid breaks, and the search evaluates the same rules on every grid at once.
"""

from __future__ import annotations

import dataclasses
import numbers

from axon4d import rules as grid_rules
from axon4d.config import ModelConfig
from axon4d.device import DTYPES
from axon4d.geometry import Collective, Op, layer_axes
from axon4d.shape import GridShape

#: kept for callers that imported the map from here (bench/gpt.py): it is ``axon4d.device.DTYPES``
DTYPES_TORCH = DTYPES
#: optimizers the planner prices: name → fp32 state bytes per parameter (master weights aside)
OPTIMIZERS = {"adam": 8, "sgd": 0}


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
    (``OPTIMIZERS``: "adam", two fp32 states per parameter; "sgd", plain SGD without momentum, none)."""

    model: ModelConfig
    batch: int
    dtype: str = "bfloat16"
    embedding: bool = True
    head: bool = True
    attention: bool = True
    norms: bool = True
    optimizer: str = "adam"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {sorted(DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not priced; use one of {list(OPTIMIZERS)}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, numbers.Integral):
            raise TypeError(f"batch = {self.batch!r} ({type(self.batch).__name__}) must be a whole number of sequences")
        if self.batch < 1:
            raise ValueError(f"batch = {self.batch}: need at least one sequence per step, e.g. --batch 8")

    @property
    def element_size(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def tokens(self) -> int:
        return self.batch * self.model.seq_len

    def local_tokens(self, shape: GridShape) -> int:
        """b = B·S/(G_data·G_z): tokens on one rank (whole sequences are split over batch)."""
        return self.tokens // shape.size("batch")

    def linears(self) -> list[LinearSpec]:
        """Every linear layer kind of a step, in forward order."""
        m = self.model
        out = []
        if self.embedding:
            out.append(
                LinearSpec("embedding", m.vocab_size, m.hidden, True, False, 1, input_grad=False, embedding=True)
            )
        out += [LinearSpec(n, i, o, t, b, m.n_layers) for n, i, o, t, b in m.linear_shapes()]
        if self.head:
            out.append(LinearSpec("head", m.hidden, m.vocab_size, False, False, 1))
        return out

    def edge_collectives(self, shape: GridShape) -> list[Collective]:
        """Collectives of one step outside the linear layers, on one rank: the embedding's forward
        all-reduce over y and its table's gradient all-reduce over batch; one gradient all-reduce
        over batch per replicated tensor (norm weights and biases, position embedding)."""
        m, elem = self.model, self.element_size
        h_x = m.hidden // shape.x
        out: list[Collective] = []

        def add(op: Op, axis: str, elems: int, phase: str, term: str, count: int = 1) -> None:
            if shape.size(axis) > 1:
                out.extend([Collective(op, axis, elems * elem, phase, term)] * count)

        if self.embedding:
            add(Op.ALL_REDUCE, "y", self.local_tokens(shape) * h_x, "forward", "embedding")
            add(Op.ALL_REDUCE, "batch", m.vocab_size // shape.y * h_x, "backward", "embedding.grad")
            if m.arch == "gpt":
                add(Op.ALL_REDUCE, "batch", m.seq_len * h_x, "backward", "position.grad")
        if self.norms:
            tensors = (2 if m.arch == "gpt" else 1) * (2 * m.n_layers + 1)
            add(Op.ALL_REDUCE, "batch", h_x, "backward", "norm.grad", tensors)
        return out

    def flops(self) -> float:
        """Model FLOPs of one step (6 per matmul parameter per token, plus causal attention)."""
        m = self.model
        matmul = sum(s.in_features * s.out_features * s.count for s in self.linears() if not s.embedding)
        att = 2 * 2 * m.n_layers * m.seq_len * m.hidden / 2 if self.attention else 0.0
        return self.tokens * (6.0 * matmul + 3.0 * att)

    def rules(self) -> list[grid_rules.Rule]:
        """The §1 rules a grid must satisfy for this workload: whole sequences split over batch, heads
        over y, and each linear layer kind's features over its input and output axes (the embedding's
        vocabulary over y and hidden features over x)."""
        m = self.model
        out = [grid_rules.batch(self.batch, "the batch (sequences per step)"), *grid_rules.heads(m.n_heads, m.kv_heads)]
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
