"""A Mixture-of-Experts layer on the 4D grid (docs/moe.md; E14–E18), equal to ``DenseMoE``.

Input and output are the residual layout (T, hidden/G_x) per rank, replicated over y. Placement:

- the **router** weight (E, hidden) is split over x by input features, replicated elsewhere; its
  partial logits are all-reduced over x (E14) and every rank of an (x, y) plane routes its own
  tokens in fp32 (axon4d.nn.moe_router); its gradient is averaged over batch like a norm's;
- the **experts** follow the layer's expert layout (``axon4d.grid.expert_layout``; the default
  ep=batch, tp=x·y): rank i of the expert-parallel axes ``ep`` holds experts i·E/G_ep …
  (i+1)·E/G_ep − 1; each expert's FFN is split over the tensor-parallel axes as the dense MLP is —
  up (hidden/G_x → f/G_y, gate|up by y chunk when gated) then down (f/G_y → hidden/G_x), an axis
  the layout does not give to ``tp`` splitting nothing — and the expert data-parallel axes ``dp``
  hold replicas, whose weight gradients are all-reduced over ``dp`` (``Term.MOE_EXPERT_WEIGHT_GRAD``;
  reduce-scattered over data under ZeRO-2 where dp is data alone, ``axon4d.scheduler.sharding``);
  every gradient is scaled by 1/G_batch (the batch average, docs/design.md §2);
- the **shared experts** are one dense ``MLP`` of shared_experts·f (3D Linear layers).

Forward, per rank: logits (E14) → top-k → the counts exchange (E15, the host sync) → this rank's
share of the plane's tokens (the y-th share; cut over x too, the rows moved from features to rows
over x, where x does not split the experts), its assignments sorted by expert, all-to-all over
``ep`` (E16) → gathered over y where y splits the experts (E17) → grouped GEMMs of the local
experts (E18, all-reduce over x after up where x splits them, reduce-scatter over y after down
where y does) → each row times its gate (the gates travel with the rows) → all-to-all back →
summed per token → back to features over x → gathered over y. The share is dispatched in the
overlap policy's forward chunks, each chunk's exchanges in flight while other chunks' GEMMs run
(``axon4d.nn.moe_dispatch.Exchange``, docs/moe.md "Overlap"). Under full recomputation the re-run
adopts the rows the forward's dispatches delivered and stops before the combines: it exchanges
nothing (docs/moe.md, "Recomputation"). Under a layout with ``dispatch=fp8`` the rows travel to the experts — the dispatch, and
in backward the combine's gradient — in e4m3 with a scale per 128 features
(``axon4d.options.fp8_rows``); ``to_dense`` casts the reference's expert inputs and gated output
gradients alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from axon4d.config import ModelConfig
from axon4d.device.pinned import to_device_queued
from axon4d.grid import runtime
from axon4d.grid.expert_layout import ExpertLayout
from axon4d.grid.mesh import Grid
from axon4d.grid.shape import axis_of
from axon4d.layout import tiled_init
from axon4d.layout.geometry import Term
from axon4d.memory import offload
from axon4d.nn import moe_router
from axon4d.nn.functional import average_grad_over_batch, sum_partials, sum_to_replicas
from axon4d.nn.mlp import MLP
from axon4d.nn.moe_dense import ROUTER, DenseMoE, uniform_for
from axon4d.nn.moe_dispatch import Exchange
from axon4d.nn.moe_experts import GridExperts, check_layout
from axon4d.nn.moe_gates import gated, summed_pairs
from axon4d.nn.moe_routes import DispatchPlan, Peers, share_sizes
from axon4d.nn.moe_rows import (
    features_to_rows,
    gather_rows,
    rows_to_features,
    scatter_rows,
    share_rows,
    use_replicated,
)
from axon4d.options.precision import compute_dtype


class Router(nn.Module):
    """The router weight, this rank's (E, hidden/G_x) columns (split over x)."""

    def __init__(self, n_experts: int, hidden: int, grid: Grid, device: Any, dtype: Any):
        super().__init__()
        self.n_experts, self.hidden = n_experts, hidden
        cols = hidden // grid.size("x")
        self.weight = nn.Parameter(torch.empty(n_experts, cols, device=device, dtype=dtype))


