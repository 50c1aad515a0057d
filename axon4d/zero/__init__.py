"""The optimizer sharded over the data axis: ZeRO-1 and ZeRO-2 (docs/design.md §4, "ZeRO").

x, y and z already split the weights; the data axis replicates them, and with them the optimizer's
state and the fp32 master weights. ``shard_optimizer`` wraps an elementwise ``torch.optim``
optimizer so that each data rank keeps the masters and the state of one part of every parameter:

- each parameter's local tensor, flattened (n elements), is split into G_data contiguous parts of
  c = ⌈n / G_data⌉ elements (the last ones shorter, or empty); data rank d owns part d;
- the inner optimizer (the same class, param groups and hyperparameters, fused/foreach included)
  steps fp32 master copies of the owned parts, each with its own ``.grad``. Its state (Adam's
  moments) is 1/G_data of the unsharded optimizer's;
- **the masters.** Training in 16 bits with G_data > 1, the 3D Linear layers' weight shards are
  stored in the compute dtype (bf16) and each data rank keeps the fp32 master of its part only:
  2 + 4/G_data bytes per element, not 4 (``sixteen_bit``); the GEMMs and gathers see the same bf16
  values as unsharded. Every other parameter, and every one in fp32 training, stays fp32 and its
  master part is a *view* of it;
- ``step`` then all-gathers the updated parts over data back into the parameters, bucket by bucket,
  in the parameters' dtype (``axon4d.zero.gathers``): each gather in flight while the next bucket
  steps, the parameters whole when it returns — or, with ``overlap_gathers`` (the training job's),
  left in flight into the next forward, each bucket completed just before its first use;
- the gradients. Stage 1 takes each owned part of ``.grad``, reduced over data as without
  sharding; a 16-bit weight's reduced gradient never becomes a bf16 ``.grad``: the scheduler hands
  it whole to this optimizer (``Scheduler.shard_over_data``). Stage 2 also turns E12 into a
  reduce-scatter over data: a rank receives only the sum of its parts, straight into the masters'
  ``.grad`` — and so the gradients of MoE expert replicas whose layout puts them on data alone.
  Biases, norm weights and embedding tables are reduced and held whole as in stage 1.

A parameter the data axis does not replicate — an MoE expert weight whose expert layout puts data
among the expert-parallel axes (docs/moe.md, the default) — is each data rank's alone: its part is
all of it, stepped by the rank that holds it and never gathered. An expert weight the layout
replicates over data is sharded like any replicated parameter.

Only elementwise optimizers can be split this way (``axon4d.zero.checks``): SGD, Adam, AdamW and
the like, and a user's own such as Lion (pass ``elementwise=True``); LBFGS, Adafactor, Muon and
SparseAdam are refused. A fused optimizer skips a step on the device when given a non-finite flag
(``found_inf``, as torch's ``GradScaler`` sets it): the flag is passed to the inner optimizer.

``axon4d.grads`` (the global norm, clipping, the non-finite check) sees the gradient parts, each
element counted once, and ``axon4d.checkpoint`` saves each rank's parts of the moments — and of the
fp32 masters of 16-bit weights, which are the model's saved values — as their own pieces of the
global tensors, so a checkpoint loads onto another data size, or without sharding, and back. With
G_data = 1 the wrapper is a no-op in effect (one part: the whole tensor; nothing is stored in 16 bits).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.layout.geometry import data_part_numel, zero_stored_dtype
from axon4d.nn.linear import Linear
from axon4d.nn.moe_experts import expert_parameters
from axon4d.zero.checks import ELEMENTWISE, NOT_ELEMENTWISE, check_elementwise, check_fresh
from axon4d.zero.gathers import GATHER_TAG, ParamGathers, Part

__all__ = [
    "ELEMENTWISE",
    "GATHER_TAG",
    "NOT_ELEMENTWISE",
    "STAGES",
    "ShardedOptimizer",
    "masters_holder",
    "settle",
    "shard_optimizer",
    "sharded_grads",
    "sixteen_bit",
]

#: ZeRO stages ``shard_optimizer`` takes (0, no sharding, is the training job's ``--zero 0``)
STAGES = (1, 2)


class _GradSink:
    """The ``DataSharding`` a sharded optimizer gives its grid's scheduler; holds it weakly. ZeRO-2
    takes the parts of every parameter's E12 reduce-scatter; ZeRO-1 the whole all-reduced gradients
    of its 16-bit weights only."""

    def __init__(self, optimizer: ShardedOptimizer):
        self._ref = weakref.ref(optimizer)
        self.scatters = optimizer.stage == 2

    @property
    def optimizer(self) -> ShardedOptimizer | None:
        return self._ref()

    def part_numel(self, param: torch.Tensor) -> int | None:
        opt = self._ref()
        part = opt._parts.get(id(param)) if opt is not None else None
        if part is None or not (self.scatters or part.sixteen):
            return None
        return part.chunk

    def take_grad(self, param: torch.Tensor, part: torch.Tensor) -> None:
        opt = self._ref()
        if opt is not None:
            opt._take_grad(param, part)

    def stores_sixteen(self, param: torch.Tensor) -> bool:
        opt = self._ref()
        part = opt._parts.get(id(param)) if opt is not None else None
        return part is not None and part.sixteen

    def take_whole_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        opt = self._ref()
        if opt is not None:
            owner = opt._parts[id(param)]
            opt._take_grad(param, grad[owner.start : owner.stop], copy=True)  # not a view: the rest is freed


def shard_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    grid: Grid,
    stage: int = 1,
    *,
    elementwise: bool | None = None,
    overlap_gathers: bool = False,
) -> ShardedOptimizer:
    """Shard ``optimizer``'s master weights and state over ``grid``'s data axis (ZeRO ``stage`` 1
    or 2; see the module docstring) and return the optimizer to use in its place.

    ``optimizer`` must be a fresh (never stepped) elementwise optimizer over parameters of
    ``model`` (any subset; the others are left alone): its class is built again over this rank's
    parts with the same param groups and defaults. ``elementwise=True`` vouches for a class not in
    ``ELEMENTWISE`` (e.g. a Lion); ``False`` refuses any. ``overlap_gathers``: ``step`` leaves its
    all-gathers over data in flight into the next forward (``axon4d.zero.gathers``; read a
    parameter outside a forward only after ``settle()``).

    Training in mixed precision with G_data > 1 this changes ``model``: its 3D Linear weights
    (``sixteen_bit``) become the compute dtype, their fp32 masters this optimizer's parts. Save and
    load them with ``axon4d.checkpoint`` (which saves the masters), not the model's ``state_dict``."""
    return ShardedOptimizer(optimizer, model, grid, stage, elementwise=elementwise, overlap_gathers=overlap_gathers)


