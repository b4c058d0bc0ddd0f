"""The server's executor threads that run torch work (the engine executor's calls, the vision thread's) hand their
OpenMP workers back after each call (engine/openmp.py `releasing`), so none stays next to the engine thread."""

from __future__ import annotations

import threading

import pytest
from serving import serve

from streamserve.config import ServerConfig
from streamserve.engine import openmp
from streamserve.server.media.vision import Worker


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads `releasing` handed workers back on."""
    names: list[str] = []

    def counted() -> bool:
        names.append(threading.current_thread().name)
        return True

    monkeypatch.setattr(openmp, "release_openmp_threads", counted)
    return names


@pytest.mark.asyncio
async def test_engine_executor_calls_release(released: list[str]) -> None:
    async with serve(ServerConfig()) as srv:
        assert srv.server.service is not None
        assert await srv.server.service.run_engine(lambda x: x + 1, 41) == 42
    assert any(n.startswith("streamserve-engine_") for n in released), released  # an executor thread's name


@pytest.mark.asyncio
async def test_vision_worker_releases_even_when_the_call_raises(released: list[str]) -> None:
    worker = Worker("vision-test")
    try:
        assert await worker.run(lambda x: x * 2, 21) == 42

        def fail() -> None:
            raise ValueError("bad image")

        with pytest.raises(ValueError, match="bad image"):
            await worker.run(fail)
    finally:
        worker.close()
    assert len([n for n in released if n.startswith("vision-test")]) == 2  # once per call
