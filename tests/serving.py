"""A real `streamserve serve` on a loopback port, in a thread of the test process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from streamserve.config import ServerConfig
from streamserve.engine import Engine
from streamserve.server.app import Server, start


class RunningServer:
    def __init__(self, config: ServerConfig, load: Callable[[], Engine]) -> None:
        self.server = Server(replace(config, host="127.0.0.1", port=0), load)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = self.call(start(self.server))
        self.call(asyncio.wait_for(self.server.ready.wait(), 120))
        assert self.server.engine is not None, self.server.load_error

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)

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

    def stop(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def default_engine() -> Engine:
    return Engine.from_pretrained("default", device="cpu", kv_memory="128MiB")
