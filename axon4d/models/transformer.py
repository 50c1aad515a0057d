"""GPT and Llama language models on the 4D grid, and their single-process references
(docs/design.md §2; the size table is §6).

``Transformer(cfg)`` takes this rank's batch shard of token ids (b, s) — b = B/(G_data·G_z), see
``axon4d.shard_batch`` — and returns this rank's logits (b, s, vocab/G_y), replicated over x:

    ids ─ VocabParallelEmbedding (+ positions) ─ blocks ─ final norm ─ LM head (normal Linear)
         (b, s, hidden/G_x) throughout                                  (b, s, vocab/G_y)

``loss(ids, targets)`` is the vocabulary-parallel cross-entropy, the mean over this rank's tokens,
so after ``backward()`` every parameter's gradient is the DDP-averaged gradient of the global
mean loss. ``DenseTransformer`` is the same model in plain PyTorch (what ``to_dense`` returns).

Any size builds on the ``meta`` device (``Transformer(cfg, device="meta")``) to count per-rank
parameters without allocating; ``axon4d.materialize.materialize_(model, seed)`` then gives every
rank its shards, initialised as ``axon4d.materialize.init_dense_`` initialises the dense model.

With ``context_parallel=True`` (docs/context.md) the tokens of each sequence are split over z
instead of whole sequences: the model takes ``axon4d.activations.shard_sequence(ids)`` — (b, S/G_z) with
b = B/G_data, this rank's head–tail chunks — returns logits for those tokens, and ``loss`` takes
``shard_sequence(targets)``. Positions (learned or rotary) are the tokens' global positions.

``documents=`` (forward and loss; ``axon4d.data.documents.Documents`` or per-row document lengths)
packs several documents into each sequence: a token attends only to its own document's earlier
tokens and positions restart at every document (docs/context.md, "Packed documents"). It describes
the rows this rank holds — b rows of whole sequences of S tokens (``shard_documents``), sharded
under context parallelism with ``shard_sequence(x, documents=...)``.

With ``offload=`` (a fraction of the blocks, or block indices; ``axon4d.memory.offload``) the tensors the
chosen blocks save for backward move to host memory during the forward and come back one block
ahead of their backward; ``model.offloader.stats()`` counts the bytes moved and held.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from axon4d.activations import sequence_chunk_len, sequence_positions
from axon4d.config import ModelConfig
from axon4d.data.documents import Documents, as_documents
from axon4d.grid import runtime
from axon4d.grid.mesh import Grid
from axon4d.layout import tiled_init
from axon4d.memory.offload import Offloader, OffloadSpec, offload_blocks
from axon4d.nn.block import DenseBlock, TransformerBlock
from axon4d.nn.embedding import PositionEmbedding, VocabParallelEmbedding
from axon4d.nn.linear import Linear
from axon4d.nn.loss import vocab_parallel_cross_entropy
from axon4d.nn.moe import aux_loss
from axon4d.nn.moe_dense import DenseExperts
from axon4d.nn.norm import dense_norm_for, norm_for
from axon4d.options.context_mode import context_axis, context_mode
from axon4d.options.recompute_mode import check_recompute


class DenseTransformer(nn.Module):
    """The single-process reference: (B, s) ids → (B, s, vocab) logits."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden, device=device, dtype=dtype)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden, device=device, dtype=dtype) if cfg.arch == "gpt" else None
        if self.pos_emb is not None:
            nn.init.normal_(self.pos_emb.weight, std=0.02)
        self.blocks = nn.ModuleList(
            DenseBlock(cfg, device=device, dtype=dtype, moe=cfg.moe_block(i)) for i in range(cfg.n_layers)
        )
        self.norm = dense_norm_for(cfg, device=device, dtype=dtype)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False, device=device, dtype=dtype)

    def param_inits(self) -> dict[str, tiled_init.Init]:
        """``{parameter name: distribution}`` of this model's initialisation — what the constructor
        draws: ``torch.nn.Linear``'s U(−1/√in, 1/√in) for weights and biases, N(0, 1) for the token
        embedding, N(0, 0.02²) for the positions, ones and zeros for the norms. With
        ``axon4d.materialize.init_dense_`` the same distributions are drawn tile by tile from a seed,
        which makes the initialisation addressable (``axon4d.layout.tiled_init``)."""
        out: dict[str, tiled_init.Init] = {}
        for mod_name, m in self.named_modules():
            for p_name, p in m.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                if isinstance(m, DenseExperts):  # each expert's matrix as nn.Linear's
                    out[name] = tiled_init.Init.uniform(1.0 / math.sqrt(p.shape[-1]))
                elif isinstance(m, nn.Linear):
                    out[name] = tiled_init.Init.uniform(1.0 / math.sqrt(m.in_features))
                elif isinstance(m, nn.Embedding):
                    out[name] = tiled_init.Init.normal(0.02 if m is self.pos_emb else 1.0)
                elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                    out[name] = tiled_init.Init.constant(1.0 if p_name == "weight" else 0.0)
                else:
                    raise TypeError(f"{name}: no initialisation is defined for {type(m).__name__}")
        return out

    def forward(self, ids: torch.Tensor, documents: Documents | Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """(B, S) ids → (B, S, vocab) logits; ``documents``: the packed layout of the B rows (each
        document attends within itself, positions restart at each), or None."""
        docs = None if documents is None else as_documents(documents, ids.shape[0], ids.shape[1], "the token ids")
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            x = x + (
                self.pos_emb.weight[: ids.shape[1]]
                if docs is None
                else self.pos_emb(docs.local_positions(0, 1, ids.device))
            )
        for block in self.blocks:
            x = block(x, docs)
        return self.head(self.norm(x))

    def loss(
        self, ids: torch.Tensor, targets: torch.Tensor, documents: Documents | Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        logits = self(ids, documents)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        aux = aux_loss(self)  # MoE blocks: balance loss and z-loss (docs/moe.md)
        return loss if aux is None else loss + aux


class Transformer(nn.Module):
    """A GPT (``cfg.arch == "gpt"``) or Llama (``"llama"``) model on the 4D grid.

    ``recompute`` is every block's activation recomputation: "none", "selective", "balanced" or
    "full" (axon4d.nn.recompute; the planner's ``--recompute`` prices the same modes).
    ``context_parallel`` splits each sequence's tokens head–tail over z (docs/context.md): give it
    ``axon4d.activations.shard_sequence`` parts of ids and targets instead of ``shard_batch`` ones;
    True or "all-gather" all-gathers the keys and values over z, "ring" passes them around z
    (O(chunk) memory per rank, ``axon4d.nn.context_ring``). ``context_parallel_axes="z,data"``
    splits each sequence over z and data together (hierarchical, docs/context.md): every rank then
    holds every sequence's 2 chunks of 2·G_z·G_data (``shard_sequence(x, axes="z,data")``).
    ``offload`` moves what chosen blocks save for backward to host memory (``axon4d.memory.offload``): a
    fraction of the blocks (0.5: the first half, rounded), block indices ([0, 1]), or None."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        recompute: str = "none",
        context_parallel: bool | str = False,
        context_parallel_axes: str = "z",
        offload: OffloadSpec = None,
    ):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(
                f"Transformer takes a ModelConfig, got {type(cfg).__name__}; "
                "use axon4d.config.get_config('tiny') or ModelConfig(...)"
            )
        self.cfg = cfg
        self.recompute = check_recompute(recompute)
        #: None, "all-gather" or "ring" (``axon4d.options.context_mode``)
        self.context_mode = context_mode(context_parallel)
        self.context_parallel = self.context_mode is not None
        #: the axis each sequence is split over: z, or batch (z × data) for ``context_parallel_axes="z,data"``
        self.context_axis = context_axis(context_parallel_axes)
        if self.context_axis != "z" and not self.context_parallel:
            raise ValueError(
                f"context_parallel_axes={context_parallel_axes!r} without context_parallel: give context_parallel=True "
                "or 'ring' too, or leave the axes out"
            )
        self.grid = grid = runtime.resolve(grid)
        self.offload = offload_blocks(offload, cfg.n_layers)  # the offloaded blocks' indices
        self.offloader = Offloader(self.offload) if self.offload else None
        kw: dict[str, Any] = dict(grid=grid, device=device, dtype=dtype)
        self.tok_emb = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, **kw)
        self.pos_emb = PositionEmbedding(cfg.seq_len, cfg.hidden, **kw) if cfg.arch == "gpt" else None
        self.blocks = nn.ModuleList(
            TransformerBlock(
                cfg,
                recompute=recompute,
                context_parallel=context_parallel,
                context_parallel_axes=context_parallel_axes,
                moe=cfg.moe_block(i),
                **kw,
            )
            for i in range(cfg.n_layers)
        )
        self.norm = norm_for(cfg, grid=grid, device=device, dtype=dtype)
        self.head = Linear(cfg.hidden, cfg.vocab_size, bias=False, transpose=False, **kw)
        self.head.fp8_gemms = False  # the LM head stays in bf16 under FP8 GEMMs (docs/design.md §2)
        self.head.bf16_why = "the LM head"

    #: a block's 3D Linear layers in ``TransformerBlock.linears`` order, by their planner names
    #: (``axon4d.plan.workload.block_shapes``; an MoE block's shared experts are its MLP's)
    LAYER_KINDS = ("qkv", "attn_out", "mlp_up", "mlp_down")

    def keep_in_bf16(self, kinds: set[str] | frozenset[str]) -> None:
        """Under FP8 GEMMs (precision ``bf16-fp8``) run the layers of ``kinds`` (``LAYER_KINDS``) in
        bf16 in every block: the planner's per-layer choice where FP8 is priced slower
        (``axon4d.plan.fp8``); a no-op in other precisions."""
        for block in self.blocks:
            assert isinstance(block, TransformerBlock)
            for kind, layer in zip(self.LAYER_KINDS, block.linears()):
                if kind in kinds:
                    layer.fp8_gemms = False
                    layer.bf16_why = "--bf16-layers"

    def forward(self, ids: torch.Tensor, documents: Documents | Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """(b, s) ids of this rank's batch shard → (b, s, vocab/G_y) logits, replicated over x.

        ``documents``: packed sequences — the layout (``Documents``, or per-row document lengths) of
        the b rows this rank holds, each row's lengths summing to the whole sequence's length (S,
        under context parallelism too: ``axon4d.activations.shard_documents``); tokens attend within
        their documents and positions restart at each. A layout of other rows or lengths is a
        ``ValueError``."""
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"Transformer takes a tensor of token ids (batch, seq), got {type(ids).__name__}")
        if ids.dim() != 2:
            raise ValueError(
                f"expected token ids of shape (batch, seq), got {tuple(ids.shape)}; "
                "a single sequence takes ids.unsqueeze(0)"
            )
        seq = ids.shape[1] * (self.grid.size(self.context_axis) if self.context_parallel else 1)  # the full sequence's
        if seq > self.cfg.seq_len:
            held = f" (this rank holds {ids.shape[1]} of its tokens, split over z)" if self.context_parallel else ""
            raise ValueError(
                f"sequence length {seq}{held} exceeds cfg.seq_len = {self.cfg.seq_len}; "
                f"give at most {self.cfg.seq_len} tokens per sequence or build the model with a longer seq_len"
            )
        if self.context_parallel:
            sequence_chunk_len(seq, self.grid.size(self.context_axis))  # the same ValueError on every rank, first
        docs = None if documents is None else as_documents(documents, ids.shape[0], seq, "this rank's token ids")
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            x = x + self._positions(seq, ids.device, docs)
        for i, block in enumerate(self.blocks):
            if self.offloader is not None:
                x = self.offloader.forward(i, block if docs is None else _WithDocuments(block, docs), x)
            else:
                x = block(x, docs)
        return self.head(self.norm(x))

    def _positions(self, seq: int, device: torch.device, documents: Documents | None = None) -> torch.Tensor:
        """The learned position rows (s, hidden/G_x) of this rank's tokens of sequences of ``seq``
        tokens: 0 … seq−1, or under context parallelism this rank's head–tail global positions; with
        ``documents`` (b, s, hidden/G_x), each token's position inside its document."""
        assert self.pos_emb is not None
        if documents is not None:
            axis = self.context_axis
            z, g_z = (self.grid.coord(axis), self.grid.size(axis)) if self.context_parallel else (0, 1)
            return self.pos_emb(self.cfg.seq_len)[documents.local_positions(z, g_z, device)]
        if not self.context_parallel:
            return self.pos_emb(seq)
        z, g_z = self.grid.coord(self.context_axis), self.grid.size(self.context_axis)
        rows = self.pos_emb(self.cfg.seq_len)  # the table in compute dtype; autograd reaches the weight
        return rows.index_select(0, sequence_positions(seq, z, g_z, device))  # checks 2·G_z | seq

    def loss(
        self, ids: torch.Tensor, targets: torch.Tensor, documents: Documents | Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """Mean cross-entropy over this rank's tokens, computed without gathering the vocabulary; with
        MoE blocks plus their auxiliary losses (this rank's share, docs/moe.md E19–E20). ``documents``:
        as ``forward``."""
        loss = vocab_parallel_cross_entropy(self(ids, documents), targets, self.grid, axis="y")
        aux = aux_loss(self)
        return loss if aux is None else loss + aux

    @torch.no_grad()
    def load_dense_(self, dense: DenseTransformer) -> Transformer:
        """Take this rank's part of every weight of ``dense`` (equal on every rank)."""
        self.tok_emb.load_dense_(dense.tok_emb.weight)
        if self.pos_emb is not None:
            assert dense.pos_emb is not None
            self.pos_emb.load_dense_(dense.pos_emb.weight)
        for mine, theirs in zip(self.blocks, dense.blocks):
            cast(TransformerBlock, mine).load_dense_(cast(DenseBlock, theirs))
        self.norm.load_dense_(dense.norm)
        self.head.load_dense_(dense.head.weight)
        return self

    @classmethod
    def from_dense(
        cls,
        dense: DenseTransformer,
        *,
        grid: Grid | None = None,
        recompute: str = "none",
        context_parallel: bool | str = False,
        context_parallel_axes: str = "z",
        offload: OffloadSpec = None,
    ) -> Transformer:
        p = dense.head.weight
        model = cls(
            dense.cfg,
            grid=grid,
            dtype=p.dtype,
            recompute=recompute,
            context_parallel=context_parallel,
            context_parallel_axes=context_parallel_axes,
            offload=offload,
        )
        return model.load_dense_(dense)

    def to_dense(self, grads: bool = False) -> DenseTransformer:
        """The full single-process model (and gradients) on every rank."""
        p = self.head.weight
        dense = DenseTransformer(self.cfg, device=p.device, dtype=p.dtype)
        dense.tok_emb = self.tok_emb.to_dense(grads)
        if self.pos_emb is not None:
            dense.pos_emb = self.pos_emb.to_dense(grads)
        dense.blocks = nn.ModuleList(cast(TransformerBlock, b).to_dense(grads) for b in self.blocks)
        dense.norm = self.norm.to_dense(grads)
        dense.head = self.head.to_dense(grads)
        return dense


class _WithDocuments(nn.Module):
    """A block called with the batch's documents: what the offloader runs (it takes ``block(x)``)."""

    def __init__(self, block: nn.Module, documents: Documents):
        super().__init__()
        self.block, self.documents = block, documents

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, self.documents)


def gpt(cfg: ModelConfig, **kw: object) -> Transformer:
    """A GPT model (LayerNorm, GELU, learned positions, biases) on the grid."""
    return Transformer(cfg.replace(arch="gpt"), **kw)  # type: ignore[arg-type]


def llama(cfg: ModelConfig, **kw: object) -> Transformer:
    """A Llama model (RMSNorm, SwiGLU, rotary positions, GQA, no biases) on the grid."""
    return Transformer(cfg.replace(arch="llama"), **kw)  # type: ignore[arg-type]
