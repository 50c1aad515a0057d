"""Sharded construction: a model built on the ``meta`` device, materialized shard by shard.

An 80B model never fits on one host, so it is never built whole. It is built on the meta device
(no storage anywhere) and each rank then allocates and initialises only its own shards:

    model = Transformer(cfg, grid=grid, device="meta")  # every parameter on meta
    materialize_(model, seed=0)  # this rank's shards, on grid.device, in their dtypes

The values are exactly those of the dense reference initialised for the same seed,
``init_dense_(DenseTransformer(cfg), seed)``, on any grid: ``Transformer.from_dense`` of that
reference holds the same tensors, bit for bit. This works because the reference's initialisation
is addressable (``axon4d.layout.tiled_init``): each global tensor is drawn tile by tile, every tile from its
own generator seeded from (seed, parameter name, tile), so a rank draws just the tiles its shard
overlaps. Which rows and columns of which dense tensor a shard holds is the parameter's
``ParamLayout`` (axon4d.layout.param_layout): its block on the (x, y) plane, the flat z shard of a Linear weight
(zero-padded), and the fused q|k|v and gate|up rows interleaved by y group (``rectangles.FusedRows``):
the rectangles a checkpoint saves it as (``ParamLayout.rectangles``). A rank allocates its shards and
one tile of scratch, nothing more.
"""

from __future__ import annotations

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.layout import rectangles, tiled_init
from axon4d.layout.param_layout import ParamLayout, layout_of
from axon4d.models.transformer import DenseTransformer, Transformer

#: Transformer module → DenseTransformer module where the names differ (fused rows by segment;
#: the same correspondence as the modules' ``load_dense_``)
DENSE_NAMES = {
    "attn.qkv.q": "attn.q_proj",
    "attn.qkv.k": "attn.k_proj",
    "attn.qkv.v": "attn.v_proj",
    "attn.out": "attn.o_proj",
    "mlp.up.gate": "mlp.gate",
    "mlp.up.up": "mlp.up",
    "shared.up.gate": "shared.gate",  # an MoE layer's shared experts' MLP
    "shared.up.up": "shared.up",
}


def dense_name(name: str, segment: str = "") -> str:
    """The ``DenseTransformer`` parameter that ``Transformer`` parameter ``name`` (or the
    ``segment`` of its fused rows) is a piece of."""
    module, _, attr = name.rpartition(".")
    key = f"{module}.{segment}" if segment else module
    for mine, theirs in DENSE_NAMES.items():
        if key == mine or key.endswith(f".{mine}"):
            return f"{key[: len(key) - len(mine)]}{theirs}.{attr}"
    if segment:
        raise KeyError(f"{name}: no dense parameter is known for segment {segment!r}")
    return name


@torch.no_grad()
def init_dense_(dense: DenseTransformer, seed: int, *, tiling: tiled_init.Tiling | None = None) -> DenseTransformer:
    """Initialise every parameter of ``dense`` for ``seed``, tile by tile (the reference).

    Each parameter keeps the distribution the model's constructor uses
    (``DenseTransformer.param_inits``); its values are drawn tile by tile from generators seeded
    from (``seed``, parameter name, tile), so any piece of it can be drawn alone
    (``materialize_``), on the parameters' device in that device's tiling
    (``tiled_init.tiling_for``) unless ``tiling`` is given. Returns ``dense``.
    """
    inits = dense.param_inits()
    for name, p in dense.named_parameters():
        if p.is_meta:
            raise ValueError(f"{name} is on the meta device; build the dense model on a real device")
        shape = tiled_init.init_shape(p.shape)
        tiled_init.fill_(p.view(shape), inits[name], seed, name, shape, 0, 0, tiling)
    return dense


def shard_pieces(name: str, layout: ParamLayout, numel: int, grid: Grid) -> list[rectangles.Piece]:
    """Where this rank's stored piece (``numel`` elements) of ``Transformer`` parameter ``name``
    comes from: rectangles of dense parameters — those a checkpoint saves it as
    (``ParamLayout.rectangles``), named as the dense model names them."""
    return layout.rectangles(numel, grid, lambda segment: dense_name(name, segment))


@torch.no_grad()
def materialize_(
    model: Transformer,
    seed: int,
    *,
    device: str | torch.device | None = None,
    tiling: tiled_init.Tiling | None = None,
) -> Transformer:
    """Give every parameter of ``model`` (built with ``device="meta"``) this rank's values.

    Each meta parameter gets storage of its own shape and dtype on ``device`` (default: the grid's
    device) and is filled with its shard of ``init_dense_(DenseTransformer(model.cfg), seed)``;
    parameters that already have storage are overwritten in place. A rank allocates its shards
    and one tile of scratch (``tiling``; default: the device's, ``tiled_init.tiling_for``), never a
    whole tensor, and draws the tiles on ``device``; no collective is issued. Gradient
    hooks stay attached. Build the optimizer afterwards. Returns ``model``.
    """
    grid = model.grid
    device = torch.device(device) if device is not None else grid.device
    dense = DenseTransformer(model.cfg, device="meta")  # names, shapes and distributions; no storage
    inits = dense.param_inits()
    shapes = {n: tiled_init.init_shape(p.shape) for n, p in dense.named_parameters()}
    memo: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        for p_name, p in list(module.named_parameters(recurse=False)):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            parts = shard_pieces(name, layout_of(module, p_name, p), p.numel(), grid)
            for part in parts:
                if shapes.get(part.name) != part.shape:
                    raise ValueError(f"{name}: its piece of {part.name} {part.shape} does not match the dense model")
            local = torch.empty(p.shape, dtype=p.dtype, device=device) if p.is_meta else p.detach()
            tiled_init.fill_pieces_(local, parts, inits, seed, tiling)
            if p.is_meta:
                tiled_init.replace_parameter_(module, p_name, local, memo)
        bias = getattr(module, "expert_bias", None)  # an MoE layer's balancing bias: zeros, as built
        if isinstance(bias, torch.Tensor) and bias.is_meta:
            module.expert_bias = torch.zeros(bias.shape, dtype=bias.dtype, device=device)
    return model
