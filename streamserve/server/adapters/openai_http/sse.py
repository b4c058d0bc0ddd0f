"""Server-sent events as the `openai` SDK reads them: `event: <type>` (Responses) and `data: <json>` lines."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


class EventStream:
    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                    "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.sequence = 0  # the Responses events' sequence_number

    async def start(self) -> None:
        """Send the head (once): a stream starts at its first event, so a request refused before it gets a status."""
        if not self.response.prepared:
            await self.response.prepare(self.request)

    async def data(self, payload: dict[str, Any] | str) -> None:
        text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
        await self.start()
        await self.response.write(f"data: {text}\n\n".encode())

    async def event(self, kind: str, **fields: Any) -> None:
        """A Responses event: its type, its sequence number, its fields."""
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        await self.response.write(f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode())

    async def end(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response
