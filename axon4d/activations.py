"""Moving activations between full tensors and the grid's shards: batch, features, sequence (docs/design.md §2).

Tokens (dim 0: the batch, or the token count of a 2-D input) are split over batch = data × z,
chunk index d·G_z + z. Features (the last dim) of a normal layer's input are split over x and its
output over y; a transposed layer swaps the two. ``shard_*`` functions slice locally (no
communication, differentiable); ``gather_*`` functions all-gather through the communication layer
and return full tensors on every rank, detached from autograd.

Context parallelism (docs/context.md) splits the tokens of *one* sequence over z instead: the
sequence of length S is cut into 2·G_z chunks of C = S/(2·G_z) tokens and z-rank r holds chunks r
and 2·G_z−1−r (head–tail, in that order), so every rank does the same causal-attention work.
Sequences are then split over data only (``shard_sequence``/``gather_sequence``; the positions of a
rank's tokens are ``sequence_positions``). Packed documents (``axon4d.data.documents``) choose each
row's pair of chunks by their attention work instead: ``shard_sequence(x, documents=...)``.
"""

from __future__ import annotations

import torch

from axon4d.data.documents import Documents
from axon4d.grid import rules, runtime
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import Axis
from axon4d.layout import geometry
from axon4d.layout.geometry import Term
from axon4d.options.context_mode import context_axis

#: the attribute a layer sets on its output tensor: the axis that output's features are split over
#: (``mark_features``); ``gather_output`` compares it with the layout it is asked to gather
FEATURES_AXIS = "_axon4d_features_axis"


def mark_features(y: torch.Tensor, axis: Axis) -> torch.Tensor:
    """``y``, noted as a tensor whose last dim is split over ``axis`` (a layer's output)."""
    setattr(y, FEATURES_AXIS, axis)
    return y


def _chunk(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    n = x.shape[dim] // parts
    return x.narrow(dim, index * n, n)


def shard_batch(x: torch.Tensor, grid: Grid | None = None) -> torch.Tensor:
    """This rank's part of a full global batch: dim 0 split over batch = data × z."""
    grid = runtime.resolve(grid)
    if x.dim() == 0:
        raise ValueError("shard_batch needs a tensor with a batch dim (dim 0), got a scalar")
    rules.batch(x.shape[0]).check(grid.shape)
    return _chunk(x, 0, grid.size("batch"), grid.coord("batch"))


def gather_batch(x: torch.Tensor, grid: Grid | None = None) -> torch.Tensor:
    """The full batch from every rank's dim-0 part (all-gather over batch = data × z)."""
    grid = runtime.resolve(grid)
    return grid.comm.all_gather(x.detach().contiguous(), "batch", dim=0, tag=Term.GATHER_BATCH).wait()


def shard_features(x: torch.Tensor, axis: Axis, grid: Grid | None = None) -> torch.Tensor:
    """This rank's part of the last dim of ``x``, split over ``axis``."""
    grid = runtime.resolve(grid)
    rules.features(x.shape[-1], axis).check(grid.shape)
    return _chunk(x, x.dim() - 1, grid.size(axis), grid.coord(axis))


def gather_features(x: torch.Tensor, axis: Axis, grid: Grid | None = None) -> torch.Tensor:
    """The full last dim from every rank's part (all-gather over ``axis``)."""
    grid = runtime.resolve(grid)
    return grid.comm.all_gather(x.detach().contiguous(), axis, dim=-1, tag=Term.GATHER_FEATURES).wait()


def shard_input(x: torch.Tensor, transpose: bool = False, grid: Grid | None = None) -> torch.Tensor:
    """This rank's part of a full input (N, ..., in) for a normal (or ``transpose``d) Linear.

    Dim 0 is split over batch (data × z); the last dim over x (normal) or y (transposed).
    """
    grid = runtime.resolve(grid)
    in_axis, _ = geometry.layer_axes(transpose)
    return shard_features(shard_batch(x, grid=grid), in_axis, grid=grid)


def gather_output(y: torch.Tensor, transpose: bool = False, grid: Grid | None = None) -> torch.Tensor:
    """The full output (N, ..., out) of a normal (or ``transpose``d) Linear, on every rank.

    ``ValueError`` (before any communication) when ``y`` is a layer's output of the other layout."""
    grid = runtime.resolve(grid)
    _, out_axis = geometry.layer_axes(transpose)
    split = getattr(y, FEATURES_AXIS, None)
    if split is not None and split != out_axis:
        made_by = "a transposed" if split == geometry.layer_axes(True)[1] else "a normal"
        raise ValueError(
            f"gather_output(transpose={transpose}) gathers features split over {out_axis}, but this tensor is the "
            f"output of {made_by} layer (features split over {split}); call gather_output(y, transpose={not transpose})"
        )
    return gather_batch(gather_features(y, out_axis, grid=grid), grid=grid)


def sequence_chunk_len(seq_len: int, g_z: int) -> int:
    """C = S/(2·G_z): the length of one head–tail chunk of a sequence of ``seq_len`` tokens split over
    G_z = ``g_z`` ranks. ``ValueError`` naming S, G_z and the nearest lengths that split, unless 2·G_z
    divides S."""
    parts = 2 * g_z
    if seq_len > 0 and seq_len % parts == 0:
        return seq_len // parts
    below = seq_len // parts * parts
    works = " or ".join(str(n) for n in (below, below + parts) if n > 0)
    raise ValueError(
        f"sequence length S = {seq_len} cannot be split over G_z = {g_z} with context parallelism: the sequence is "
        f"cut into 2·G_z = {parts} equal chunks (head–tail causal balance), so S must be a multiple of {parts}; "
        f"the nearest lengths that work are {works} (pad or trim the sequences), or split whole sequences instead "
        "(context_parallel=False)"
    )


def sequence_chunks(z: int, g_z: int) -> tuple[int, int]:
    """The two chunk indices z-rank ``z`` of ``g_z`` holds, in its local order: (z, 2·G_z−1−z)."""
    return z, 2 * g_z - 1 - z


def sequence_positions(seq_len: int, z: int, g_z: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (S/G_z,) of the tokens z-rank ``z`` holds of a sequence of ``seq_len``
    tokens, in the rank's local order: chunk z, then chunk 2·G_z−1−z."""
    c = sequence_chunk_len(seq_len, g_z)
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in sequence_chunks(z, g_z)])


