"""The optimizer sharded over the data axis: ZeRO-1 and ZeRO-2 (docs/design.md §4, "ZeRO").

x, y and z already split the weights; the data axis replicates them, and with them the optimizer's
state. ``shard_optimizer`` wraps an elementwise ``torch.optim`` optimizer so that each data rank
keeps the state of one part of every parameter only:

- each parameter's local tensor, flattened (n elements), is split into G_data contiguous parts of
  c = ⌈n / G_data⌉ elements (the last ones shorter, or empty); data rank d owns part d;
- the inner optimizer (the same class, param groups and hyperparameters, fused/foreach included)
  steps fp32 master copies of the owned parts, each with its own ``.grad``: a *view* of the
  parameter when it is fp32 (the library's parameters always are, ``axon4d.precision``), else an
  fp32 copy. Its state (Adam's moments) is 1/G_data of the unsharded optimizer's;
- ``step`` then all-gathers the updated parts over data back into the parameters, bucket by bucket
  (the grid's ``bucket_mb``; 0: one parameter per bucket), each gather in flight while the next
  bucket steps; the last is waited at the end of ``step``, so the parameters are whole when it
  returns;
- stage 1 takes each owned part of ``.grad``, reduced over data as without sharding (E12, E13 and
  the replicated gradients are all-reduces); stage 2 also turns the weight shards' E12 all-reduce
  into a reduce-scatter over data (``Scheduler.scatter_over_data``): a rank receives only the sum
  of its parts, which go straight to the masters' ``.grad`` — the layers' weights never hold a
  ``.grad``. Biases, norm weights and embedding tables (E13 and the replicated gradients, all-reduced
  over batch) are reduced and held whole as in stage 1.

Only elementwise optimizers can be split this way — each element's update reads only that
element's gradient and state: SGD, Adam, AdamW, Adamax, NAdam, RAdam, Adagrad, Adadelta, RMSprop,
Rprop, ASGD, and a user's own such as Lion (pass ``elementwise=True``). LBFGS, Adafactor (factored
second moments), Muon (orthogonalised updates) and SparseAdam are refused.

``axon4d.grads`` (the global norm, clipping, the non-finite check) sees ZeRO-2's gradient parts,
each element counted once, and ``axon4d.checkpoint`` saves each rank's parts of the moments as
their own pieces of the global tensors, so a checkpoint loads onto another data size, or without
sharding, and back. With G_data = 1 the wrapper is a no-op in effect (one part: the whole tensor).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import weakref
from typing import Any

import torch
from torch import nn

from axon4d.comm import Handle
from axon4d.grid import Grid

#: torch.optim classes whose update is elementwise (shardable); a subclass counts as its base
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
#: torch.optim classes whose update mixes elements of a tensor (or needs all of it): refused
NOT_ELEMENTWISE = tuple(
    cls for name in ("LBFGS", "Adafactor", "Muon", "SparseAdam") if (cls := getattr(torch.optim, name, None))
)
#: ZeRO stages ``shard_optimizer`` takes (0, no sharding, is the training job's ``--zero 0``)
STAGES = (1, 2)
#: the log's tag of the parameters' all-gather over data (docs/design.md §4)
GATHER_TAG = "zero.params"


@dataclasses.dataclass
class _Part:
    """This data rank's part of one parameter."""

    param: torch.Tensor
    name: str
    chunk: int  # c = ⌈n / G_data⌉: elements per data rank's part
    start: int  # the owned elements [start, stop) of the flattened parameter
    stop: int
    master: torch.Tensor  # (stop - start,) fp32: a view of the parameter, or a copy
    scattered: bool = False  # ZeRO-2 delivers its gradient part (take_grad), never .grad


class _GradSink:
    """The ``DataSharding`` a ZeRO-2 optimizer gives its grid's scheduler; holds it weakly."""

    def __init__(self, optimizer: ShardedOptimizer):
        self._ref = weakref.ref(optimizer)

    @property
    def optimizer(self) -> ShardedOptimizer | None:
        return self._ref()

    def part_numel(self, param: torch.Tensor) -> int | None:
        opt = self._ref()
        part = opt._parts.get(id(param)) if opt is not None else None
        return part.chunk if part is not None else None

    def take_grad(self, param: torch.Tensor, part: torch.Tensor) -> None:
        opt = self._ref()
        if opt is not None:
            opt._take_grad(param, part)