class MoE(nn.Module):
    """Mixture-of-Experts FFN on (…, hidden/G_x) activations replicated over y (module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        grid: Grid | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        layout: ExpertLayout | str | None = None,
        recompute_activation: bool = False,
    ):
        super().__init__()
        self.grid = grid = runtime.resolve(grid)
        if not cfg.moe:
            raise ValueError("MoE needs a config with n_experts > 0 (ModelConfig(n_experts=8, ...))")
        #: where the experts run (``axon4d.grid.expert_layout``): ``layout``, else the grid's
        self.layout = ExpertLayout.parse(layout if layout is not None else grid.expert_layout)
        check_layout(cfg, grid, self.layout)  # the same ValueError on every rank, before any collective
        self.cfg = cfg
        device = torch.device(device) if device is not None else grid.device
        seed = tiled_init.draw_seed()  # the router's and the experts', as DenseMoE draws it
        self.router = Router(cfg.n_experts, cfg.hidden, grid, device, dtype)
        self.experts = GridExperts(cfg, grid, self.layout, device, dtype)
        #: the rows are cut over x too, and moved from features to rows, where x does not split experts
        self.rows_over_x = self.layout.rows_over_x(grid.shape)
        ep, count = self.layout.ep_axes(grid.shape), self.layout.count_axes(grid.shape)
        summed = self.layout.summed_axes(grid.shape)
        #: the replicas' axis their weight gradients are summed over (None: none)
        self.dp_axis = axis_of(self.layout.dp_axes(grid.shape))
        self.peers = Peers.of(
            grid.shape, grid.rank, ep, count, self.layout.gathers_y(grid.shape), cfg.n_experts, summed
        )
        for axis in (axis_of(ep), self.peers.count_axis, self.peers.total_axis, self.dp_axis):
            if axis is not None:
                grid.open_axis(axis)  # collective: every rank builds its layers in the same order
        shared = cfg.shared_experts * cfg.expert_width
        kw: dict[str, Any] = dict(grid=grid, device=device, dtype=dtype)
        # the shared experts' MLP re-makes its activation in backward under balanced recomputation
        # (``recompute_activation``), as a dense block's MLP does
        self.shared = (
            MLP(cfg.hidden, shared, gated=cfg.gated, bias=False, recompute_activation=recompute_activation, **kw)
            if shared
            else None
        )
        if not self.router.weight.is_meta:
            self.reset_parameters(seed)
        average_grad_over_batch(self.router.weight, grid, Term.MOE_ROUTER_WEIGHT_GRAD)
        if self.dp_axis is not None:
            for p in self.experts.parameters():
                grid.scheduler.track_replicated(p, Term.MOE_EXPERT_WEIGHT_GRAD, self.dp_axis)
        #: auxiliary-loss-free balancing's per-expert bias (E,) fp32, whole and the same on every rank
        #: (moved from the micro-batch's global counts); a buffer, saved with the model
        self.expert_bias: torch.Tensor | None
        bias = torch.zeros(cfg.n_experts, device=device) if cfg.moe_bias_update_rate else None
        self.register_buffer("expert_bias", bias)
        #: the last forward's weighted balance loss + z-loss (0-dim fp32, a rank's share: docs/moe.md)
        self.aux_loss: torch.Tensor | None = None
        #: the last forward's assignments per expert over the whole micro-batch (host ints)
        self.tokens_per_expert: list[int] | None = None
        #: the last forward's unweighted balance loss E19 (0-dim, detached), for the job's log
        self.balance: torch.Tensor | None = None
        #: counts exchanges (host syncs) this layer has made: one per forward, none in a re-run
        self.exchanges = 0

    # -- forward ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, grid = self.cfg, self.grid
        cols = self.router.weight.shape[1]
        if x.dim() < 1 or x.shape[-1] != cols:  # the same ValueError on every rank, before any collective
            raise ValueError(
                f"MoE expects this rank's residual shard with last dim hidden/G_x = {cfg.hidden}/{grid.size('x')} "
                f"= {cols}, got shape {tuple(x.shape)}; shard a full input with axon4d.shard_input(x)"
            )
        x2 = x.reshape(-1, x.shape[-1])  # (T, hidden/G_x)
        tokens, k = x2.shape[0], cfg.experts_per_token
        partial = x2.float() @ self.router.weight.float().t()  # (T, E), partial over x
        logits = sum_to_replicas(partial, "x", grid, tag=Term.MOE_ROUTER, in_place=True)  # E14
        s = moe_router.scores(logits, cfg.router_scoring)  # (T, E) fp32
        y_shares = share_sizes(tokens, grid.size("y"))  # each y index's tokens
        x_shares = share_sizes(y_shares[grid.coord("y")], grid.size("x")) if self.rows_over_x else [0]
        shares = self._shares(y_shares)  # every rank's share of the plane, in token order
        mine = self._mine()
        chunks = self._chunks(shares[mine], x2)
        chosen, plans, fresh = self._route(s, shares, mine, chunks)
        g = moe_router.gates(s, chosen, cfg.router_topk_norm, cfg.routed_scaling_factor)  # (T, k)
        self.tokens_per_expert = np.sum([p.tokens_per_expert() for p in plans], axis=0).tolist()  # (E,), all chunks
        seq_len = x.shape[-2] if x.dim() > 2 else tokens
        # the re-run of a fully recomputed forward computes the losses again — its ops must save what
        # the forward's did, in order — but keeps the forward's: a re-run's graph kept here would hold
        # the block's rebuilt activations to the end of the backward
        aux = self._aux(logits, s, tokens, chosen, seq_len)
        if fresh:
            self.aux_loss = aux
        if self.expert_bias is not None and self.training and fresh:  # not in a recomputed re-run
            moe_router.bias_step(self.expert_bias, self.tokens_per_expert, cfg.moe_bias_update_rate)
        t0 = sum(shares[:mine])
        x_share = share_rows(x2, y_shares, "y", grid)  # (T_j, hidden/G_x)
        if self.rows_over_x:  # this rank's rows of the share, every feature: (T_ji, hidden)
            x_share = features_to_rows(x_share, x_shares, "x", grid)
        # the gates of this share's assignments (T_share, k), sent with the rows: each expert applies
        # its rows' gates before they travel home, so the gated sum there keeps nothing for backward
        gate = g if self.rows_over_x else use_replicated(g, "x", grid, Term.MOE_ROUTER_GRAD)
        gate = share_rows(gate, y_shares, "y", grid, Term.MOE_ROUTER_GRAD)
        if self.rows_over_x:
            gate = share_rows(gate, x_shares, "x", grid, Term.MOE_ROUTER_GRAD)
        gate = gate.reshape(-1)  # (T_share·k,) in assignment order
        ep = self.experts.ep_axis
        fp8 = self.layout.fp8_dispatches(grid.shape)  # rows toward the experts in e4m3 (``fp8_rows``)
        # a fully recomputed forward keeps what its dispatches delivered, and its re-run adopts that
        # instead of exchanging again; the re-run's combines would send only when reached (``lazy``),
        # and torch's checkpoint stops the re-run before them: nothing after them is saved
        memo, replaying = grid.scheduler.region_memo
        kept: list[Any] = [None] * len(plans)  # each chunk's payload, in the re-run
        if memo is not None and replaying:
            kept = [offload.unpack(payload) for payload in memo.replay(self.experts)]
        recording = memo is not None and not replaying
        # E16 for every chunk of this share issued at once; chunk i's rows are waited for just before
        # its expert GEMMs, the later chunks' still on the wire, and each chunk's combine stays in
        # flight behind the next chunk's GEMMs; backward mirrors it (``Exchange``)
        dispatches, orders, start = [], [], 0
        for plan, n, payload in zip(plans, share_sizes(shares[mine], len(plans)), kept):
            assigned = chosen[t0 + start : t0 + start + n].reshape(-1)  # (n·k,) experts of the chunk's assignments
            order = torch.argsort(assigned, stable=True)  # sorted by expert
            ex = Exchange(
                plan.send_rows,
                plan.recv_rows,
                ep,
                grid,
                Term.MOE_DISPATCH,
                fp8_forward=fp8,
                kept=payload,
                keep=recording,
            )
            rows, gates = ex.dispatch(x_share, order // k + start, gate, order + start * k)  # (n·k, features), (n·k,)
            dispatches.append((ex, rows, gates))
            orders.append(order + start * k)
            start += n
        combines = []
        for plan, (ex, rows, gates) in zip(plans, dispatches):
            got, got_gates = ex.adopt(rows, gates)
            out = self._experts(got, plan)  # (n_all, features), partial over y where y splits experts
            home = Exchange(
                plan.recv_rows, plan.send_rows, ep, grid, Term.MOE_COMBINE, fp8_backward=fp8, lazy=replaying
            )
            if self.peers.y_members is not None:  # the down GEMM's partial sums reduced over y, each keeping its rows
                out = scatter_rows(out, plan.y_rows, "y", grid, Term.MOE_EXPERT)
            out = gated(out, got_gates)  # (n_recv, features): each row times its gate
            rows = home.awaited(out)
            del out  # the gated rows live on as the combine's payload alone (memory)
            home.issue(rows)
            combines.append((home, rows))
        if recording and memo is not None:  # for the re-run (memory: priced), on the host where the block is offloaded
            memo.record(
                self.experts, [None if ex.received is None else offload.pack(ex.received) for ex, _, _ in dispatches]
            )
            for ex, _, _ in dispatches:
                ex.received = None  # the memo's (a host copy where the block is offloaded) is the one kept
        # the shared experts run while the combines travel; in backward, while the combines' reverse
        # exchanges travel (their gradients' all-to-alls are issued before the shared MLP's backward)
        shared = self.shared(x) if self.shared is not None else None
        backs = [ex.adopt(rows) for ex, rows in combines]  # (n_j, features) in all, sorted chunk by chunk
        back = torch.cat(backs) if len(backs) > 1 else backs[0]
        # the gated rows back in token order and summed per token: T rows travel on, not T·k
        out = summed_pairs(back, torch.argsort(torch.cat(orders)), k)  # (T_share, features)
        if self.rows_over_x:
            out = rows_to_features(out, x_shares, "x", grid)  # (T_j, hidden/G_x)
        y = gather_rows(out, y_shares, "y", grid, summed=False).view(x.shape)  # (T, hidden/G_x)
        return y + shared if shared is not None else y

    def _shares(self, y_shares: list[int]) -> list[int]:
        """Rows of every share of the plane's tokens, in token order: the y shares, each cut over x
        where the rows move over x."""
        if not self.rows_over_x:
            return y_shares
        return [n for share in y_shares for n in share_sizes(share, self.grid.size("x"))]

    def _mine(self) -> int:
        """This rank's share index: its y index, times G_x plus its x index where rows move over x."""
        grid = self.grid
        return grid.coord("y") * grid.size("x") + grid.coord("x") if self.rows_over_x else grid.coord("y")

    def _chunks(self, rows: int, x2: torch.Tensor) -> int:
        """How many chunks each share's tokens are dispatched in: the overlap policy's forward
        chunking (``Scheduler.forward_chunks``) of a share's tokens of k rows each, the same count on
        every rank (the first share is the longest); one when no axis holds different experts."""
        ep = self.experts.ep_axis
        if ep is None:
            return 1
        features = x2.shape[1] * (self.grid.size("x") if self.rows_over_x else 1)
        row_bytes = self.cfg.experts_per_token * features * x2.element_size()
        first = self._shares(share_sizes(x2.shape[0], self.grid.size("y")))[0]
        return len(self.grid.scheduler.forward_chunks(max(first, 1), row_bytes, self.grid.size(ep)))

    def _route(
        self, s: torch.Tensor, shares: list[int], mine: int, chunks: int
    ) -> tuple[torch.Tensor, list[DispatchPlan], bool]:
        """Each token's k experts and each chunk's dispatch plan: chosen now (and exchanged: the
        host sync), or, in the re-run of a fully recomputed forward, that forward's (kept in the
        region's memo with its autograd state, ``axon4d.scheduler.replay``); and whether chosen now."""
        memo, replaying = self.grid.scheduler.region_memo
        if memo is not None and replaying:
            chosen, plans = memo.replay(self)  # the re-run inside backward: the routing its forward chose
            return chosen, plans, False
        cfg, grid = self.cfg, self.grid
        chosen = moe_router.choose(s, cfg.experts_per_token, self.expert_bias, cfg.n_groups, cfg.topk_groups)  # (T, k)
        # this rank's share cut into ``chunks`` contiguous runs: the chunk of each of its assignments
        t0, sizes = sum(shares[:mine]), share_sizes(shares[mine], chunks)
        bins = to_device_queued(
            torch.repeat_interleave(torch.arange(chunks), torch.tensor(sizes, dtype=torch.long)), s.device
        )
        key = (bins.unsqueeze(1) * cfg.n_experts + chosen[t0 : t0 + shares[mine]]).reshape(-1)
        counts = moe_router.value_counts(key, chunks * cfg.n_experts).view(chunks, cfg.n_experts)
        plans = DispatchPlan.exchange(counts, self.peers, grid)  # E15: the host sync
        self.exchanges += 1
        if memo is not None:
            memo.record(self, (chosen, plans))
        return chosen, plans, True

    def _experts(self, received: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """The local experts' FFNs of the rows this rank received, gathered over y first where y
        splits the experts (E17), in gathered order (E18; sorted by expert for the grouped GEMMs
        and back where the rank holds several): each y rank's partial sum over its f/G_y features
        (the whole sum where y does not split them)."""
        grid, ex = self.grid, self.experts
        every = received
        if self.peers.y_members is not None:
            every = gather_rows(received, plan.y_rows, "y", grid, summed=True)  # E17: (n_all, features)
        sizes = plan.group_rows
        dtype = compute_dtype(grid.precision, ex.up)  # mixed precision: the experts' GEMMs in bf16 (or FP8)
        perm = None
        if ex.local == 1:  # one expert: the gathered rows are its one group as they come, nothing sorted
            xs = every.to(dtype).contiguous()  # a copy only of a column slice (the rows' gates cut off) or to bf16
        else:
            run_experts, run_rows = plan.runs()
            ids = to_device_queued(
                torch.repeat_interleave(
                    torch.tensor(run_experts, dtype=torch.long), torch.tensor(run_rows, dtype=torch.long)
                ),
                every.device,
            )  # (n_all,) local expert of each gathered row, made on the host (no device sync)
            perm = torch.argsort(ids, stable=True)
            xs = every.index_select(0, perm).to(dtype)  # (n_all, features) sorted by expert
        del every  # the gathered rows in gathered order: the GEMM keeps the sorted copy (memory)
        scale = 1.0 if self.dp_axis is not None else 1.0 / grid.size("batch")  # the replicas' reduction divides
        h = ex.gemm(xs, ex.up, sizes, scale)  # (n_all, f_up/G_ty), partial over x if split
        if ex.g_x > 1:
            h = sum_partials(h, "x", grid, in_place=True)  # the GEMM's partial output: nothing else reads it
        if ex.gated:
            gate, up = h.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.gelu(h)
        o = ex.gemm(a, ex.down, sizes, scale)  # (n_all, hidden/G_tx), partial over y if split
        # back in gathered order, summed over y by the caller's reduce-scatter
        return o if perm is None else o.index_select(0, torch.argsort(perm))

    def _aux(
        self, logits: torch.Tensor, s: torch.Tensor, tokens: int, chosen: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        """This rank's weighted balance loss, z-loss (E19, E20) and sequence-wise balance loss (over
        its whole sequences of ``seq_len`` tokens): averaged over batch they are the one-process
        losses, as the cross-entropy is."""
        cfg = self.cfg
        counts = to_device_queued(torch.tensor(self.tokens_per_expert, dtype=torch.long), s.device)
        assignments = int(sum(self.tokens_per_expert or ()))
        balance = moe_router.balance_loss(s, counts, assignments, tokens, cfg.router_scoring)
        self.balance = balance.detach()
        aux = cfg.moe_aux_coef * balance if cfg.moe_aux_coef else logits.new_zeros(())
        if cfg.moe_z_coef:
            aux = aux + cfg.moe_z_coef * moe_router.z_loss(logits)
        if cfg.moe_seq_aux_coef:
            seq = moe_router.sequence_balance_loss(s, chosen, seq_len, cfg.router_scoring)
            aux = aux + cfg.moe_seq_aux_coef * seq
        return aux

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """This rank's part of ``DenseMoE``'s router and experts initialised from ``seed``, drawn tile
        by tile (``moe_dense.expert_matrices``, ``axon4d.layout.tiled_init``): only the tiles its columns of
        the router and its experts' blocks overlap, one tile of scratch, on any grid and expert
        layout the same values as the dense layer's."""
        grid, ex = self.grid, self.experts
        h_x = ex.hidden // grid.size("x")
        shape = (ex.n_experts, ex.hidden)
        tiled_init.fill_(self.router.weight.data, uniform_for(ex.hidden), seed, ROUTER, shape, 0, grid.coord("x") * h_x)
        ex.reset_(seed)

    # -- dense conversion -------------------------------------------------------------------------
    @torch.no_grad()
    def load_dense_(self, dense: DenseMoE, shared: bool = True) -> MoE:
        """Take this rank's part of ``dense``'s router, experts (and shared experts)."""
        grid, ex = self.grid, self.experts
        h_x = ex.hidden // grid.size("x")
        self.router.weight.copy_(dense.router.weight[:, grid.coord("x") * h_x : (grid.coord("x") + 1) * h_x])
        ex.load_dense_(dense.experts)
        if self.expert_bias is not None and dense.expert_bias is not None:
            self.expert_bias.copy_(dense.expert_bias)
        if shared and self.shared is not None:
            assert dense.shared is not None
            self.shared.load_dense_(dense.shared)
        return self

    def to_dense(self, grads: bool = False) -> DenseMoE:
        """The single-process layer (and its gradients: zero where this layer has none) on every
        rank, gathered over x, y and the expert-parallel axes."""
        p = self.router.weight
        dense = DenseMoE(self.cfg, device=p.device, dtype=p.dtype)
        dense.fp8_dispatch = self.layout.fp8_dispatches(self.grid.shape)
        with torch.no_grad():
            self._into(dense, lambda t: t)
            if grads:
                self._into(dense, lambda t: t.grad if t.grad is not None else torch.zeros_like(t), grads=True)
        if self.shared is not None:
            dense.shared = self.shared.to_dense(grads)
        if self.expert_bias is not None and dense.expert_bias is not None:
            dense.expert_bias.copy_(self.expert_bias)
        return dense

    def _into(self, dense: DenseMoE, pick: Any, grads: bool = False) -> None:
        """Gather this layer's tensors (``pick(param)``: the values or the gradients) into ``dense``."""
        grid, ex = self.grid, self.experts
        comm = grid.comm
        router = comm.all_gather(pick(self.router.weight).detach().contiguous(), "x", dim=1, tag=Term.DENSE).wait()

        whole = ex.gathered(pick, grid)  # {"up", "down", and "gate" when gated}: the stacks, whole
        named = [(dense.router.weight, router)]
        named += [(getattr(dense.experts, name), value) for name, value in whole.items()]
        for target, value in named:
            if grads:
                target.grad = value.clone()
            else:
                target.copy_(value)


def aux_loss(module: nn.Module) -> torch.Tensor | None:
    """The sum of the last forward's auxiliary losses of every MoE layer in ``module`` (None if none)."""
    losses = [m.aux_loss for m in module.modules() if isinstance(m, (MoE, DenseMoE)) and m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