class ShardedOptimizer(torch.optim.Optimizer):
    """An elementwise optimizer whose state is sharded over data (``shard_optimizer``).

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, over the master parts
    (so a learning-rate schedule that sets ``group["lr"]`` works unchanged); ``state_dict`` is this
    rank's own — ``axon4d.checkpoint`` saves and loads the grid-independent form."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        grid: Grid,
        stage: int = 1,
        *,
        elementwise: bool | None = None,
        overlap_gathers: bool = False,
    ):
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(
                f"ZeRO stage {stage!r}: give 1 (optimizer state and master weights sharded over data) or 2 (also "
                "the gradients, reduce-scattered over data); stage 0 is the unsharded optimizer itself"
            )
        check_elementwise(optimizer, elementwise, isinstance(optimizer, ShardedOptimizer))
        check_fresh(optimizer)
        self.grid, self.stage = grid, stage
        self.data_size, self.data_rank = grid.size("data"), grid.coord("data")
        names = {id(p): n for n, p in model.named_parameters()}
        #: parameters one data rank holds alone (MoE expert weights whose layout holds no replicas over
        #: data, axon4d.grid.expert_layout): whole parts
        self._whole = {id(p) for p in expert_parameters(model, replicated_over_data=False)}
        #: the dtype the 3D Linear weights are stored in (``sixteen_bit``), or None: all stay as they are
        stored = zero_stored_dtype(grid.precision, torch.float32, linear_weight=True, g_data=self.data_size)
        self.weight_dtype = stored if stored != torch.float32 else None
        sixteen = sixteen_bit(model) if self.weight_dtype is not None else set()
        self._parts: dict[int, Part] = {}
        groups = []
        for group in optimizer.param_groups:
            masters = [self._part(p, names, id(p) in sixteen).master for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        takes = stage == 2 or any(part.sixteen for part in self._parts.values())  # gradients come to us
        for part in self._parts.values() if takes else ():
            if grid.scheduler.sharding_of(part.param) is not None:
                raise ValueError(
                    f"another sharded optimizer already takes the gradient of {part.name}; call its release() "
                    "first (one sharded optimizer per parameter)"
                )
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        if "defaults" in accepted and "defaults" not in kwargs:  # a class that keeps Optimizer's own signature
            kwargs["defaults"] = dict(optimizer.defaults)
        #: the optimizer that steps this rank's parts
        self.inner = cls(groups, **kwargs)
        self.inner.defaults = dict(optimizer.defaults)
        for part in self._parts.values():  # the masters are copied and stepped: store the weights in 16 bits
            if part.sixteen:
                part.param.grad = None
                part.param.data = part.param.data.to(self.weight_dtype)
        super().__init__([p.master for p in self._parts.values()], dict(optimizer.defaults))
        self.param_groups = self.inner.param_groups  # one list: set_lr and schedulers reach the inner's
        self.state = self.inner.state
        limit = grid.scheduler.policy.bucket_bytes(grid.scheduler.accelerator)
        self._gathers = ParamGathers(list(self._parts.values()), grid.comm, self.data_size, limit, grid.scheduler)
        #: ``step`` leaves its gathers over data in flight into the next forward (``axon4d.zero.gathers``)
        self.overlap_gathers = overlap_gathers
        if overlap_gathers:
            self._gathers.hook(model)
        #: a 0-dim fp32 flag on the device, 1 for a non-finite step (``found_inf``): a fused inner
        #: optimizer skips the step on the device; None: every step is taken
        self.found_inf: torch.Tensor | None = None
        self._sink: _GradSink | None = None
        if takes:
            self._sink = _GradSink(self)
            grid.scheduler.shard_over_data(self._sink)
            # an optimizer dropped without release(): its sink leaves the scheduler with it
            weakref.finalize(self, grid.scheduler.forget_sharding, self._sink)

    # -- layout ---------------------------------------------------------------------------------
    def _part(self, p: torch.Tensor, names: dict[int, str], sixteen: bool) -> Part:
        """Make this rank's part of ``p`` (data rank d owns elements [d·c, (d+1)·c) ∩ [0, n)); its
        master is a copy where ``p`` is not fp32 or will be stored in 16 bits (``sixteen``)."""
        if id(p) not in names:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the model's: "
                "shard an optimizer built over model.parameters() (or a subset of them)"
            )
        if id(p) in self._parts:
            raise ValueError(f"parameter {names[id(p)]} appears twice in the optimizer's param groups")
        if not p.is_contiguous():
            raise ValueError(f"parameter {names[id(p)]} is not contiguous; its flat parts must be views of it")
        n = p.numel()
        whole = id(p) in self._whole  # not replicated over data: this rank's alone, all of it
        chunk = n if whole else data_part_numel(n, self.data_size)
        start = 0 if whole else min(n, self.data_rank * chunk)
        stop = min(n, start + chunk)
        flat = p.detach().view(-1)  # (n,)
        if p.dtype == torch.float32 and not sixteen:
            master = flat[start:stop]  # a view: the step updates the parameter's own part in place
        else:
            master = flat[start:stop].to(torch.float32, copy=True)
        part = self._parts[id(p)] = Part(p, names[id(p)], chunk, start, stop, master, sixteen, whole=whole)
        return part

    def owned(self, param: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """(start, master) of this rank's part of ``param`` — its elements [start, start + master.numel())
        of the flattened parameter — or None if this optimizer does not hold ``param``."""
        part = self._parts.get(id(param))
        return None if part is None else (part.start, part.master)

    def master_copy(self, param: torch.Tensor) -> torch.Tensor | None:
        """This rank's fp32 master part of ``param`` (elements ``owned(param)[0]`` on) where it is a
        copy — ``param`` is stored in 16 bits or is not fp32 — so the master, not ``param``, holds
        its exact value (what a checkpoint saves); None where the master is a view of ``param``."""
        part = self._parts.get(id(param))
        return None if part is None or part.param.dtype == torch.float32 else part.master

    @torch.no_grad()
    def refresh_params(self) -> None:
        """Make every parameter its masters again: all-gather the parts over data (as ``step``
        ends), rounded to the parameter's dtype; after a load wrote the masters (``axon4d.checkpoint``).
        Buckets of fp32 parameters, whose masters are views of them, are whole already: skipped."""
        self._gathers.settle()
        self._copy_whole()
        for bucket in self._gathers.buckets:
            if bucket[0].param.dtype != torch.float32:  # a bucket holds one dtype (make_buckets)
                self._gathers.unpack(bucket, self._gathers.gather(bucket))

    def scattered_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, this rank's gradient part) of every parameter whose gradient ZeRO-2 delivers
        in parts (its ``.grad`` stays None): what ``axon4d.grads`` counts besides ``.grad``."""
        return [(p.param, p.master.grad) for p in self._parts.values() if p.scattered and p.master.grad is not None]

    # -- gradients ------------------------------------------------------------------------------
    def _take_grad(self, param: torch.Tensor, part: torch.Tensor, copy: bool = False) -> None:
        """This rank's reduced part (≥ its own elements) of ``param``'s gradient, in the reduction
        dtype; added to the master's ``.grad`` (fp32), a copy with ``copy``."""
        owner = self._parts[id(param)]
        owner.scattered = True
        grad = part[: owner.stop - owner.start].to(owner.master.dtype, copy=copy)
        if owner.master.grad is None:
            owner.master.grad = grad
        else:
            owner.master.grad.add_(grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients and the masters' (their parts)."""
        for part in self._parts.values():
            for t in (part.param, part.master):
                if t.grad is None:
                    continue
                if set_to_none:
                    t.grad = None
                else:
                    t.grad.detach_().zero_()

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Step this rank's parts, bucket by bucket, and all-gather each bucket's updated parts over
        data into the parameters while the next bucket steps; returns once every parameter is whole
        — unless ``overlap_gathers``: then the gathers are completed in the next forward
        (``axon4d.zero.gathers``). With ``found_inf`` set a fused inner optimizer skips on the device."""
        if closure is not None:
            raise ValueError("a sharded optimizer takes no closure: compute the loss and backward before step()")
        if self.found_inf is not None and not self.inner.defaults.get("fused"):
            raise ValueError(
                f"found_inf is set but the inner {type(self.inner).__name__} is not fused: only torch's fused "
                "kernels skip a step on the device; build the optimizer with fused=True, or decide on the host"
            )
        for part in self._parts.values():  # stage 1 (and stage 2's biases, norms, embeddings): .grad's part
            grad = part.param.grad
            if grad is not None:
                part.master.grad = grad.detach().reshape(-1)[part.start : part.stop].to(part.master.dtype)
        groups = self.inner.param_groups
        everything = [g["params"] for g in groups]
        self.inner.found_inf = self.found_inf  # type: ignore[attr-defined]  # read by torch's fused kernels

        def step_bucket(bucket: list[Part]) -> None:
            mine = {id(part.master) for part in bucket}
            for group, params in zip(groups, everything):
                group["params"] = [m for m in params if id(m) in mine]
            self.inner.step()

        scheduler = self.grid.scheduler  # its policy's bucket size now (``configure`` may have changed it)
        self._gathers.rebucket(scheduler.policy.bucket_bytes(scheduler.accelerator))
        try:
            self._gathers.run(step_bucket, defer=self.overlap_gathers)
            whole = {id(part.master) for part in self._parts.values() if part.whole}
            if whole:  # the parameters this rank holds alone: stepped whole, nothing to gather
                for group, params in zip(groups, everything):
                    group["params"] = [m for m in params if id(m) in whole]
                self.inner.step()
                self._copy_whole()
        finally:
            for group, params in zip(groups, everything):
                group["params"] = params
            self.inner.found_inf = None  # type: ignore[attr-defined]

    @torch.no_grad()
    def _copy_whole(self) -> None:
        """Round the masters of the parameters held whole into them where the master is a copy."""
        for part in self._parts.values():
            if part.whole and part.master.data_ptr() != part.param.data_ptr():
                part.param.detach().view(-1).copy_(part.master)

    def settle(self) -> None:
        """Complete the all-gathers over data a deferred step left in flight (``overlap_gathers``):
        every parameter is whole. A no-op when none is in flight."""
        self._gathers.settle()

    @property
    def gathers_in_flight(self) -> int:
        """How many buckets' all-gathers over data the last step left in flight (``overlap_gathers``)."""
        return self._gathers.deferred

    def release(self) -> None:
        """Stop taking the grid's gradients for this optimizer (ZeRO-2, or ZeRO-1 in 16 bits): from
        the next backward they are all-reduced into ``.grad`` again. Deferred gathers are completed
        and the forward pre-hooks removed."""
        self._gathers.unhook()
        if self._sink is not None:
            self.grid.scheduler.shard_over_data(self._sink, on=False)
        self._sink = None


def sixteen_bit(model: nn.Module) -> set[int]:
    """ids of the parameters a sharded optimizer stores in 16 bits when training in mixed precision
    with G_data > 1: the weight shards of ``model``'s 3D Linear layers (``axon4d.Linear``) — whose
    gradients the scheduler reduces over data as E12 — and the expert weights of MoE layers whose
    layout replicates them over data (their gradients summed over the replicas' axis, data among
    them: ``axon4d.nn.moe``), held by no other kind of module."""
    sixteen: set[int] = {id(p) for p in expert_parameters(model, replicated_over_data=True)}
    other: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if isinstance(module, Linear) and name == "weight":
                sixteen.add(id(p))
            elif id(p) not in sixteen:
                other.add(id(p))
    return sixteen - other


def _optimizers(grid: Grid) -> list[ShardedOptimizer]:
    """The live sharded optimizers whose sinks ``grid``'s scheduler holds (a stand-in grid — tests,
    one process — may have no scheduler: none)."""
    scheduler = getattr(grid, "scheduler", None)
    sinks = scheduler.data_shardings if scheduler is not None else ()
    return [opt for sink in sinks if isinstance(sink, _GradSink) and (opt := sink.optimizer) is not None]


def masters_holder(model: nn.Module, grid: Grid) -> ShardedOptimizer | None:
    """The sharded optimizer on ``grid`` whose fp32 masters hold the exact values of parameters of
    ``model`` it stores in 16 bits (``sixteen_bit``), or None: a load must write those masters."""
    ours = {id(p) for p in model.parameters()}
    for opt in _optimizers(grid):
        if any(part.sixteen and pid in ours for pid, part in opt._parts.items()):
            return opt
    return None


def sharded_grads(model: nn.Module, grid: Grid) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter of ``model``, this rank's gradient part) for every gradient a sharded optimizer
    holds in parts on ``grid`` (ZeRO-2's, ZeRO-1's 16-bit weights'; none without one): each element
    is on one data rank only."""
    ours = {id(p) for p in model.parameters()}
    return [(p, g) for opt in _optimizers(grid) for p, g in opt.scattered_grads() if id(p) in ours]


def settle(grid: Grid) -> None:
    """Complete every all-gather over data that a sharded optimizer on ``grid`` left in flight
    (``overlap_gathers``): before reading parameters outside a forward (checkpoints, exports)."""
    for opt in _optimizers(grid):
        opt.settle()
