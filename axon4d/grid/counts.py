"""Counts: the one check of a whole-number field (``whole``) and of attention's head counts (``heads``).

Plain values, checked before anything is built or communicated, so every rank refuses the same
input with the same words. A count is a whole number — an int, never a bool; a float such as 1.5 is
refused, never truncated — of at least its least value (``is_whole``, ``whole``). Every field that
counts something is checked here: a model's sizes (axon4d.config), a layer's features and heads
(``axon4d.grid.rules.count``), grid sizes (axon4d.grid.shape, which also allows -1), the overlap policy's
knobs (axon4d.options.overlap_policy) and the training job's flags (axon4d.train.config). ``heads`` holds the rules
that tie hidden size, query heads and key/value heads together (and rotary's even head_dim),
for the model config and the attention layer alike.
"""

from __future__ import annotations

import numbers
from typing import TypeGuard


def is_whole(value: object) -> TypeGuard[numbers.Integral]:
    """Whether ``value`` is a whole number: an int (numpy's too), not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def whole(
    value: object,
    what: str,
    *,
    minimum: int = 1,
    unit: str = "",
    example: object = None,
    hint: str = "",
    flag: bool = False,
) -> int:
    """``value`` as an int if it is a whole number (``is_whole``) of at least ``minimum``:
    ``TypeError`` otherwise, ``ValueError`` below ``minimum``. The message names ``what`` and the
    value (``what = value``, or ``--what value:`` for a command-line ``flag``), what it counts
    (``unit``; "it counts something" without one; nothing for a flag, whose ``hint`` says it), an
    ``example`` that works and a ``hint``."""
    tail = (f", for example {example}" if example is not None else "") + (f"; {hint}" if hint else "")
    if not is_whole(value):
        named = f"{what} {value!r}" if flag else f"{what} = {value!r}"
        kind = f" of {unit}" if unit else ("" if flag else " (int)")
        raise TypeError(f"{named} ({type(value).__name__}) must be a whole number{kind}{tail}")
    if value < minimum:
        named = f"{what} {value}:" if flag else f"{what} = {value}"
        why = "" if flag else f" ({f'a number of {unit}' if unit else 'it counts something'})"
        raise ValueError(f"{named} must be at least {minimum}{why}{tail}")
    return int(value)


def heads(hidden: int, n_heads: int, n_kv_heads: int, rotary: str = "") -> None:
    """Raise ``ValueError`` unless ``n_heads`` divides ``hidden`` (each head gets hidden/n_heads
    features) and ``n_kv_heads`` divides ``n_heads`` (each key/value head serves n_heads/n_kv_heads
    query heads), listing the counts that would; with ``rotary`` (what rotates pairs of features,
    and what to do instead) the head_dim hidden/n_heads must also be even."""
    given = f"hidden = {hidden}, n_heads = {n_heads}, n_kv_heads = {n_kv_heads} do not fit: "
    need = "need hidden % n_heads == 0 and n_heads % n_kv_heads == 0"
    if hidden % n_heads:
        raise ValueError(
            f"{given}hidden = {hidden} is not divisible by n_heads = {n_heads} (each head gets hidden/n_heads "
            f"features; {need}); n_heads that divide it: {divisors(hidden)}"
        )
    if n_heads % n_kv_heads:
        raise ValueError(
            f"{given}n_heads = {n_heads} is not divisible by n_kv_heads = {n_kv_heads} (each key/value head serves "
            f"n_heads/n_kv_heads query heads; {need}); n_kv_heads that divide it: {divisors(n_heads)}"
        )
    if rotary and (hidden // n_heads) % 2:
        raise ValueError(f"head_dim = hidden/n_heads = {hidden}/{n_heads} = {hidden // n_heads} is odd, but {rotary}")


def divisors(n: int, limit: int = 12) -> str:
    """The divisors of ``n`` as a list for a message (the first ``limit``, then the largest)."""
    ds = [d for d in range(1, n + 1) if n % d == 0] if n <= 1 << 20 else [d for d in range(1, 4097) if n % d == 0]
    shown = ", ".join(str(d) for d in ds[:limit])
    return shown + (f", …, {ds[-1]}" if len(ds) > limit else "")
