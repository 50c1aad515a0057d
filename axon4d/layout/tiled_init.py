"""Initialising a rank's part of a global tensor tile by tile from a seed, and swapping parameters in.

Every parameter is a piece of a *global* tensor, the one the single-process model holds;
axon4d.layout.rectangles says which rectangles of the global tensor a rank's piece holds. This module
gives them their values without the rest of the tensor (docs/design.md §2):

- **Addressable initialisation.** A global tensor of a seed is defined tile by tile: the matrix
  (``rectangles.matrix_shape``) is cut into tiles of at most ``Tiling.elements`` elements
  (``Tiling.max_cols`` wide), and tile (i, j) is drawn from its own ``torch.Generator``, seeded
  from (seed, tensor name, i, j). ``fill_`` draws any rectangle by drawing only the tiles it
  overlaps, one at a time, and ``fill_pieces_`` a rank's pieces, so a rank can initialise its piece
  exactly as the dense model would be, on any grid, with one tile of scratch. Tiles are drawn in
  fp32 where the filled tensor lives (``axon4d.device.draw_device``) and cast: on the host with
  the host's generator and ``TILING`` (values fixed since the first release: checkpoints and tests
  rest on them); on an accelerator with that device's own generator, seeded alike, in tiles of
  ``axon4d.device.init_tile_bytes`` (16 MiB, 2048 × 2048: few launches, no host-to-device copies)
  — ``tiling_for``. An accelerator's generator (Philox) draws other values than the host's
  (Mersenne Twister), so "equal to the dense reference" holds between tensors on the same kind of
  device: the dense reference built on the accelerator draws the same tiles as the sharded model.
- **Storage.** ``replace_parameter_`` gives a parameter built on the ``meta`` device real storage,
  keeping what was attached to it (gradient hooks, marks) and ties between modules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import NamedTuple

import torch
from torch import nn

from axon4d import device as devices
from axon4d.layout.rectangles import Piece, matrix_shape


class Tiling(NamedTuple):
    """How a global tensor is cut into tiles: at most ``elements`` per tile, ``max_cols`` wide."""

    elements: int = 16384
    max_cols: int = 512

    def tile_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """(rows, cols) of the tiles of a (rows, cols) matrix; the last tile of a dim may be smaller."""
        cols = max(1, min(shape[1], self.max_cols))
        return max(1, self.elements // cols), cols


#: the tiling of every initialisation on the host unless told otherwise (changing it changes the values)
TILING = Tiling()
FP32_BYTES = torch.float32.itemsize


def tiling_for(device: torch.device) -> Tiling:
    """The tiling of a tensor on ``device``: tiles of ``axon4d.device.init_tile_bytes(device)`` of
    fp32, at least ``TILING.max_cols`` wide and otherwise square — ``TILING`` itself on the host
    (16384 elements, 512 wide), 2048 × 2048 on an accelerator."""
    elements = devices.init_tile_bytes(device) // FP32_BYTES
    return Tiling(elements, max(TILING.max_cols, math.isqrt(elements)))


@dataclasses.dataclass(frozen=True)
class Init:
    """The distribution a global tensor is drawn from."""

    kind: str
    """"uniform" (U(−scale, scale)), "normal" (N(0, scale²)) or "constant" (every element = scale)."""
    scale: float = 1.0

    @classmethod
    def uniform(cls, bound: float) -> Init:
        return cls("uniform", bound)

    @classmethod
    def normal(cls, std: float = 1.0) -> Init:
        return cls("normal", std)

    @classmethod
    def constant(cls, value: float) -> Init:
        return cls("constant", value)

    def draw(self, shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
        """A fresh fp32 tensor of ``shape`` drawn with ``generator``, on the generator's device."""
        out = torch.empty(shape, dtype=torch.float32, device=generator.device)
        if self.kind == "uniform":
            return out.uniform_(-self.scale, self.scale, generator=generator)
        if self.kind == "normal":
            return out.normal_(0.0, self.scale, generator=generator)
        raise ValueError(f"Init kind {self.kind!r} is not drawn; use 'uniform', 'normal' or 'constant'")


def init_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """The matrix a global tensor is drawn as: ``rectangles.matrix_shape`` (dim 0 its rows, the
    others its columns), but a stack of matrices — three dims, an MoE layer's experts (E, rows,
    cols) — as the (E·rows, cols) matrix, so that one expert's block of rows and columns is a
    rectangle of it (``axon4d.layout.param_layout.ExpertWeightLayout``)."""
    shape = tuple(shape)
    if len(shape) == 3:
        return shape[0] * shape[1], shape[2]
    return matrix_shape(shape)


