"""What the ranks of a failing job tell each other through its key-value store (docs/reliability.md),
in store requests that grow with the world, not its square.

``axon4d.reliability.watchdog`` keeps the deadlines; this module holds the keys it reads and writes and how a
diagnosis is shared. Keys, all under ``axon4d/`` (of this launch attempt: ``axon4d.grid.launch.attempt_store``):

- ``beat/<r>``: rank r's heartbeat count; ``ending/<r>``: rank r ends on its own (not hung), and
  ``endings`` counts those;
- ``failed/<r>``: rank r's one-line error; ``failures`` counts them, and ``failed/#<n>`` holds the
  n-th announcement (``"<rank> <line>"``), so a reader finds the first ones without trying every rank;
- ``diagnosis/claim`` and ``diagnosis``: who stopped, found once for the whole job.

Naming the ranks that stopped means reading every rank's heartbeat twice, 2.5 beats apart. When a
hang reaches every rank's deadline at about the same time, each doing so would cost world² reads.
Instead the first rank to get there claims the diagnosis (``add`` on ``diagnosis/claim`` returns 1
to one rank only), watches the heartbeats and publishes the stopped ranks; every other rank reads
that one key, beating meanwhile so that it is not taken for stopped. A rank that waited
``publish_wait_s`` without seeing it (the claimant died meanwhile) watches for itself. Failure
announcements are read through the counted keys, at most ``SHOWN_FAILURES`` of them per reader. In
all, a hang costs about 2·world reads for the heartbeats plus a few per rank, and a failure a few
per rank (``tests/test_diagnosis.py``, a counting store at a world of 1024).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

PREFIX = "axon4d/"
#: failure announcements a rank reads and names; the rest are counted ("and N more")
SHOWN_FAILURES = 8
#: heartbeats watched to tell a stopped rank, the first being after a full beat
WATCH_BEATS = (1.0, 1.0, 0.5)


def beat(store: Any, rank: int) -> None:
    """Add one to ``rank``'s heartbeat."""
    store.add(f"{PREFIX}beat/{rank}", 1)


def beats(store: Any, world: int) -> list[int]:
    """Every rank's heartbeat count now (one request per rank)."""
    return [int(store.add(f"{PREFIX}beat/{r}", 0)) for r in range(world)]


def say_ending(store: Any, rank: int, code: int) -> None:
    """Record that ``rank`` ends on its own with exit ``code`` (not hung)."""
    store.set(f"{PREFIX}ending/{rank}", str(code))
    store.add(f"{PREFIX}endings", 1)


def ending(store: Any, rank: int) -> bool:
    """Whether ``rank`` said it is ending on its own or announced a failure."""
    return any(store.check([f"{PREFIX}{key}/{rank}"]) for key in ("ending", "failed"))


def gone(store: Any) -> int:
    """How many ranks said they are ending or announced a failure (two requests)."""
    return int(store.add(f"{PREFIX}endings", 0)) + failures(store)


def announce(store: Any, rank: int, line: str) -> None:
    """Record ``rank``'s failure with its one-line error, counted in announcement order."""
    store.set(f"{PREFIX}failed/{rank}", line)
    n = int(store.add(f"{PREFIX}failures", 1))
    store.set(f"{PREFIX}failed/#{n}", f"{rank} {line}")


def failures(store: Any) -> int:
    """How many failures were announced."""
    return int(store.add(f"{PREFIX}failures", 0))


def failed_ranks(store: Any, shown: int = SHOWN_FAILURES) -> tuple[dict[int, str], int]:
    """(rank → error line of the first ``shown`` announcements, how many were announced): at most
    1 + 2·``shown`` requests. An announcement counted but not written yet is left out."""
    count = failures(store)
    out: dict[int, str] = {}
    for n in range(1, min(count, shown) + 1):
        key = f"{PREFIX}failed/#{n}"
        if store.check([key]):
            rank, _, line = store.get(key).decode(errors="replace").partition(" ")
            out[int(rank)] = line
    return out, count


def watch(store: Any, rank: int, world: int, beat_s: float, sleep: Callable[[float], None]) -> list[int]:
    """The ranks other than ``rank`` whose heartbeat did not advance over ``WATCH_BEATS`` (2.5
    beats), less those that said they are ending or failed; ``rank`` beats on meanwhile. About
    2·world requests, plus two per silent rank. Raises what the store raises."""
    first = beats(store, world)
    for fraction in WATCH_BEATS:
        sleep(fraction * beat_s)
        beat(store, rank)
    second = beats(store, world)
    silent = [r for r in range(world) if r != rank and second[r] <= first[r]]
    return [r for r in silent if not ending(store, r)]


def shared_stalled(
    store: Any, rank: int, world: int, beat_s: float, publish_wait_s: float, sleep: Callable[[float], None]
) -> list[int]:
    """The stopped ranks, found once for the job (module docstring): the first caller watches
    (``watch``) and publishes them; later callers read what it published, beating while they wait
    for it, and watch for themselves after ``publish_wait_s`` without it. Raises what the store
    raises."""
    key = f"{PREFIX}diagnosis"
    if int(store.add(f"{key}/claim", 1)) == 1:
        stalled = watch(store, rank, world, beat_s, sleep)
        store.set(key, json.dumps(stalled))
        return stalled
    waited = 0.0
    while True:
        if store.check([key]):
            return [int(r) for r in json.loads(store.get(key))]
        if waited >= publish_wait_s:
            return watch(store, rank, world, beat_s, sleep)
        beat(store, rank)
        sleep(beat_s)
        waited += beat_s
