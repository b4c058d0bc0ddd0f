"""The session registry on its own, with a stand-in engine: its limits hold when opens run in several
worker threads at once (the service's engine executor)."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from streamserve.server.registry import SessionRegistry, TooManySessionsError


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