def shard_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    grid: Grid,
    stage: int = 1,
    *,
    elementwise: bool | None = None,
) -> ShardedOptimizer:
    """Shard ``optimizer``'s master weights and state over ``grid``'s data axis (ZeRO ``stage`` 1
    or 2; see the module docstring) and return the optimizer to use in its place.

    ``optimizer`` must be a fresh (never stepped) elementwise optimizer over parameters of
    ``model`` (any subset; the others are left alone): its class is built again over this rank's
    parts with the same param groups and defaults. ``elementwise=True`` vouches for a class not in
    ``ELEMENTWISE`` (e.g. a Lion); ``False`` refuses any."""
    return ShardedOptimizer(optimizer, model, grid, stage, elementwise=elementwise)


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
    ):
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(
                f"ZeRO stage {stage!r}: give 1 (optimizer state and master weights sharded over data) or 2 (also "
                "the gradients, reduce-scattered over data); stage 0 is the unsharded optimizer itself"
            )
        _check_elementwise(optimizer, elementwise)
        _check_fresh(optimizer)
        self.grid, self.stage = grid, stage
        self.data_size, self.data_rank = grid.size("data"), grid.coord("data")
        names = {id(p): n for n, p in model.named_parameters()}
        self._parts: dict[int, _Part] = {}
        groups = []
        for group in optimizer.param_groups:
            masters = [self._part(p, names).master for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        if "defaults" in accepted and "defaults" not in kwargs:  # a class that keeps Optimizer's own signature
            kwargs["defaults"] = dict(optimizer.defaults)
        #: the optimizer that steps this rank's parts
        self.inner = cls(groups, **kwargs)
        self.inner.defaults = dict(optimizer.defaults)
        super().__init__([p.master for p in self._parts.values()], dict(optimizer.defaults))
        self.param_groups = self.inner.param_groups  # one list: set_lr and schedulers reach the inner's
        self.state = self.inner.state
        self._buckets = self._make_buckets(grid.scheduler.policy.bucket_mb)
        self._sink: _GradSink | None = None
        if stage == 2:
            self._sink = _GradSink(self)
            current = grid.scheduler.data_sharding
            if isinstance(current, _GradSink) and current.optimizer is not None:
                raise ValueError(
                    "a ZeRO-2 optimizer already reduce-scatters this grid's gradients; call its release() "
                    "first (one ZeRO-2 optimizer per grid)"
                )
            grid.scheduler.scatter_over_data(self._sink)

    # -- layout ---------------------------------------------------------------------------------
    def _part(self, p: torch.Tensor, names: dict[int, str]) -> _Part:
        """Make this rank's part of ``p`` (data rank d owns elements [d·c, (d+1)·c) ∩ [0, n))."""
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
        chunk = max(1, math.ceil(n / self.data_size))
        start = min(n, self.data_rank * chunk)
        stop = min(n, start + chunk)
        flat = p.detach().view(-1)  # (n,)
        if p.dtype == torch.float32:
            master = flat[start:stop]  # a view: the step updates the parameter's own part in place
        else:
            master = flat[start:stop].to(torch.float32, copy=True)
        part = self._parts[id(p)] = _Part(p, names[id(p)], chunk, start, stop, master)
        return part

    def _make_buckets(self, bucket_mb: float) -> list[list[_Part]]:
        """The all-gather buckets: parameters in order, a bucket closed once it holds ``bucket_mb``
        of parameter bytes (0: one parameter each) or the dtype or device changes."""
        buckets: list[list[_Part]] = []
        size = 0.0
        for part in self._parts.values():
            p = part.param
            last = buckets[-1][-1].param if buckets else None
            if last is None or size >= bucket_mb * 2**20 or (last.dtype, last.device) != (p.dtype, p.device):
                buckets.append([])
                size = 0.0
            buckets[-1].append(part)
            size += p.numel() * p.element_size()
        return buckets

    def owned(self, param: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """(start, master) of this rank's part of ``param`` — its elements [start, start + master.numel())
        of the flattened parameter — or None if this optimizer does not hold ``param``."""
        part = self._parts.get(id(param))
        return None if part is None else (part.start, part.master)

    def scattered_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, this rank's gradient part) of every parameter whose gradient ZeRO-2 delivers
        in parts (its ``.grad`` stays None): what ``axon4d.grads`` counts besides ``.grad``."""
        return [(p.param, p.master.grad) for p in self._parts.values() if p.scattered and p.master.grad is not None]

    # -- gradients ------------------------------------------------------------------------------
    def _take_grad(self, param: torch.Tensor, part: torch.Tensor) -> None:
        """ZeRO-2: this rank's reduced part (c,) of ``param``'s gradient; added to the master's."""
        owner = self._parts[id(param)]
        owner.scattered = True
        grad = part[: owner.stop - owner.start].to(owner.master.dtype)
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
        data into the parameters while the next bucket steps; returns once every parameter is whole."""
        if closure is not None:
            raise ValueError("a sharded optimizer takes no closure: compute the loss and backward before step()")
        for part in self._parts.values():  # stage 1 (and stage 2's biases, norms, embeddings): .grad's part
            grad = part.param.grad
            if grad is not None:
                part.master.grad = grad.detach().reshape(-1)[part.start : part.stop].to(part.master.dtype)
        groups = self.inner.param_groups
        everything = [g["params"] for g in groups]
        in_flight: tuple[list[_Part], Handle] | None = None
        try:
            for bucket in self._buckets:
                mine = {id(part.master) for part in bucket}
                for group, params in zip(groups, everything):
                    group["params"] = [m for m in params if id(m) in mine]
                self.inner.step()
                handle = self._gather(bucket)
                if in_flight is not None:
                    self._unpack(*in_flight)
                in_flight = (bucket, handle)
        finally:
            for group, params in zip(groups, everything):
                group["params"] = params
        if in_flight is not None:
            self._unpack(*in_flight)

    def _gather(self, bucket: list[_Part]) -> Handle:
        """Issue the all-gather over data of this rank's updated parts of ``bucket``: a flat (S,)
        of each part padded to its c, S = Σ c; the result (G_data·S,) is row d = data rank d's."""
        first = bucket[0].param
        send = torch.empty(sum(p.chunk for p in bucket), dtype=first.dtype, device=first.device)  # (S,)
        offset = 0
        for part in bucket:
            owned = part.stop - part.start
            send[offset : offset + owned].copy_(part.master)
            send[offset + owned : offset + part.chunk].zero_()
            offset += part.chunk
        return self.grid.comm.all_gather(send, "data", tag=GATHER_TAG)

    def _unpack(self, bucket: list[_Part], handle: Handle) -> None:
        """Wait for a bucket's all-gather and copy every rank's parts into the parameters."""
        rows = handle.wait().view(self.data_size, -1)  # (G_data, S)
        offset = 0
        for part in bucket:
            flat = part.param.detach().view(-1)  # (n,)
            n, c = flat.numel(), part.chunk
            full = n // c  # data ranks whose part is whole
            flat[: full * c].view(full, c).copy_(rows[:full, offset : offset + c])
            if n > full * c:
                flat[full * c :].copy_(rows[full, offset : offset + n - full * c])
            offset += c

    def release(self) -> None:
        """Stop reduce-scattering the grid's gradients for this optimizer (ZeRO-2): from the next
        backward they are all-reduced into ``.grad`` again."""
        if self._sink is not None and self.grid.scheduler.data_sharding is self._sink:
            self.grid.scheduler.scatter_over_data(None)
        self._sink = None


def sharded_grads(model: nn.Module, grid: Grid) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter of ``model``, this rank's gradient part) for every gradient ZeRO-2 holds in parts
    on ``grid`` (none without a ZeRO-2 optimizer): each element is on one data rank only."""
    scheduler = getattr(grid, "scheduler", None)  # a stand-in grid (tests, one process) may have none
    sink = scheduler.data_sharding if scheduler is not None else None
    opt = sink.optimizer if isinstance(sink, _GradSink) else None
    if opt is None:
        return []
    ours = {id(p) for p in model.parameters()}
    return [(p, g) for p, g in opt.scattered_grads() if id(p) in ours]


def _check_elementwise(optimizer: torch.optim.Optimizer, elementwise: bool | None) -> None:
    """Refuse an optimizer whose update is not known to be elementwise."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"shard_optimizer takes a torch.optim.Optimizer, not {name}")
    if isinstance(optimizer, ShardedOptimizer):
        raise ValueError("the optimizer is already sharded over data")
    known = ", ".join(c.__name__ for c in ELEMENTWISE)
    if isinstance(optimizer, NOT_ELEMENTWISE) or elementwise is False:
        raise ValueError(
            f"{name} cannot be sharded over data: its update is not elementwise (it reads other elements of a "
            f"tensor, or all of it); shard an elementwise optimizer ({known}) or use --zero 0"
        )
    if elementwise is None and not isinstance(optimizer, ELEMENTWISE):
        raise ValueError(
            f"{name} is not known to be elementwise (known: {known}); if each element's update reads only that "
            "element's gradient and state (as Lion's does), pass elementwise=True"
        )


def _check_fresh(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that has stepped: its state would be lost in the rebuild."""
    for state in optimizer.state.values():
        step = state.get("step", 0)
        if float(step) != 0 or ("step" not in state and state):
            raise ValueError(
                f"{type(optimizer).__name__} has already stepped; shard a fresh optimizer and restore its state "
                "with axon4d.checkpoint.load, which takes a checkpoint of any data size"
            )
