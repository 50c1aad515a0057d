"""The general path of ``auto_parallelize``: any ``nn.Linear`` or ``Conv1D`` of any model that no
family style took becomes a ``ShardedLinear`` that slices its full input features locally and
all-gathers its output features (docs/design.md §2; docs/parallelize.md), so the code around it
sees full tensors. Exact for any model, because everything outside the layer runs replicated over
x and y. Layers it cannot split are left as they are, with the reason.
"""

from __future__ import annotations

from torch import nn

from axon4d.grid.mesh import Grid
from axon4d.parallelize.layers import is_linear, linear_problem, owned_by_axon4d
from axon4d.parallelize.styles import LinearStyle, within


def general_linears(
    model: nn.Module, grid: Grid, users: dict[int, list[str]], taken: set[str]
) -> tuple[dict[str, LinearStyle], dict[str, str]]:
    """({name: LinearStyle()} of every linear layer the general path replaces, {name: why} of the layers
    it leaves as they are), for the modules of ``model`` not in ``taken`` (those a block style handles).

    ``users`` maps id(parameter) to the names of every module holding it (tied weights).
    """
    linears: dict[str, LinearStyle] = {}
    skipped: dict[str, str] = {}
    whole: list[str] = sorted(taken)  # prefixes whose linear layers are left alone (a replaced module's too)
    for name, m in model.named_modules():
        if owned_by_axon4d(m) or within(name, whole):
            continue
        if is_linear(m):
            problem = linear_problem(name, m, False, grid, users)
            if problem:
                skipped[name] = f"{type(m).__name__}: {problem}"
            else:
                linears[name] = LinearStyle()
        elif isinstance(m, nn.Embedding):
            skipped[name] = "Embedding: kept whole on every rank"
        elif isinstance(m, nn.MultiheadAttention):
            skipped[name] = "MultiheadAttention: uses its projection weights directly"
            whole.append(name)
    return linears, skipped