def draw_seed() -> int:
    """One seed from torch's default host generator (every rank draws it alike, so ranks stay in
    step), whatever the default device (a model built under ``torch.device("meta")`` draws it too):
    a layer's tensors are then drawn tile by tile from it."""
    return int(torch.randint(0, 2**62, (), device=devices.HOST).item())


def tile_seed(seed: int, name: str, i: int, j: int) -> int:
    """The generator seed of tile (i, j) of global tensor ``name`` for ``seed`` (63 bits)."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{i}\0{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@torch.no_grad()
def fill_(
    out: torch.Tensor,
    init: Init,
    seed: int,
    name: str,
    shape: tuple[int, int],
    row0: int,
    col0: int,
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """Fill ``out`` (h, w) with rows [row0, row0 + h) × columns [col0, col0 + w) of the global
    (rows, cols) matrix ``name`` initialised from ``seed``, drawing only the tiles they overlap,
    each on ``out``'s device (``axon4d.device.draw_device``) in ``tiling`` (default: ``tiling_for``
    that device)."""
    h, w = out.shape
    if init.kind == "constant":
        return out.fill_(init.scale)
    tiling = tiling or tiling_for(out.device)
    where = devices.draw_device(out.device)
    rows, cols = shape
    if row0 < 0 or col0 < 0 or row0 + h > rows or col0 + w > cols:
        raise ValueError(f"rectangle rows {row0}+{h}, cols {col0}+{w} is outside {name} of shape {shape}")
    tr, tc = tiling.tile_shape(shape)
    for i in range(row0 // tr, -(-(row0 + h) // tr)):
        t_r0, t_r1 = i * tr, min((i + 1) * tr, rows)
        r_a, r_b = max(row0, t_r0), min(row0 + h, t_r1)
        for j in range(col0 // tc, -(-(col0 + w) // tc)):
            t_c0, t_c1 = j * tc, min((j + 1) * tc, cols)
            c_a, c_b = max(col0, t_c0), min(col0 + w, t_c1)
            generator = torch.Generator(device=where).manual_seed(tile_seed(seed, name, i, j))
            tile = init.draw((t_r1 - t_r0, t_c1 - t_c0), generator)
            out[r_a - row0 : r_b - row0, c_a - col0 : c_b - col0].copy_(
                tile[r_a - t_r0 : r_b - t_r0, c_a - t_c0 : c_b - t_c0]
            )
    return out


@torch.no_grad()
def fill_pieces_(
    flat: torch.Tensor,
    parts: list[Piece],
    inits: dict[str, Init],
    seed: int,
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """Fill the flat local tensor ``flat`` with ``parts`` of seeded global tensors (``inits``: the
    distribution of each; ``tiling``: as ``fill_``); every element no piece covers (z padding) is zero."""
    flat = flat.view(-1)
    end = 0
    for p in parts:
        dest = flat[p.offset : p.offset + p.numel].view(p.rows, p.cols)
        fill_(dest, inits[p.name], seed, p.name, p.shape, p.row0, p.col0, tiling)
        end = max(end, p.offset + p.numel)
    flat[end:].zero_()
    return flat


def replace_parameter_(
    module: nn.Module, name: str, data: torch.Tensor, memo: dict[int, nn.Parameter] | None = None
) -> nn.Parameter:
    """Put a new ``nn.Parameter`` holding ``data`` in place of ``module``'s parameter ``name``
    (one built on the meta device cannot take real storage in place), carrying over its gradient
    hooks, the attributes set on it and ``requires_grad``. With ``memo`` (id of the old parameter →
    new one), a parameter shared by several modules becomes one shared new parameter."""
    old = module._parameters[name]
    assert old is not None
    if memo is not None and id(old) in memo:
        new = memo[id(old)]
    else:
        new = nn.Parameter(data, requires_grad=old.requires_grad)
        new.__dict__.update(old.__dict__)
        if old._backward_hooks:
            new._backward_hooks = old._backward_hooks
        post = getattr(old, "_post_accumulate_grad_hooks", None)
        if post:
            new._post_accumulate_grad_hooks = post
        if memo is not None:
            memo[id(old)] = new
    module._parameters[name] = new
    return new
