"""The failure diagnosis's cost in store requests (axon4d.reliability.diagnosis, docs/reliability.md): at a
simulated world of 1024 ranks in one process, a hang that reaches every rank's deadline and a
failure that every rank sees cost requests in proportion to the world, not its square, and each
rank still says what it would say alone. Store requests are counted by a wrapper around torch's
HashStore; the simulated ranks' own heartbeats, which every rank sends whether or not anything is
diagnosed, go to the store directly and are not counted.
"""

from __future__ import annotations

import io

import torch.distributed as dist

from axon4d.reliability import diagnosis, watchdog

WORLD = 1024


class CountingStore:
    """A HashStore that counts the requests made through it."""

    def __init__(self) -> None:
        self.raw = dist.HashStore()
        self.requests = 0

    def _count(self, name: str):
        def call(*args):
            self.requests += 1
            return getattr(self.raw, name)(*args)

        return call

    def __getattr__(self, name: str):
        if name in ("add", "set", "get", "check", "wait"):
            return self._count(name)
        raise AttributeError(name)


def _ranks(store: CountingStore, world: int, hung: set[int], **kwargs) -> list[watchdog.Watchdog]:
    """``world`` watchdogs on ``store`` (none started) whose waits between heartbeat reads let every
    rank not in ``hung`` beat once."""

    def sleep(_: float) -> None:
        for r in range(world):
            if r not in hung:
                store.raw.add(f"axon4d/beat/{r}", 1)

    ended = []
    return [
        watchdog.Watchdog(r, world, store, beat_s=1.0, exit=ended.append, out=io.StringIO(), sleep=sleep, **kwargs)
        for r in range(world)
    ]


def test_a_hang_seen_by_every_rank_is_diagnosed_in_requests_linear_in_the_world():
    store = CountingStore()
    dogs = _ranks(store, WORLD, hung={7})
    watching_alone = store.requests
    assert dogs[0].stalled_ranks() == [7]
    watching_alone = store.requests - watching_alone
    assert watching_alone >= 2 * WORLD  # every rank watching for itself would cost ≥ 2·world²
    store.requests = 0
    messages = [dogs[r].diagnose(f"waited 60 s in all_gather over z on rank {r}") for r in range(WORLD) if r != 7]
    assert store.requests <= 8 * WORLD, store.requests
    for r, message in zip((r for r in range(WORLD) if r != 7), messages):
        assert f"rank {r}: waited 60 s in all_gather over z on rank {r};" in message
        assert "rank(s) 7 stopped answering (hung or dead); ending this rank." in message, message


def test_a_failure_seen_by_every_rank_is_read_in_requests_linear_in_the_world():
    store = CountingStore()
    dogs = _ranks(store, WORLD, hung=set())
    for r in (5, 900):
        dogs[r].announce(RuntimeError(f"planted on rank {r}\nsecond line"))
    store.requests = 0
    messages = [dogs[r].diagnose(None, probe=False) for r in range(WORLD) if r not in (5, 900)]
    assert store.requests <= 6 * WORLD, store.requests
    assert all(
        m.endswith(
            "rank 5 failed with RuntimeError: planted on rank 5; "
            "rank 900 failed with RuntimeError: planted on rank 900; ending this rank."
        )
        for m in messages
    ), messages[0]


def test_past_the_first_failures_the_rest_are_counted_not_named():
    store = CountingStore()
    dogs = _ranks(store, 32, hung=set())
    for r in range(1, 21):
        dogs[r].announce(ValueError(f"bad input on rank {r}"))
    message = dogs[0].diagnose(None, probe=False)
    named = [f"rank {r} failed with ValueError: bad input on rank {r};" for r in range(1, 1 + diagnosis.SHOWN_FAILURES)]
    assert all(n in message for n in named), message
    assert f"{20 - diagnosis.SHOWN_FAILURES} more rank(s) failed;" in message, message
    assert "rank 20 failed" not in message


def test_a_rank_that_claimed_the_diagnosis_and_died_leaves_the_others_to_watch():
    store = CountingStore()
    dogs = _ranks(store, 4, hung={1, 2})
    store.raw.add("axon4d/diagnosis/claim", 1)  # rank 2 claimed it, then stopped before publishing
    message = dogs[0].diagnose("waited 60 s in a barrier of the world")
    assert "rank(s) 1, 2 stopped answering" in message, message
    assert dogs[3].diagnose("waited 61 s in a barrier of the world").count("rank(s) 1, 2 stopped") == 1


def test_a_rank_reads_the_diagnosis_another_published():
    store = CountingStore()
    dogs = _ranks(store, 4, hung={3})
    assert "rank(s) 3 stopped answering" in dogs[1].diagnose("waited in all_reduce over y")
    store.requests = 0
    dogs[0].stalled_ranks(shared=True)
    assert dogs[0]._stalled == [3] and store.requests == 3  # claim, check, get


def test_rank_0_keeps_the_store_up_until_the_ranks_not_found_stopped_are_ending():
    store = CountingStore()
    dogs = _ranks(store, 4, hung={3}, startup_s=30.0)
    assert "rank(s) 3 stopped" in dogs[2].diagnose("waited in all_reduce over y")
    diagnosis.say_ending(store.raw, 2, watchdog.EXIT_TIMEOUT)
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:  # rank 1 ends while rank 0 lingers; rank 3 never does
        sleeps.append(seconds)
        diagnosis.say_ending(store.raw, 1, watchdog.EXIT_TIMEOUT)

    dogs[0]._sleep = sleep
    dogs[0]._end(dogs[0].diagnose("waited in all_reduce over y"), watchdog.EXIT_TIMEOUT)
    assert sleeps == [1.0]  # one beat: then 0, 1 and 2 had said so, and 3 was found stopped
