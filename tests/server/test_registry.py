"""The session registry on its own, with a stand-in engine: its limits (per connection, per client address, the
server's) hold when opens run in several worker threads at once (the service's engine executor)."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from streamserve.server.service.registry import SessionRegistry, TooManySessionsError


class FakeSession:
    ids = itertools.count()

    def __init__(self) -> None:
        self.id, self.closed, self.max_chunk_tokens = f"s{next(self.ids)}", False, None

    def close(self) -> None:
        self.closed = True

    def cancel(self) -> None:
        pass


class SlowEngine:
    """open_session takes a while, as a real one does (it waits for the engine lock)."""

    def __init__(self) -> None:
        self.opened: list[FakeSession] = []
        self.lock = threading.Lock()

    def open_session(self, **kw: Any) -> FakeSession:
        time.sleep(0.2)
        s = FakeSession()
        with self.lock:
            self.opened.append(s)
        return s


def open_concurrently(registry: SessionRegistry, owners: list[object]) -> list[BaseException | None]:
    def one(owner: object) -> BaseException | None:
        try:
            registry.open(owner, None)
            return None
        except TooManySessionsError as e:
            return e

    with ThreadPoolExecutor(len(owners)) as pool:
        return list(pool.map(one, owners))


def test_concurrent_opens_never_pass_the_server_limit() -> None:
    registry = SessionRegistry(SlowEngine(), resume_ttl=60.0, max_per_owner=8, max_chunk_tokens=64,  # type: ignore[arg-type]
                               max_total=2)
    outcomes = open_concurrently(registry, [object() for _ in range(4)])
    assert len(registry) == 2 and sum(o is None for o in outcomes) == 2


def test_concurrent_opens_of_one_owner_never_pass_its_limit() -> None:
    engine = SlowEngine()
    registry = SessionRegistry(engine, resume_ttl=60.0, max_per_owner=2, max_chunk_tokens=64,  # type: ignore[arg-type]
                               max_total=100)
    owner = object()
    outcomes = open_concurrently(registry, [owner] * 4)
    assert len(registry.owned(owner)) == 2 and sum(o is None for o in outcomes) == 2
    assert len(engine.opened) == 2  # the refused ones opened nothing


def test_a_full_server_makes_room_by_closing_the_oldest_detached_session() -> None:
    registry = SessionRegistry(SlowEngine(), resume_ttl=60.0, max_per_owner=8, max_chunk_tokens=64,  # type: ignore[arg-type]
                               max_total=2)
    gone, live = object(), object()
    first = registry.open(gone, None)
    registry.open(gone, None)
    registry.detach_all(gone)
    outcomes = open_concurrently(registry, [live] * 3)
    assert sum(o is None for o in outcomes) == 2 and len(registry) == 2 and first.session.closed


# ---- sessions per client address ------------------------------------------------------------------------------------
A, B = "127.0.0.1", "127.0.0.2"


class Owner:  # a connection, as the registry sees a ClientContext
    def __init__(self, address: str | None) -> None:
        self.address = address


def by_address(max_total: int, max_per_address: int) -> SessionRegistry:
    return SessionRegistry(SlowEngine(), resume_ttl=60.0, max_per_owner=8, max_chunk_tokens=64,  # type: ignore[arg-type]
                           max_total=max_total, max_per_address=max_per_address)


def test_opens_in_flight_count_against_their_address() -> None:
    reg = by_address(max_total=100, max_per_address=2)
    owners = [Owner(A) for _ in range(4)] + [Owner(B)]
    lock, refused = threading.Lock(), []

    def one(owner: Owner) -> None:
        try:
            reg.open(owner, None)
        except TooManySessionsError as e:
            with lock:
                refused.append((owner.address, str(e)))

    with ThreadPoolExecutor(len(owners)) as pool:
        list(pool.map(one, owners))
    assert len(refused) == 2 and all(a == A and "per address" in m for a, m in refused)
    assert sorted(e.address for e in reg.all()) == [A, A, B]


def test_a_full_table_evicts_the_openers_own_detached_session_first() -> None:
    reg = by_address(max_total=3, max_per_address=3)
    b, a1, a2 = Owner(B), Owner(A), Owner(A)
    theirs = reg.open(b, None)
    reg.detach_all(b)  # B's session is detached first: the oldest
    mine = reg.open(a1, None)
    reg.detach_all(a1)
    reg.open(a2, None)  # full
    reg.open(a2, None)  # makes room with A's own detached session, not B's older one
    assert mine.session.closed and not theirs.session.closed
    assert reg.resume(Owner(B), theirs.session.id, theirs.resume_token)[0] is theirs


def test_a_resume_from_another_address_counts_there() -> None:
    reg = by_address(max_total=10, max_per_address=1)
    a = Owner(A)
    entry = reg.open(a, None)
    reg.detach_all(a)
    with pytest.raises(TooManySessionsError):  # detached, it still counts for A
        reg.open(Owner(A), None)
    reg.open(Owner(B), None)
    with pytest.raises(TooManySessionsError):  # B holds its one
        reg.resume(Owner(B), entry.session.id, entry.resume_token)
    c = Owner("127.0.0.3")
    assert reg.resume(c, entry.session.id, entry.resume_token)[0].address == "127.0.0.3"
    reg.open(Owner(A), None)  # A's count went with the session
