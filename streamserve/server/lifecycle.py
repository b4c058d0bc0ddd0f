"""The session service's lifecycle half (split from service.py, whose `SessionService` inherits it): reaping
detached sessions past their resume TTL, and the server's shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from streamserve.engine import Engine
from streamserve.server.context import ClientContext
from streamserve.server.registry import SessionRegistry
from streamserve.server.results import Closed

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.server.chat import ChatSessions
    from streamserve.server.vision import ImageSessions, VisionRuntime
    from streamserve.server.voice.runtime import VoiceRuntime
    from streamserve.server.voice_sessions import VoiceSessions

log = logging.getLogger("streamserve.server")


class ServiceLifecycle:
    """SessionService's reaping and shutdown (a mixin: SessionService holds the state named here)."""

    engine: Engine
    registry: SessionRegistry
    chats: ChatSessions
    audio: VoiceSessions
    images: ImageSessions
    voice: VoiceRuntime | None
    vision: VisionRuntime | None
    tasks: set[asyncio.Task]
    engine_executor: ThreadPoolExecutor
    tokenize_executor: ThreadPoolExecutor
    if TYPE_CHECKING:
        async def run_engine(self, fn: Any, *args: Any, **kw: Any) -> Any: ...

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def reap(self) -> None:
        """Close detached sessions past their resume TTL, and forget sessions the engine closed."""
        for entry in self.registry.expired():
            self.chats.forget(entry.session.id)
            self.audio.forget(entry.session.id)
            self.images.forget(entry.session.id)
            await self.run_engine(entry.session.close)

    def announce_shutdown(self, ctx: ClientContext) -> None:
        for entry in self.registry.owned(ctx):
            ctx.listener.push_nowait(Closed(entry.session.id, "shutdown"))

    async def shutdown(self) -> None:
        """Close every session, stop the engine and the executors (the server's cleanup)."""
        for t in list(self.tasks):
            t.cancel()
        for entry in self.registry.all():
            self.registry.remove(entry.session.id)
            await self.audio.free_all(entry.session.id)
            await self.run_engine(entry.session.close)
        await self.run_engine(self.engine.shutdown)
        self.engine_executor.shutdown(wait=False)
        self.tokenize_executor.shutdown(wait=False)
        if self.voice is not None:
            self.voice.close()
        self.images.close()
        if self.vision is not None:
            self.vision.close()
