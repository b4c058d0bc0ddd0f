"""Fixtures of the server tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serving import RunningServer, default_engine

from streamserve.config import ServerConfig


@pytest.fixture(scope="module")
def served() -> Iterator[RunningServer]:
    srv = RunningServer(ServerConfig(resume_ttl=3.0, max_sessions_per_connection=4, max_chunk_tokens=64,
                                     messages_per_second=500.0), default_engine)
    yield srv
    srv.stop()
