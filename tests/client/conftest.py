"""Fixtures of the client SDK's tests: the fake server (`fake_server.py`) on the test's loop or a thread of its own.

Test modules import from `fake_server`, never from `conftest`: with several conftest.py files in the suite the
module named `conftest` is whichever was imported first."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from fake_server import FakeServer


@pytest.fixture
def fake_server_thread() -> Iterator[FakeServer]:
    """The fake server on its own event-loop thread, for the blocking client."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-streamserve", daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(_started(), loop).result(10)
    server.loop = loop
    yield server
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


async def _started() -> FakeServer:
    server = FakeServer()
    await server.start()
    return server


@pytest_asyncio.fixture
async def fake_server() -> AsyncIterator[FakeServer]:
    server = FakeServer()
    await server.start()
    yield server
    await server.stop()
