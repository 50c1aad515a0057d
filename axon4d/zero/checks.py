"""Which optimizers ZeRO can shard over data: elementwise ones, never stepped (docs/design.md §4, "ZeRO").

Only elementwise optimizers can be split by parts of a flat tensor — each element's update reads
only that element's gradient and state: SGD, Adam, AdamW, Adamax, NAdam, RAdam, Adagrad, Adadelta,
RMSprop, Rprop, ASGD, and a user's own such as Lion (``elementwise=True``). LBFGS, Adafactor
(factored second moments), Muon (orthogonalised updates) and SparseAdam are refused.
"""

from __future__ import annotations

import torch

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


def check_elementwise(optimizer: torch.optim.Optimizer, elementwise: bool | None, already_sharded: bool) -> None:
    """Refuse an optimizer whose update is not known to be elementwise (or is sharded already)."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"shard_optimizer takes a torch.optim.Optimizer, not {name}")
    if already_sharded:
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


def check_fresh(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that has stepped: its state would be lost in the rebuild."""
    for state in optimizer.state.values():
        step = state.get("step", 0)
        if float(step) != 0 or ("step" not in state and state):
            raise ValueError(
                f"{type(optimizer).__name__} has already stepped; shard a fresh optimizer and restore its state "
                "with axon4d.checkpoint.load, which takes a checkpoint of any data size"
            )
