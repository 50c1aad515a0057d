"""Where an MoE layer's experts run: a layout of their own over the grid's axes (docs/moe.md, "Placement
and expert layouts"), independent of the 4D grid that attention and the dense layers use.

An ``ExpertLayout`` splits the four axes (x, y, z, data) three ways:

- **expert-parallel** ``ep``: ranks that hold different experts, E/G_ep each; tokens cross it in
  the dispatch all-to-all (E16). Any product of axes, up to the whole world;
- **expert tensor-parallel** ``tp``: x, y, both or none (1: whole experts) — the axes that split
  each expert's matrices, hidden over x and the FFN width over y, as the dense MLP splits them;
- **expert data-parallel** ``dp``: the axes left — replicas of the same experts, each computing
  its own tokens, whose weight gradients are summed over exactly those axes (and ZeRO-sharded over
  data when data is among them).

The default, ``ep=batch tp=x·y``, is the grid's own: experts over data × z, each split over x·y.
Written as text (``parse``, ``str``) it reads ``ep=z·data,tp=x·y`` ('+' may stand for '·';
``batch``, ``world``, ``1`` and ``none`` are understood). ``dispatch=fp8`` adds how the rows bound
for the experts travel: in float8 e4m3 with a scale per 128 features (``axon4d.options.fp8_rows``;
``dispatch=compute``, the default, in the compute dtype). Pure data: the runtime (axon4d.nn.moe)
and the planner (axon4d.plan) read the same layout and the same divisibility rules.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence

from axon4d.grid import rules
from axon4d.grid.shape import AXES, Axis, GridAxis, GridShape, axis_of, members
from axon4d.options.fp8_rows import BLOCK

#: the axes expert tensor parallelism may use: x splits hidden, y the FFN width (as the dense MLP)
TP_AXES: tuple[GridAxis, ...] = ("x", "y")
#: how the rows bound for the experts may travel (``ExpertLayout.fp8_dispatch``): as computed, or fp8
DISPATCH = ("compute", "fp8")


def _axes(text: str, what: str) -> tuple[GridAxis, ...]:
    """The grid axes a layout's ``what`` part names: '1' or 'none' for none, 'batch', 'world', or
    axes joined by '·' or '+' ('xy' too, for x·y)."""
    text = text.strip().replace("+", "·")
    if text in ("1", "none", ""):
        return ()
    if text == "xy":
        return ("x", "y")
    names = members(text) if text in ("batch", "world") else text.split("·")
    unknown = [a for a in names if a not in AXES]
    if unknown or len(set(names)) != len(names):
        raise ValueError(
            f"expert layout {what}={text!r}: give distinct axes of {AXES} joined by '·' or '+', 'batch', 'world' "
            "or '1' (none)"
        )
    return tuple(a for a in AXES if a in names)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Expert-parallel axes ``ep`` and expert tensor-parallel axes ``tp`` (fastest first, disjoint);
    the rest are the expert data-parallel axes ``dp`` (module docstring). ``fp8_dispatch``: the rows
    sent to the experts over ``ep`` — the dispatch, and in backward the combine's gradient — travel
    in e4m3 with a scale per 128 features (``axon4d.options.fp8_rows``); the rows sent home stay in
    the compute dtype."""

    ep: tuple[GridAxis, ...] = ("z", "data")
    tp: tuple[GridAxis, ...] = ("x", "y")
    fp8_dispatch: bool = False

    def __post_init__(self) -> None:
        for what, axes in (("ep", self.ep), ("tp", self.tp)):
            bad = [a for a in axes if a not in AXES]
            if bad or len(set(axes)) != len(axes):
                raise ValueError(f"expert layout {what}={axes}: give distinct grid axes from {AXES}")
        if not set(self.tp) <= set(TP_AXES):
            raise ValueError(
                f"expert layout tp={'·'.join(self.tp)}: experts split only over x (hidden) and y (FFN width): "
                "give tp=1 (whole experts), x, y or x·y"
            )
        both = set(self.ep) & set(self.tp)
        if both:
            raise ValueError(
                f"expert layout ep={'·'.join(self.ep)}, tp={'·'.join(self.tp)}: axis {sorted(both)[0]} cannot both "
                "hold different experts and split each expert; give it to one of them"
            )
        object.__setattr__(self, "ep", tuple(a for a in AXES if a in self.ep))
        object.__setattr__(self, "tp", tuple(a for a in AXES if a in self.tp))

    @classmethod
    def parse(cls, layout: ExpertLayout | str | None) -> ExpertLayout:
        """``layout`` as an ``ExpertLayout``: None is the default (ep=batch, tp=x·y); text is
        ``ep=<axes>,tp=<axes>[,dispatch=fp8]`` (either axes part may be left out: ep defaults to
        batch, tp to those of x and y that ep leaves — "ep=world" is whole experts over every rank;
        dispatch defaults to compute, the rows in the compute dtype)."""
        if layout is None:
            return cls()
        if isinstance(layout, ExpertLayout):
            return layout
        if not isinstance(layout, str):
            raise TypeError(
                f"expert layout {layout!r} ({type(layout).__name__}): give an ExpertLayout or text such as "
                "'ep=world,tp=1' (whole experts over every rank) or 'ep=z·data,tp=x·y' (the default)"
            )
        parts: dict[str, tuple[GridAxis, ...]] = {}
        dispatch: str | None = None
        for item in filter(None, (p.strip() for p in layout.replace(" ", ",").split(","))):
            key, eq, value = item.partition("=")
            if key == "dispatch" and eq and dispatch is None and value.strip() in DISPATCH:
                dispatch = value.strip()
                continue
            if not eq or key not in ("ep", "tp") or key in parts:
                raise ValueError(
                    f"expert layout {layout!r}: write ep=<axes>,tp=<axes>[,dispatch=fp8], each at most once, e.g. "
                    "'ep=world,tp=1' or 'ep=z,tp=x·y,dispatch=fp8' (axes x, y, z, data joined by '·' or '+'; batch, "
                    f"world; 1 for none; dispatch one of {', '.join(DISPATCH)})"
                )
            parts[key] = _axes(value, key)
        ep = parts.get("ep", ("z", "data"))
        return cls(ep, parts.get("tp", tuple(a for a in TP_AXES if a not in ep)), dispatch == "fp8")

    @property
    def dp(self) -> tuple[GridAxis, ...]:
        """The expert data-parallel axes: those neither ``ep`` nor ``tp`` takes."""
        return tuple(a for a in AXES if a not in self.ep and a not in self.tp)

    @property
    def ep_axis(self) -> Axis | None:
        """The product of the expert-parallel axes as one axis name (None: every rank holds every expert)."""
        return axis_of(self.ep)

    @property
    def dp_axis(self) -> Axis | None:
        """The product of the expert data-parallel axes (None: no replicas)."""
        return axis_of(self.dp)

    def splits(self, axis: GridAxis) -> bool:
        """Whether expert tensor parallelism splits each expert over ``axis`` (x or y)."""
        return axis in self.tp

    # -- on a grid: axes of one rank split nothing and name no group ------------------------------
    def ep_axes(self, shape: GridShape) -> tuple[GridAxis, ...]:
        """The expert-parallel axes of more than one rank on ``shape``."""
        return tuple(a for a in self.ep if shape.size(a) > 1)

    def dp_axes(self, shape: GridShape) -> tuple[GridAxis, ...]:
        """The replicas' axes of more than one rank on ``shape``."""
        return tuple(a for a in self.dp if shape.size(a) > 1)

    def rows_over_x(self, shape: GridShape) -> bool:
        """Whether each share is cut over x too, its rows moved from features to rows over x: x has
        more than one rank and does not split the experts."""
        return shape.x > 1 and not self.splits("x")

    def gathers_y(self, shape: GridShape) -> bool:
        """Whether the experts' ranks gather the shares over y (E17): y has more than one rank and
        splits the experts."""
        return shape.y > 1 and self.splits("y")

    def count_axes(self, shape: GridShape) -> tuple[GridAxis, ...]:
        """The axes the counts exchange (E15) gathers over on ``shape``: the expert-parallel ones, and
        y where it splits the experts — every rank a dispatch of this rank's exchanges rows with,
        and where y splits the experts, their y-neighbours (whose rows E17 gathers)."""
        ep, y = self.ep_axes(shape), self.gathers_y(shape)
        return tuple(a for a in AXES if a in ep or (a == "y" and y))

    def total_axes(self, shape: GridShape) -> tuple[GridAxis, ...]:
        """The axes over which the counts exchange (E15) sums the micro-batch's tokens per expert on
        ``shape``: the expert-parallel ones, z, data, y, and x where the shares are cut over it —
        every share of the micro-batch counted once."""
        ep, x = self.ep_axes(shape), self.rows_over_x(shape)
        return tuple(a for a in AXES if shape.size(a) > 1 and (a in ep or a in ("z", "data", "y") or (a == "x" and x)))

    def summed_axes(self, shape: GridShape) -> tuple[GridAxis, ...]:
        """The axes the counts exchange sums over besides its gather: ``total_axes``, or none where
        they are the count axes (the gathered counts then hold every share)."""
        total = self.total_axes(shape)
        return () if total == self.count_axes(shape) else total

    def sizes(self, shape: GridShape) -> tuple[int, int, int]:
        """(G_ep, G_tp, G_dp) on ``shape``."""
        ep, tp, dp = (math.prod(shape.size(a) for a in axes) for axes in (self.ep, self.tp, self.dp))
        return ep, tp, dp

    def __str__(self) -> str:
        return f"ep={self.ep_axis or 1},tp={'·'.join(self.tp) or 1}" + (",dispatch=fp8" if self.fp8_dispatch else "")

    def dispatched_features(self, shape: GridShape, hidden: int) -> int:
        """Features of one row sent to the experts: hidden/G_x where x splits them, else hidden."""
        return hidden // shape.x if self.splits("x") else hidden

    def fp8_dispatches(self, shape: GridShape) -> bool:
        """Whether rows travel to the experts in fp8 on ``shape``: ``fp8_dispatch`` and an
        expert-parallel axis of more than one rank (no all-to-all, nothing cast)."""
        return self.fp8_dispatch and bool(self.ep_axes(shape))

    def describe(self, shape: GridShape, n_experts: int) -> str:
        """One line, e.g. "ep=y·z·data,tp=x: 64 experts over y·z·data (32 ranks), 2 per rank, each split over
        x (4); replicas over data (2)"."""
        g_ep, g_tp, g_dp = self.sizes(shape)
        split = f"each split over {'·'.join(self.tp)} ({g_tp})" if self.tp else "each whole"
        over = f"over {self.ep_axis} ({g_ep} ranks)" if self.ep else "on every rank"
        replicas = f"; replicas over {self.dp_axis} ({g_dp})" if self.dp and g_dp > 1 else ""
        return f"{self}: {n_experts} experts {over}, {n_experts // max(g_ep, 1)} per rank, {split}{replicas}"

    def rules(self, n_experts: int, expert_ffn: int, shared_width: int, hidden: int) -> list[rules.Rule]:
        """The divisibility rules of this placement: E over the expert-parallel axes, an expert's FFN
        width over y where y splits it, hidden over x (the residual stream, the router and the
        features an expert receives), the shared experts' MLP width over y (a dense MLP on the grid)."""
        out = [
            rules.divisible(hidden, "hidden", ("x",), "the router and the residual stream split hidden features over x")
        ]
        if self.ep:
            why = f"experts are split over the expert-parallel axes {'·'.join(self.ep)} ({self})"
            out.insert(0, rules.divisible(n_experts, "n_experts", self.ep, why))
        if self.splits("y"):
            why = f"each expert's FFN splits its inner features over y ({self})"
            out.append(rules.divisible(expert_ffn, "expert_ffn", ("y",), why))
        if shared_width:
            why = "the shared experts' MLP splits its inner features over y"
            out.append(rules.divisible(shared_width, "shared_experts·expert_ffn", ("y",), why))
        if self.fp8_dispatch:  # whole blocks of 128 features in every rank's share of a row
            if hidden % BLOCK:
                raise ValueError(
                    f"expert layout {self} with hidden = {hidden}: dispatch=fp8 casts rows in blocks of {BLOCK} "
                    f"features, so hidden must be a multiple of {BLOCK}; leave dispatch out (rows in the compute dtype)"
                )
            if self.splits("x"):
                why = f"dispatch=fp8 casts the rows' hidden/G_x features in blocks of {BLOCK}"
                out.append(rules.divisible(hidden // BLOCK, f"hidden/{BLOCK}", ("x",), why))
        return out

    def check(self, shape: GridShape, n_experts: int, expert_ffn: int, shared_width: int, hidden: int) -> None:
        """``ValueError`` (the same on every rank, before any collective) unless this layout fits
        ``shape``: the first rule broken, named with the value, and the layouts that would work."""
        for rule in self.rules(n_experts, expert_ffn, shared_width, hidden):
            if not rule.holds(shape):
                fits = [str(c) for c in candidates(shape, n_experts, expert_ffn, shared_width, hidden)]
                shown = ", ".join(fits[:6]) + (f" and {len(fits) - 6} more" if len(fits) > 6 else "")
                raise ValueError(
                    f"{rule.message(shape)}; expert layouts that fit this grid: {shown or 'none'}"
                ) from None


def _subsets(axes: Sequence[GridAxis]) -> Iterator[tuple[GridAxis, ...]]:
    for n in range(len(axes) + 1):
        yield from itertools.combinations(axes, n)


def candidates(shape: GridShape, n_experts: int, expert_ffn: int, shared_width: int, hidden: int) -> list[ExpertLayout]:
    """Every layout that fits ``shape``, one per distinct placement: an axis of one rank is
    given to no part (it changes nothing), so two layouts that differ only there are one."""
    live = [a for a in AXES if shape.size(a) > 1]
    out: list[ExpertLayout] = []
    for tp in _subsets([a for a in TP_AXES if a in live]):
        for ep in _subsets([a for a in live if a not in tp]):
            layout = ExpertLayout(ep, tp)
            if all(r.holds(shape) for r in layout.rules(n_experts, expert_ffn, shared_width, hidden)):
                out.append(layout)
    return out
