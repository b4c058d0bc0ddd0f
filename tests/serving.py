"""A real `streamserve serve` on a loopback port, started in the running test's event loop.

    async with serve(ServerConfig(...)) as srv:   # a server of its own for one test
        ...

Async fixtures (tests/server/conftest.py) share one per module where tests need no config of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace

from aiohttp import web

from streamserve.config import ServerConfig
from streamserve.engine import Engine
from streamserve.server.app import Server, start


class RunningServer:
    def __init__(self, server: Server, runner: web.AppRunner, port: int) -> None:
        self.server, self.runner, self.port = server, runner, port
        self.stopped = False

    @classmethod
    async def start(cls, config: ServerConfig, load: Callable[[], Engine], voice: bool = False,
                    vision: bool = False) -> RunningServer:
        """`voice` / `vision`: load the voice models / the vision model too (slower to start; tests of audio and of
        images ask for them)."""
        server = Server(replace(config, host="127.0.0.1", port=0, no_voice=config.no_voice or not voice,
                                no_vision=config.no_vision or not vision), load)
        runner, port = await start(server)
        await asyncio.wait_for(server.ready.wait(), 120)
        assert server.engine is not None, server.load_error
        return cls(server, runner, port)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self) -> Engine:
        assert self.server.engine is not None
        return self.server.engine

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self.runner.cleanup()


@contextlib.asynccontextmanager
async def serve(config: ServerConfig, load: Callable[[], Engine] | None = None,
                voice: bool = False, vision: bool = False) -> AsyncIterator[RunningServer]:
    srv = await RunningServer.start(config, load or default_engine, voice, vision)
    try:
        yield srv
    finally:
        await srv.stop()


@contextlib.contextmanager
def engine_paused(engine: Engine) -> Iterator[None]:
    """Hold the engine between steps: chunks submitted meanwhile cannot run until the block ends."""
    with engine.guard:  # the engine's public "between steps" lock
        yield


@contextlib.contextmanager
def engine_throttled(engine: Engine, hold_s: float = 0.03) -> Iterator[None]:
    """Let the engine run about one step every `hold_s` seconds until the block ends: a thread holds the guard for
    `hold_s`, lets go, and waits its turn again (the engine lets waiters in after each step). A reply of n tokens
    then takes at least n * hold_s, so a test can act while it is still running however fast the machine decodes."""
    stop = threading.Event()

    def hold() -> None:
        while not stop.is_set():
            with engine.guard:
                stop.wait(hold_s)
            time.sleep(0.001)  # the engine takes the guard for its next step here

    thread = threading.Thread(target=hold, name="engine-throttle", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def default_engine() -> Engine:
    return Engine.from_pretrained("default", device="cpu", kv_memory="128MiB")
