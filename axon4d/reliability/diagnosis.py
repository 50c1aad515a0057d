"""What the ranks of a failing job tell each other through its key-value store (docs/reliability.md),
in store requests that grow with the world, not its square — even when every rank arrives at once
and the store is slow.

``axon4d.reliability.watchdog`` keeps the deadlines; this module holds the keys it reads and writes and how a
diagnosis is shared. Keys, all under ``axon4d/`` (of this launch attempt: ``axon4d.grid.launch.attempt_store``):

- ``beat/<r>``: rank r's heartbeat count; ``ending/<r>``: rank r ends on its own (not hung),
  ``endings`` counts those and ``ending/#<n>`` holds the n-th one's rank;
- ``failed/<r>``: rank r's one-line error; ``failures`` counts them, and ``failed/#<n>`` holds the
  n-th announcement (``"<rank> <line>"``), so a reader finds them without trying every rank;
- ``diagnosis``: who stopped, found once for the whole job: ``"claimed <g> <rank>"`` while the
  rank that won claim g watches, ``"done <json list>"`` once it published.

Naming the ranks that stopped means reading every rank's heartbeat twice, 2.5 beats apart. Where
the store reads many keys in one request (``multi_get``: TCPStore, HashStore, PrefixStore) that is
a few requests, else one per rank. When a hang reaches every rank's deadline at about the same
time, each watching would cost world² reads. Instead the first rank to get there claims the
diagnosis (``compare_set`` from nothing to claim 1: one rank only wins), watches the heartbeats and
publishes the stopped ranks; every other rank reads that one key, beating every beat meanwhile so
that it is not taken for stopped, and polling less and less often (after 1, 2, 4, 6, 10, … beats),
so that waiting costs each rank about two requests a beat however slow the store. A waiting rank
also reads the claimant's heartbeat: when it has not advanced for ``publish_wait_s`` (the claimant
died), the waiting ranks all try to move the claim from g to g + 1 with ``compare_set``, exactly
one wins and watches, and the rest keep reading the one key — a dead claimant costs one request
per rank, not a watch per rank. In all, a hang costs a few requests per rank plus about two per
beat it lasts, and a failure a few per rank (``tests/test_diagnosis.py``: 1024 ranks as threads
arriving at once on one slowed TCPStore).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

PREFIX = "axon4d/"
#: failure announcements a rank reads and names; the rest are counted ("and N more")
SHOWN_FAILURES = 8
#: heartbeats watched to tell a stopped rank, the first being after a full beat
WATCH_BEATS = (1.0, 1.0, 0.5)
#: the longest a waiting rank goes between two reads of the diagnosis, in beats (before
#: ``publish_wait_s`` caps it)
POLL_CAP_BEATS = 8

_DIAGNOSIS = f"{PREFIX}diagnosis"
_CLAIMED, _DONE = "claimed ", "done "


def _batched(store: Any) -> bool:
    """Whether ``store`` reads many keys in one request (``multi_get``: torch's "extended API")."""
    try:
        return bool(store.has_extended_api())
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _read_all(store: Any, keys: list[str]) -> list[bytes] | None:
    """The values of ``keys`` in two requests (``check``, ``multi_get``), or None where the store
    cannot read them at once or one of them is missing (``multi_get`` would wait for it)."""
    if not keys or not _batched(store) or not store.check(keys):
        return None
    return list(store.multi_get(keys))


def beat(store: Any, rank: int) -> None:
    """Add one to ``rank``'s heartbeat."""
    store.add(f"{PREFIX}beat/{rank}", 1)


def beats(store: Any, world: int) -> list[int]:
    """Every rank's heartbeat count now: two requests where the store reads many keys at once and
    every rank has beaten, else one per rank (which also creates the missing keys)."""
    keys = [f"{PREFIX}beat/{r}" for r in range(world)]
    values = _read_all(store, keys)
    if values is None:
        return [int(store.add(key, 0)) for key in keys]
    return [int(v) for v in values]


def say_ending(store: Any, rank: int, code: int) -> None:
    """Record that ``rank`` ends on its own with exit ``code`` (not hung)."""
    store.set(f"{PREFIX}ending/{rank}", str(code))
    n = int(store.add(f"{PREFIX}endings", 1))
    store.set(f"{PREFIX}ending/#{n}", str(rank))


def ending(store: Any, rank: int) -> bool:
    """Whether ``rank`` said it is ending on its own or announced a failure."""
    return any(store.check([f"{PREFIX}{key}/{rank}"]) for key in ("ending", "failed"))


def ended(store: Any, ranks: Iterable[int]) -> set[int]:
    """Which of ``ranks`` said they are ending or announced a failure: two requests per rank for
    one or two ranks or where the store reads one key at a time, else four through the counted
    keys."""
    ranks = list(ranks)
    if len(ranks) > 2 and _batched(store):
        endings, failed = int(store.add(f"{PREFIX}endings", 0)), failures(store)
        keys = [f"{PREFIX}ending/#{n}" for n in range(1, endings + 1)]
        keys += [f"{PREFIX}failed/#{n}" for n in range(1, failed + 1)]
        values = _read_all(store, keys) if keys else []
        if values is not None:  # else one was counted but not written yet: ask rank by rank
            said = {int(v.decode(errors="replace").partition(" ")[0]) for v in values}
            return {r for r in ranks if r in said}
    return {r for r in ranks if ending(store, r)}


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
    beats), less those that said they are ending or failed; ``rank`` beats on meanwhile. About ten
    requests where the store reads many keys at once (``beats``, ``ended``), else about 2·world plus
    two per silent rank. Raises what the store raises."""
    first = beats(store, world)
    for fraction in WATCH_BEATS:
        sleep(fraction * beat_s)
        beat(store, rank)
    second = beats(store, world)
    silent = [r for r in range(world) if r != rank and second[r] <= first[r]]
    said = ended(store, silent)
    return [r for r in silent if r not in said]


def shared_stalled(
    store: Any, rank: int, world: int, beat_s: float, publish_wait_s: float, sleep: Callable[[float], None]
) -> list[int]:
    """The stopped ranks, found once for the job (module docstring): the rank that wins the claim
    watches (``watch``) and publishes them; the others read what it published, beating every beat
    while they wait and reading less and less often; when the claimant's heartbeat stood still for
    ``publish_wait_s``, one of them wins the next claim and watches. Raises what the store raises."""
    beat(store, rank)  # before claiming, so that the claimant's heartbeat is there to be read
    mine = f"{_CLAIMED}1 {rank}"
    state = _text(store.compare_set(_DIAGNOSIS, "", mine))
    waited = 0.0  # beats slept here, in seconds
    seen: tuple[str, int] | None = None  # (the diagnosis, its claimant's heartbeat) at the last read
    since = 0.0  # when that last changed
    polls, next_poll = 0, beat_s
    cap = max(1, min(POLL_CAP_BEATS, int(publish_wait_s / (2 * beat_s))))
    while True:
        if state.startswith(_DONE):
            return [int(r) for r in json.loads(state[len(_DONE) :])]
        if state == mine:  # this rank's claim: find them for everyone
            stalled = watch(store, rank, world, beat_s, sleep)
            store.set(_DIAGNOSIS, _DONE + json.dumps(stalled))
            return stalled
        generation, owner = (int(word) for word in state[len(_CLAIMED) :].split())
        sleep(beat_s)
        waited += beat_s
        beat(store, rank)
        if waited < next_poll - 1e-9 * beat_s:
            continue
        state, owner_beat = _poll(store, owner)
        polls += 1
        next_poll = waited + beat_s * min(cap, 2 ** (polls // 2))
        if seen != (state, owner_beat):
            seen, since = (state, owner_beat), waited
        elif waited - since >= publish_wait_s:  # the claimant stood still: claim the next one
            mine = f"{_CLAIMED}{generation + 1} {rank}"
            state = _text(store.compare_set(_DIAGNOSIS, state, mine))
            seen, since, polls, next_poll = None, waited, 0, waited + beat_s


def _poll(store: Any, owner: int) -> tuple[str, int]:
    """(The diagnosis now, ``owner``'s heartbeat): one request where the store reads many keys at
    once, else two."""
    beat_key = f"{PREFIX}beat/{owner}"
    if not _batched(store):
        owner_beat = int(store.add(beat_key, 0))
        return _text(store.get(_DIAGNOSIS)), owner_beat
    state, owner_beat = store.multi_get([_DIAGNOSIS, beat_key])
    return _text(state), int(owner_beat)


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
