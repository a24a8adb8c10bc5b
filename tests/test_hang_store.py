"""The hang report's load on the rendezvous store (pretrain/faults/watchdog.py, Channel and Watchdog):
between reports the watchdogs send the store nothing, whatever the number of ranks (each waits for
a call blocked in the store), and a report costs each rank the same few requests at any world size.
Real TCPStores on loopback; requests are counted, not timed (bench/bench_hang_store.py times them)."""

from __future__ import annotations

import datetime
import os
import time
from collections import Counter

import pytest
import torch.distributed as dist

from pretrain.faults import watchdog
from pretrain.faults.watchdog import Channel, Watchdog

class Counted:
    """A store that counts the requests made through it (and through its clones) by method, and
    keeps the first key of each wait."""

    def __init__(self, store, calls: Counter, waited: list):
        self.store, self.calls, self.waited = store, calls, waited

    def clone(self):
        self.calls["clone"] += 1
        return Counted(self.store.clone(), self.calls, self.waited)

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            if name == "wait":
                self.waited.append(args[0][0])
            return method(*args, **kwargs)

        return counted


@pytest.fixture
def master():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store
    del store


@pytest.fixture
def no_exit(monkeypatch):
    """A verdict of hang must not end pytest: its os._exit is recorded instead (the test then fails)."""
    exits = []

    class Os:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def _exit(code):
            exits.append(code)
            raise SystemExit(code)

    fake = Os()
    monkeypatch.setattr(watchdog, "os", fake)
    monkeypatch.setattr(watchdog, "_bounded", lambda fn, *args: None)  # (no logging.shutdown in pytest)
    return exits


def _client(port: int, calls: Counter, prefix: str, waited: list | None = None) -> Channel:
    # as distributed.side_store connects (a long connect timeout: some loopback connects stall 5 s here)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    return Channel(Counted(dist.PrefixStore(prefix, store), calls, [] if waited is None else waited))


def _until(condition, what: str, limit_s: float = 120.0) -> None:
    """Wait for `condition` (a generous limit: a correctness check, not a speed one)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {limit_s:g} s"
        time.sleep(0.05)


def _world(master, tmp_path, world: int) -> tuple[list[Watchdog], list[Counter], list[list]]:
    calls, waited = [Counter() for _ in range(world)], [[] for _ in range(world)]
    hosts = [f"h{r}" for r in range(world)]
    prefix = f"pretrain/hangs/{tmp_path.name}-{world}/"  # (a start's own keys)
    dogs = [Watchdog(tmp_path, r, hosts, 0.0, 1800.0, _client(master.port, calls[r], prefix, waited[r]))
            for r in range(world)]
    for dog in dogs:
        dog.mark("forward/backward", 3)
    try:  # every rank has made its first request (its listener's wait for the first report's call)
        _until(lambda: all(c["wait"] + c["add"] >= 1 for c in calls), "every rank listens", 60)
    except BaseException:
        for dog in dogs:
            dog.close()
        raise
    return dogs, calls, waited


@pytest.mark.parametrize("world", [2, 8])
def test_waiting_watchdogs_send_the_store_nothing(master, tmp_path, world):
    """Between reports a watchdog's only request is one wait, blocked in the store until a report
    calls it: none during 2 s (polling twice a second sent 4 a rank), at any world size; close()
    ends that wait (nothing left in flight to fail when rank 0's store goes away)."""
    dogs, calls, _ = _world(master, tmp_path, world)
    try:
        before = [sum(c.values()) for c in calls]
        time.sleep(2.0)
        assert [sum(c.values()) for c in calls] == before, calls
        assert all(c["wait"] == 1 and c["clone"] == 1 for c in calls), calls
    finally:
        for dog in dogs:
            dog.close()
    assert not any(dog._listener.is_alive() for dog in dogs)


def test_a_world_of_one_does_not_listen(master, tmp_path):
    """Alone, no other rank can ask: no listener, no connection of its own, no request."""
    calls = Counter()
    dog = Watchdog(tmp_path, 0, ["h"], 0.0, 1800.0, _client(master.port, calls, "pretrain/hangs/alone/"))
    time.sleep(0.5)
    dog.close()
    assert sum(calls.values()) == 0 and dog._listener is None, calls


def _report(master, tmp_path, world: int, no_exit) -> list[Counter]:
    """Rank 0 waits in a collective past its timeout and asks for a report; the others make
    progress (not hung): every rank answers, the verdict is "no hang", and the run goes on.
    The requests each rank made for it."""
    dogs, calls, waited = _world(master, tmp_path, world)
    try:
        before = [Counter(c) for c in calls]
        dogs[0].mark("collective", 3)
        dogs[0].since -= 3600  # (past any timeout: it fires at its next sample)
        _until(lambda: no_exit or all(d.handled == 1 and not d.reporting.is_set() for d in dogs),
               "every rank takes part")
        assert not no_exit, "a verdict of hang"
        # every listener waits for the next report's call
        _until(lambda: all(w[-1] == f"2/call/{r}" for r, w in enumerate(waited)), "listeners wait again")
        assert dogs[0].since > time.monotonic() - 60  # no rank hung: the asking rank waits a timeout more
        return [c - b for c, b in zip(calls, before)]
    finally:
        for dog in dogs:
            dog.close()


def test_a_report_costs_each_rank_the_same_few_requests_at_any_world_size(master, tmp_path, no_exit):
    """Each rank's requests for one report (its listener woken, its answer, its wait for the
    verdict; the asking rank's calls to every rank, its wait for every answer) are the same at 2 and
    at 8 ranks, a handful each: none is a loop that runs until the others answer."""
    small, large = (_report(master, tmp_path / str(w), w, no_exit) for w in (2, 8))
    assert small[0] == large[0], (small[0], large[0])  # the asking rank
    assert all(c == small[1] for c in small[1:] + large[1:]), (small, large)
    assert sum(large[0].values()) <= 12 and sum(large[1].values()) <= 6, large
    assert large[0]["wait"] == large[1]["wait"] == 2  # the answers or the verdict; the next call
