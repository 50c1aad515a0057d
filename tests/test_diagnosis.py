"""The failure diagnosis's cost in store requests (axon4d.reliability.diagnosis, docs/reliability.md): at a
simulated world of 1024 ranks, a hang that reaches every rank's deadline and a failure that every
rank sees cost requests in proportion to the world, not its square, and each rank still says what
it would say alone — one rank after another in one thread (a counting wrapper around torch's
HashStore; the simulated ranks' own heartbeats, which every rank sends whether or not anything is
diagnosed, go to the store directly and are not counted), and all 1024 at once, as threads on one
real TCPStore that serves one request at a time and slowly, with the claimant alive or stopped.
"""

from __future__ import annotations

import datetime
import io
import threading
import time

import pytest
import torch.distributed as dist

from axon4d.reliability import diagnosis, watchdog

WORLD = 1024
REQUESTS = ("add", "set", "get", "check", "wait", "multi_get", "compare_set")


class CountingStore:
    """A store that counts the requests made through it (a HashStore unless given ``raw``), each
    answered ``delay_s`` late (a loaded store host); ``batched=False``: as a store without
    ``multi_get``."""

    def __init__(self, raw=None, delay_s: float = 0.0, batched: bool = True) -> None:
        self.raw = raw if raw is not None else dist.HashStore()
        self.requests = 0
        self.beats = 0  # of the requests, heartbeats (every rank sends one a beat, diagnosing or not)
        self.delay_s, self.batched = delay_s, batched
        self._lock = threading.Lock()

    def _count(self, name: str):
        def call(*args):
            with self._lock:
                self.requests += 1
                self.beats += name == "add" and args[0].startswith("axon4d/beat/") and args[1] == 1
            if self.delay_s:
                time.sleep(self.delay_s)
            return getattr(self.raw, name)(*args)

        return call

    def __getattr__(self, name: str):
        if name in REQUESTS:
            return self._count(name)
        if name == "has_extended_api":  # answered by the client, no request
            return lambda: self.batched and self.raw.has_extended_api()
        raise AttributeError(name)


def _ranks(store: CountingStore, world: int, hung: set[int], **kwargs) -> list[watchdog.Watchdog]:
    """``world`` watchdogs on ``store`` (none started, each having beaten once) whose waits between
    heartbeat reads let every rank not in ``hung`` beat once."""

    def sleep(_: float) -> None:
        for r in range(world):
            if r not in hung:
                store.raw.add(f"axon4d/beat/{r}", 1)

    for r in range(world):
        store.raw.add(f"axon4d/beat/{r}", 1)
    ended = []
    return [
        watchdog.Watchdog(r, world, store, beat_s=1.0, exit=ended.append, out=io.StringIO(), sleep=sleep, **kwargs)
        for r in range(world)
    ]


def test_a_hang_seen_by_every_rank_is_diagnosed_in_requests_linear_in_the_world():
    store = CountingStore()
    dogs = _ranks(store, WORLD, hung={7})
    assert dogs[0].stalled_ranks() == [7]
    assert store.requests <= 10, store.requests  # two reads of every heartbeat, 2 requests each
    store.requests = 0
    messages = [dogs[r].diagnose(f"waited 60 s in all_gather over z on rank {r}") for r in range(WORLD) if r != 7]
    assert store.requests <= 3 * WORLD + 16, store.requests  # the failures' count, a heartbeat, the claim
    for r, message in zip((r for r in range(WORLD) if r != 7), messages):
        assert f"rank {r}: waited 60 s in all_gather over z on rank {r};" in message
        assert "rank(s) 7 stopped answering (hung or dead); ending this rank." in message, message


def test_a_store_that_reads_one_key_at_a_time_is_read_rank_by_rank():
    store = CountingStore(batched=False)
    dogs = _ranks(store, 64, hung={7, 9, 30})
    diagnosis.say_ending(store.raw, 9, watchdog.EXIT_TIMEOUT)
    diagnosis.announce(store.raw, 30, "ValueError: planted")
    assert dogs[0].stalled_ranks() == [7]
    assert 2 * 64 <= store.requests <= 2 * 64 + 10, store.requests


