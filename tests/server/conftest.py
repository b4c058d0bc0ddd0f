"""Fixtures of the server tests: one server per module, started in the module's event loop (tests that use it
are marked `@pytest.mark.asyncio(loop_scope="module")`); tests that need a config of their own start one
with `serving.serve(...)`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from fuzz_options import pytest_addoption  # noqa: F401  (--fuzz-minutes: tests/server/fuzz_options.py)
from serving import RunningServer, default_engine

from streamserve.config import ServerConfig

SHARED_CONFIG = ServerConfig(resume_ttl=3.0, max_sessions_per_connection=4, max_chunk_tokens=64,
                             messages_per_second=500.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served() -> AsyncIterator[RunningServer]:
    srv = await RunningServer.start(SHARED_CONFIG, default_engine)
    yield srv
    await srv.stop()
