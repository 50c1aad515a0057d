"""Multi-head latent attention (MLA, DeepSeek-V2/V3) on the grid, heads split over y (docs/design.md §2).

MLA's keys and values come from a small latent instead of per-head projections of the residual:

    q      = W_qb · norm_q(W_qa x)            (q_lora_rank set; else q = W_q x)      per head: [nope | rope]
    [c | r] = W_kva x                         c: the kv latent (kv_lora_rank), r: one rotary key (d_r) shared by all heads
    [k_nope | v] = W_kvb · norm_kv(c)          per head: k_nope (d_n), v (d_v)
    k      = [k_nope | rope(r)],  q = [q_nope | rope(q_rope)]
    out    = W_o · softmax(q kᵀ · scale, causal) v,  scale = (d_n + d_r)^(-1/2) unless given

On the grid the input is the residual shard (b, s, hidden/G_x), replicated over y, as for
``axon4d.nn.attention.Attention``:

- The big projections are ``axon4d.Linear`` layers: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj``
  normal (input over x, output — whole heads, in the model's own row order — over y), ``o_proj``
  transposed (the heads' values over y in, hidden over x out). Each y rank runs attention on its
  n_heads/G_y heads with no communication.
- The down projections ``q_a_proj`` and ``kv_a_proj_with_mqa`` are ``ReplicatedProjection``s: the
  weight whole on every rank, each rank multiplying its x columns and the partial latents summed
  over x (one all-reduce of b·s·(q_lora_rank + kv_lora_rank + d_r) elements). Why not 3D layers:
  the RMSNorm after each needs the sum of squares over the *whole* latent, and ``q_b_proj`` /
  ``kv_b_proj`` need the normed latent split over x and whole over y; a 3D down projection gives it
  split over y, so the norm's sum would be an all-reduce over y and the latent would then be
  all-gathered over y and re-split over x — the same activation bytes as the x all-reduce, plus a
  collective, to save the weight's memory (DeepSeek-V3: (1536 + 576) × 7168 = 15.1 M elements per
  layer, against 171 M in the three split projections). Here the norm's sum is taken locally over
  the whole latent on every rank (``LatentNorm``). The cost is the weight's gradient: all-reduced
  over x (each x rank has its columns') and averaged over batch = data × z, as a norm's; the norm
  weights' gradients (the same on every rank of an x·y plane) are averaged over batch only.
- The normed latents enter their 3D layer through ``split_replicated`` over x (its backward
  all-gathers the input gradient, complete over y: the Linear sums its dX over y). The rotary key
  r is used by every y rank's heads, so its gradient is summed over y (``use_replicated``).

Rotary embeddings: the half-split convention of ``axon4d.nn.attention.apply_rotary`` on the d_r
rope features with frequencies θ^(−2i/d_r); ``rope_interleave`` (transformers' DeepSeek-V3
default) takes the rope features as interleaved pairs (x0, x1), (x2, x3), … — they are first
reordered to [evens | odds], which makes the two conventions the same arithmetic.

Context parallelism is refused (the split core for MLA's unequal q/k and v head sizes is not built).
``recompute_core`` keeps q, k and v only and runs the core again in backward.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from axon4d import device as devices
from axon4d.grid import rules, runtime
from axon4d.grid.mesh import Grid
from axon4d.layout import tiled_init
from axon4d.layout.geometry import Term
from axon4d.nn.attention import apply_rotary, rotary_tables
from axon4d.nn.functional import average_grad_over_batch, split_replicated, sum_to_replicas
from axon4d.nn.linear import Linear
from axon4d.nn.moe_rows import use_replicated
from axon4d.nn.recompute import recomputed


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """(..., d) features as interleaved pairs (x0, x1), (x2, x3), … reordered to [x0, x2, … | x1, x3, …]."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def mla_attention(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
    interleave: bool,
) -> torch.Tensor:
    """Causal MLA core of q (b, s, h, d_n + d_r), k_nope (b, s, h, d_n), the shared rotary key k_rope
    (b, s, d_r), v (b, s, h, d_v), rotary tables cos, sin (s, d_r) or (b, s, d_r); returns (b, s, h·d_v)."""
    b, s, h, _ = q.shape
    dn = k_nope.shape[-1]
    q_nope, q_rope = q.split([dn, q.shape[-1] - dn], dim=-1)
    if interleave:
        q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
    if cos.dim() == 3:  # per sequence: broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rope = apply_rotary(q_rope.transpose(1, 2), cos, sin)  # (b, h, s, d_r)
    k_rope = apply_rotary(k_rope.unsqueeze(1), cos, sin)  # (b, 1, s, d_r)
    q_full = torch.cat([q_nope.transpose(1, 2), q_rope], dim=-1)  # (b, h, s, d_n + d_r)
    k_full = torch.cat([k_nope.transpose(1, 2), k_rope.expand(-1, h, -1, -1)], dim=-1)
    out = F.scaled_dot_product_attention(q_full, k_full, v.transpose(1, 2), is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(b, s, h * v.shape[-1])


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight · x / √(mean(x²) + eps) over the last dim, the statistics in fp32 (Llama's RMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class DenseRMSNorm(nn.Module):
    """RMSNorm of one process over the last dim (the reference's latent norms)."""

    def __init__(self, n: int, eps: float, device: Any = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.weight, self.eps)


class _Shape:
    """MLA's sizes and options, shared by the grid module and its reference."""

    def __init__(self, hidden: int, n_heads: int, kw: dict[str, Any]):
        self.hidden, self.n_heads = hidden, n_heads
        self.q_lora_rank: int | None = kw["q_lora_rank"]
        self.kv_lora_rank: int = kw["kv_lora_rank"]
        self.qk_nope_head_dim: int = kw["qk_nope_head_dim"]
        self.qk_rope_head_dim: int = kw["qk_rope_head_dim"]
        self.v_head_dim: int = kw["v_head_dim"]
        self.bias: bool = kw["bias"]
        self.rope_theta: float = kw["rope_theta"]
        self.rope_interleave: bool = kw["rope_interleave"]
        self.norm_eps: float = kw["norm_eps"]
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.softmax_scale: float = kw["softmax_scale"] if kw["softmax_scale"] is not None else qk**-0.5


def _sizes(
    q_lora_rank: int | None = None,
    kv_lora_rank: int = 512,
    qk_nope_head_dim: int = 128,
    qk_rope_head_dim: int = 64,
    v_head_dim: int = 128,
    bias: bool = False,
    rope_theta: float = 10000.0,
    rope_interleave: bool = False,
    norm_eps: float = 1e-6,
    softmax_scale: float | None = None,
) -> dict[str, Any]:
    """MLA's keyword options with their defaults (DeepSeek-V3's head sizes)."""
    return dict(locals())


class DenseMLA(nn.Module):
    """The single-process reference: ``nn.Linear`` projections named as transformers' DeepSeek-V3
    attention names them (module docstring's equations)."""

    def __init__(self, hidden: int, n_heads: int, device: Any = None, dtype: torch.dtype | None = None, **options: Any):
        super().__init__()
        sh = self.shape = _Shape(hidden, n_heads, _sizes(**options))
        kw: dict[str, Any] = dict(device=device, dtype=dtype)
        dn, dr, dv = sh.qk_nope_head_dim, sh.qk_rope_head_dim, sh.v_head_dim
        if sh.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, n_heads * (dn + dr), bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(hidden, sh.q_lora_rank, bias=sh.bias, **kw)
            self.q_a_layernorm = DenseRMSNorm(sh.q_lora_rank, sh.norm_eps, **kw)
            self.q_b_proj = nn.Linear(sh.q_lora_rank, n_heads * (dn + dr), bias=False, **kw)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, sh.kv_lora_rank + dr, bias=sh.bias, **kw)
        self.kv_a_layernorm = DenseRMSNorm(sh.kv_lora_rank, sh.norm_eps, **kw)
        self.kv_b_proj = nn.Linear(sh.kv_lora_rank, n_heads * (dn + dv), bias=False, **kw)
        self.o_proj = nn.Linear(n_heads * dv, hidden, bias=sh.bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s, hidden) → (b, s, hidden)."""
        sh, (b, s, _) = self.shape, x.shape
        dn, dr, dv = sh.qk_nope_head_dim, sh.qk_rope_head_dim, sh.v_head_dim
        if sh.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([sh.kv_lora_rank, dr], dim=-1)
        k_nope, v = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, sh.n_heads, dn + dv).split([dn, dv], -1)
        cos, sin = rotary_tables(s, dr, sh.rope_theta, x.device, x.dtype)
        core = mla_attention(
            q.view(b, s, sh.n_heads, dn + dr), k_nope, k_rope, v, cos, sin, sh.softmax_scale, sh.rope_interleave
        )
        return self.o_proj(core)


class ReplicatedProjection(nn.Module):
    """A down projection (out, in) whole on every rank, on the residual shard (…, in/G_x): each rank
    multiplies its x columns and the partial outputs are summed over x, so the output (…, out) is
    whole and the same on every rank of an x·y plane (module docstring). The weight's gradient is
    summed over x and averaged over batch; the bias's averaged over batch."""

    def __init__(self, dense: nn.Module, grid: Grid):
        super().__init__()
        dense = cast(nn.Linear, dense)
        self.weight = nn.Parameter(dense.weight.detach().clone())
        self.bias = None if dense.bias is None else nn.Parameter(dense.bias.detach().clone())
        self.grid = grid
        for p in self.parameters():
            average_grad_over_batch(p, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid, cols = self.grid, x.shape[-1]
        start = grid.coord("x") * cols
        w = use_replicated(self.weight, "x", grid, Term.REPLICATED_GRAD)[:, start : start + cols]
        y = sum_to_replicas(x @ w.t().to(x.dtype), "x", grid)  # (…, out), partial over x before the sum
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> nn.Linear:
        p = self.weight
        dense = nn.Linear(p.shape[1], p.shape[0], bias=self.bias is not None, device=p.device, dtype=p.dtype)
        _copy(dense, self, grads)
        return dense


class LatentNorm(nn.Module):
    """An RMSNorm over a whole latent held alike on every rank of an x·y plane: no communication in
    forward; the weight's gradient (the same on every such rank) averaged over batch."""

    def __init__(self, dense: DenseRMSNorm | nn.Module, grid: Grid):
        super().__init__()
        norm: Any = dense
        self.weight = nn.Parameter(norm.weight.detach().clone())
        self.eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
        self.grid = grid
        average_grad_over_batch(self.weight, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.weight, self.eps)

    @torch.no_grad()
    def to_dense(self, grads: bool = False) -> DenseRMSNorm:
        dense = DenseRMSNorm(self.weight.shape[0], self.eps, device=self.weight.device, dtype=self.weight.dtype)
        _copy(dense, self, grads)
        return dense


def _copy(dense: nn.Module, src: nn.Module, grads: bool) -> None:
    """Copy ``src``'s parameters (and gradients) into ``dense``'s of the same names."""
    mine = dict(src.named_parameters())
    for name, p in dense.named_parameters():
        p.copy_(mine[name])
        g = mine[name].grad
        p.grad = g.clone() if grads and g is not None else None


class MLA(nn.Module):
    """Causal multi-head latent attention on (b, s, hidden/G_x) activations, replicated over y
    (module docstring). Options (keywords, DeepSeek-V3's names): ``q_lora_rank`` (None: one
    ``q_proj``), ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
    ``bias`` (on the down projections and o_proj, transformers' ``attention_bias``), ``rope_theta``,
    ``rope_interleave``, ``norm_eps`` (the latent norms'), ``softmax_scale`` (None: (d_n + d_r)^-½)."""

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        *,
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        recompute_core: bool = False,
        context_parallel: bool | str = False,
        **options: Any,
    ):
        super().__init__()
        self.grid = grid = runtime.resolve(grid)
        if context_parallel:
            raise ValueError(
                f"MLA (multi-head latent attention) with context_parallel={context_parallel!r} is not supported: "
                "its core is not split over z; train it with context_parallel=False (sequences whole on each rank)"
            )
        sh = self.shape = _Shape(hidden, n_heads, _sizes(**options))
        self.recompute_core = recompute_core
        self._check(grid)
        dn, dr, dv = sh.qk_nope_head_dim, sh.qk_rope_head_dim, sh.v_head_dim
        self.local_heads = n_heads // grid.size("y")
        dense = DenseMLA(hidden, n_heads, device="meta", dtype=dtype, **options)  # shapes only
        kw: dict[str, Any] = dict(grid=grid, device=device, dtype=dtype)
        if sh.q_lora_rank is None:
            self.q_proj = Linear(hidden, n_heads * (dn + dr), bias=False, transpose=False, **kw)
        else:
            self.q_a_proj = ReplicatedProjection(_empty(dense.q_a_proj, grid, device), grid)
            self.q_a_layernorm = LatentNorm(_empty(dense.q_a_layernorm, grid, device), grid)
            self.q_b_proj = Linear(sh.q_lora_rank, n_heads * (dn + dr), bias=False, transpose=False, **kw)
        self.kv_a_proj_with_mqa = ReplicatedProjection(_empty(dense.kv_a_proj_with_mqa, grid, device), grid)
        self.kv_a_layernorm = LatentNorm(_empty(dense.kv_a_layernorm, grid, device), grid)
        self.kv_b_proj = Linear(sh.kv_lora_rank, n_heads * (dn + dv), bias=False, transpose=False, **kw)
        self.o_proj = Linear(n_heads * dv, hidden, bias=sh.bias, transpose=True, **kw)
        if not self.o_proj.weight.is_meta:
            self._init_replicated(tiled_init.draw_seed())

    @torch.no_grad()
    def _init_replicated(self, seed: int) -> None:
        """The whole-on-every-rank parts drawn alike on every rank from ``seed``: the down projections
        as ``nn.Linear`` draws them (uniform ±1/√in, biases 0), the norms' weights 1."""
        gen = torch.Generator(device=devices.HOST).manual_seed(seed)
        for m in self.modules():
            if isinstance(m, ReplicatedProjection):
                bound = m.weight.shape[1] ** -0.5
                w = torch.empty(m.weight.shape, device=devices.HOST).uniform_(-bound, bound, generator=gen)
                m.weight.copy_(w)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, LatentNorm):
                m.weight.fill_(1.0)

    def _check(self, grid: Grid) -> None:
        """The sizes and the grid: the same ValueError on every rank, before any collective."""
        sh = self.shape
        rules.count(sh.hidden, "hidden", example=1024)
        rules.count(sh.n_heads, "n_heads", example=8)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            rules.count(getattr(sh, name), name, example=128)
        if sh.q_lora_rank is not None:
            rules.count(sh.q_lora_rank, "q_lora_rank", example=1536)
        dr = sh.qk_rope_head_dim
        if not isinstance(dr, int) or isinstance(dr, bool) or dr < 2 or dr % 2:
            raise ValueError(
                f"qk_rope_head_dim = {dr!r}: rotary embeddings rotate pairs of features; use an even one, e.g. 64"
            )
        checks = [
            rules.Rule(sh.n_heads, "n_heads", ("y",), "MLA splits heads over y"),
            rules.Rule(sh.hidden, "hidden", ("x",), "MLA's input and output are split over x"),
            rules.Rule(sh.kv_lora_rank, "kv_lora_rank", ("x",), "kv_b_proj takes the kv latent split over x"),
        ]
        if sh.q_lora_rank is not None:
            checks.append(rules.Rule(sh.q_lora_rank, "q_lora_rank", ("x",), "q_b_proj takes the q latent split over x"))
        rules.check(grid.shape, checks)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """(b, s, hidden/G_x) → (b, s, hidden/G_x), causal over the s positions; ``rotary``: the
        (cos, sin) tables, (s, d_r) or (b, s, d_r) (None: positions 0 … s−1 at ``rope_theta``)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"MLA expects this rank's activations (batch, seq, hidden/G_x), got {shape}")
        sh, grid, (b, s, _) = self.shape, self.grid, x.shape
        dn, dr, dv, h = sh.qk_nope_head_dim, sh.qk_rope_head_dim, sh.v_head_dim, self.local_heads
        if sh.q_lora_rank is None:
            q = self.q_proj(x)  # (b, s, h·(d_n + d_r)) of this y rank's heads
        else:
            latent_q = self.q_a_layernorm(self.q_a_proj(x))  # (b, s, q_lora_rank), whole
            q = self.q_b_proj(split_replicated(latent_q, "x", grid))
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([sh.kv_lora_rank, dr], dim=-1)  # whole
        kv = self.kv_b_proj(split_replicated(self.kv_a_layernorm(latent), "x", grid))  # (b, s, h·(d_n + d_v))
        k_nope, v = kv.view(b, s, h, dn + dv).split([dn, dv], dim=-1)
        k_rope = use_replicated(k_rope, "y", grid, Term.REPLICATED_GRAD)  # every y rank's heads read it
        if rotary is None:
            rotary = rotary_tables(s, dr, sh.rope_theta, x.device, x.dtype)
        args = (q.view(b, s, h, dn + dr), k_nope, k_rope, v, *rotary, sh.softmax_scale, sh.rope_interleave)
        core = recomputed(mla_attention, *args) if self.recompute_core else mla_attention(*args)
        return self.o_proj(core)  # (b, s, hidden/G_x)

    def _parts(self) -> list[str]:
        """The names of the projections and norms, as ``DenseMLA`` names them."""
        q = ["q_proj"] if self.shape.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        return [*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]

    @torch.no_grad()
    def load_dense_(self, dense: nn.Module) -> MLA:
        """Take the weights of ``dense`` (a ``DenseMLA``, or any module with its parts' names)."""
        for name in self._parts():
            mine, theirs = getattr(self, name), getattr(dense, name)
            if isinstance(mine, Linear):
                mine.load_dense_(theirs.weight, theirs.bias)
            else:
                for p_name, p in mine.named_parameters():
                    p.copy_(getattr(theirs, p_name))
        return self

    def to_dense(self, grads: bool = False) -> DenseMLA:
        """The ``DenseMLA`` with the full weights (and ``.grad``), on every rank (gathers over x, y, z)."""
        sh, p = self.shape, self.o_proj.weight
        options = {k: getattr(sh, k) for k in _sizes()}
        dense = DenseMLA(sh.hidden, sh.n_heads, device=p.device, dtype=p.dtype, **options)
        for name in self._parts():
            setattr(dense, name, getattr(self, name).to_dense(grads))
        return dense


def _empty(m: nn.Module, grid: Grid, device: Any) -> nn.Module:
    """``m`` (built on meta for its shape) with storage on ``device`` (default: the grid's), or left on
    meta when ``device`` is meta (a model built on meta and loaded by slices)."""
    target = torch.device(device) if device is not None else grid.device
    return m if target.type == "meta" else m.to_empty(device=target)
