"""What every protocol adapter shares: one connection of one wire format, over the session service and a
transport. A subclass says how it greets a client, how it handles one frame, and how it renders a result
the service pushes (a chunk's result, a reply's delta or end, a session moved or closed) as frames;
the read loop, the service's `ResultListener` side and the detach on disconnect are here, once.

    native.py     NativeConnection (msgpack maps, docs/protocol.md)
    (next)        an OpenAI Realtime adapter (JSON events), an openpi adapter, over the same service
"""

from __future__ import annotations

import abc

from streamserve.server.service.auth import Grant
from streamserve.server.service.results import Pushed
from streamserve.server.service.service import SessionService
from streamserve.server.transports.transport import Frame, Transport


class ProtocolAdapter(abc.ABC):
    def __init__(self, service: SessionService, transport: Transport, grant: Grant) -> None:
        self.service, self.transport = service, transport
        self.ctx = service.connect(self, grant)
        transport.on_detach(lambda: service.disconnect(self.ctx))  # replies end, sessions wait for a resume

    @abc.abstractmethod
    async def greet(self) -> None:
        """What the server says first (or nothing)."""

    @abc.abstractmethod
    async def handle(self, frame: Frame) -> None:
        """One client frame: decode, call the service, answer. Never raises for the client's mistakes."""

    @abc.abstractmethod
    def render_pushed(self, result: Pushed) -> list[Frame]:
        """A result the service pushes -> the frames that tell the client (one or more, in order)."""

    # ---- the service's ResultListener -------------------------------------------------------------------
    async def push(self, result: Pushed) -> None:
        for frame in self.render_pushed(result):
            await self.transport.send(frame)

    def push_nowait(self, result: Pushed) -> bool:
        return all([self.transport.send_nowait(frame) for frame in self.render_pushed(result)])

    # ---- lifecycle -------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Serve the connection until the client leaves or it fails; whatever ends it, finish the transport
        (detach callbacks once, bounded flush)."""
        self.transport.start()
        try:
            await self.greet()
            async for frame in self.transport.frames():
                await self.handle(frame)
        finally:
            await self.transport.finish()