def sequence_order(seq_len: int, g_z: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The index that puts every z-rank's tokens, concatenated in z order (what an all-gather over z
    returns), back into global order: ``gathered.index_select(dim, sequence_order(S, G_z))``."""
    held = torch.cat([sequence_positions(seq_len, z, g_z, device) for z in range(g_z)])
    return torch.argsort(held)


def shard_sequence(
    x: torch.Tensor, grid: Grid | None = None, documents: Documents | None = None, axes: str = "z"
) -> torch.Tensor:
    """This rank's part of full sequences (B, S, ...) under context parallelism: the sequences (dim 0)
    split over data, the tokens of each (dim 1) split head–tail over z — chunks z and 2·G_z−1−z of
    the 2·G_z chunks of S/(2·G_z) tokens. Local slices, differentiable; token ids, targets and
    activations alike. With ``documents`` (the packed layout of the B rows) each row's chunks are
    the ones ``documents.chunks(G_z)`` gives z-rank z (handed out by attention work). With
    ``axes="z,data"`` (hierarchical) every rank keeps every sequence and the tokens are split over
    batch = z × data instead (G = G_z·G_data, coordinate d·G_z + z)."""
    grid = runtime.resolve(grid)
    axis = context_axis(axes)
    if x.dim() < 2:
        raise ValueError(
            f"shard_sequence needs (batch, seq, ...) with a sequence dim (dim 1), got shape {tuple(x.shape)}; "
            "a single sequence takes x.unsqueeze(0)"
        )
    if axis == "z":
        rules.divisible(
            x.shape[0], "the batch (dim 0 of the input)", ["data"], "with context parallelism sequences split over data"
        ).check(grid.shape)
    g = grid.size(axis)
    c = sequence_chunk_len(x.shape[1], g)
    if axis == "z":
        x = _chunk(x, 0, grid.size("data"), grid.coord("data"))
    if documents is not None:
        documents.check(x.shape[0] * (grid.size("data") if axis == "z" else 1), x.shape[1], "the sequences to shard")
        mine = shard_documents(documents, grid, axes=axes).index(grid.coord(axis), g).to(x.device)
        return torch.stack([row.index_select(0, at) for row, at in zip(x, mine)])
    return torch.cat([x.narrow(1, k * c, c) for k in sequence_chunks(grid.coord(axis), g)], dim=1)


def shard_documents(
    documents: Documents, grid: Grid | None = None, context_parallel: bool = True, axes: str = "z"
) -> Documents:
    """The layout of this rank's rows of a batch's ``documents``: its sequences over data (context
    parallelism: each row still describes the whole sequence; every row with ``axes="z,data"``), or
    over batch = data × z without it (``shard_batch``'s rows). What the model's ``documents``
    argument takes."""
    grid = runtime.resolve(grid)
    if context_parallel and context_axis(axes) == "batch":
        return documents
    axis: Axis = "data" if context_parallel else "batch"
    n = documents.batch // grid.size(axis)
    if n * grid.size(axis) != documents.batch:
        raise ValueError(
            f"documents of {documents.batch} sequences cannot be split over {axis} = {grid.size(axis)}: give a "
            f"multiple of {grid.size(axis)} rows"
        )
    return documents.rows(grid.coord(axis) * n, (grid.coord(axis) + 1) * n)


def gather_sequence(
    x: torch.Tensor, grid: Grid | None = None, documents: Documents | None = None, axes: str = "z"
) -> torch.Tensor:
    """The full sequences (B, S, ...) from every rank's ``shard_sequence`` part (b, S/G_z, ...), in
    global token order, on every rank (all-gather over z, then over data; detached). ``documents``
    and ``axes``: as they were given to ``shard_sequence``."""
    grid = runtime.resolve(grid)
    axis = context_axis(axes)
    if x.dim() < 2:
        raise ValueError(f"gather_sequence needs (batch, seq/G_z, ...), got shape {tuple(x.shape)}")
    x = x.detach().contiguous()
    g = grid.size(axis)
    if g > 1:
        x = grid.comm.all_gather(x, axis, dim=1, tag=Term.GATHER_SEQUENCE).wait()
        if documents is None:
            x = x.index_select(1, sequence_order(x.shape[1], g, x.device))
        else:
            mine = shard_documents(documents, grid, axes=axes)
            held = torch.cat([mine.index(r, g) for r in range(g)], dim=1)  # (b, S): in gathered order
            x = torch.stack([row.index_select(0, order) for row, order in zip(x, held.argsort(1).to(x.device))])
    if axis == "batch":  # every rank held every sequence
        return x
    return grid.comm.all_gather(x.contiguous(), "data", dim=0, tag=Term.GATHER_SEQUENCE).wait()