def test_ranks_that_ended_or_failed_are_not_named_stopped():
    store = CountingStore()
    dogs = _ranks(store, 64, hung={7, 9, 30})
    diagnosis.say_ending(store.raw, 9, watchdog.EXIT_TIMEOUT)
    diagnosis.announce(store.raw, 30, "ValueError: planted")
    assert dogs[0].stalled_ranks() == [7]
    assert store.requests <= 14, store.requests
    store.raw.add("axon4d/failures", 1)  # counted, not written yet: asked rank by rank
    assert dogs[0].stalled_ranks() == [7]


class _Storm:
    """``WORLD`` ranks as threads on one TCPStore, slowed (``CountingStore``), that every rank but
    ``stopped`` reaches at once, each running its watchdog's diagnosis with real sleeps."""

    def __init__(self, stopped: set[int], beat_s: float, delay_s: float) -> None:
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        timeout = datetime.timedelta(seconds=60)
        client = dist.TCPStore("127.0.0.1", self.server.port, is_master=False, timeout=timeout, wait_for_workers=False)
        self.store = CountingStore(client, delay_s=delay_s)
        client.multi_set([f"axon4d/beat/{r}" for r in range(WORLD)], ["1"] * WORLD)  # every rank beat once
        self.stopped, self.beat_s = stopped, beat_s
        self.dogs = {
            r: watchdog.Watchdog(r, WORLD, self.store, beat_s=beat_s, exit=lambda code: None, out=io.StringIO())
            for r in range(WORLD)
            if r not in stopped
        }

    def run(self) -> dict[int, str]:
        messages: dict[int, str] = {}
        go = threading.Barrier(len(self.dogs))

        def rank(r: int) -> None:
            go.wait()
            messages[r] = self.dogs[r].diagnose(f"waited 60 s in all_reduce over data on rank {r}")

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in self.dogs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a rank's diagnosis did not end"
        return messages


@pytest.mark.slow
@pytest.mark.parametrize("claimant", ["alive", "stopped"])
def test_every_rank_at_once_on_a_slow_store_costs_requests_linear_in_the_world(claimant):
    stopped = {3, 500, 1023}
    storm = _Storm(stopped, beat_s=0.4, delay_s=2e-3)
    if claimant == "stopped":  # rank 500 won the claim, then stopped before publishing
        storm.store.raw.set("axon4d/diagnosis", "claimed 1 500")
        for dog in storm.dogs.values():
            dog.publish_wait_s = 4 * storm.beat_s
    started = time.monotonic()
    messages = storm.run()
    took = time.monotonic() - started
    assert sorted(messages) == sorted(storm.dogs)
    named = "rank(s) 3, 500, 1023 stopped answering (hung or dead); ending this rank."
    wrong = {r: m for r, m in messages.items() if not m.endswith(named)}
    assert not wrong, (len(wrong), next(iter(wrong.values())))
    requests, beats = storm.store.requests, storm.store.beats
    print(f"{claimant}: {requests} requests ({beats} heartbeats) for {WORLD} ranks in {took:.1f} s")
    assert requests - beats <= 10 * WORLD, (requests, beats)  # where each watching would be ≥ 2·world²
    assert beats <= (took / storm.beat_s + 2) * WORLD, (beats, took)  # one a beat per rank, as when not diagnosing


def test_a_rank_that_claimed_the_diagnosis_and_died_leaves_one_other_to_watch():
    store = CountingStore()
    dogs = _ranks(store, 4, hung={1, 2})
    store.raw.set("axon4d/diagnosis", "claimed 1 2")  # rank 2 claimed it, then stopped before publishing
    message = dogs[0].diagnose("waited 60 s in a barrier of the world")
    assert "rank(s) 1, 2 stopped answering" in message, message
    assert store.raw.get("axon4d/diagnosis").startswith(b"done ")
    store.requests = 0
    assert dogs[3].diagnose("waited 61 s in a barrier of the world").count("rank(s) 1, 2 stopped") == 1
    assert store.requests == 3  # the failures' count, a heartbeat, the claim that reads the diagnosis


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


def test_a_rank_reads_the_diagnosis_another_published():
    store = CountingStore()
    dogs = _ranks(store, 4, hung={3})
    assert "rank(s) 3 stopped answering" in dogs[1].diagnose("waited in all_reduce over y")
    store.requests = 0
    dogs[0].stalled_ranks(shared=True)
    assert dogs[0]._stalled == [3] and store.requests == 2  # a heartbeat, the claim that reads the diagnosis


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
