"""Helpers of the /v1/realtime tests: a raw JSON WebSocket client, and the strict event models clients parse with
(the `openai` SDK's GA models, validated, and pipecat's parser)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import websockets
from pydantic import TypeAdapter

EVENT_TIMEOUT = 60.0


def check_event(message: dict[str, Any]) -> None:
    """`message` validates against the openai SDK's GA server-event union (strictly) and pipecat's parser."""
    from openai.types.realtime.realtime_server_event import RealtimeServerEvent
    from pipecat.services.openai.realtime import events as pipecat_events

    assert isinstance(message.get("event_id"), str) and message["event_id"], message
    model = TypeAdapter(RealtimeServerEvent).validate_python(message)
    missing = set(type(model).model_fields) - set(message)
    assert not missing, f"{message['type']} lacks {missing}"  # every field the GA model defines is sent
    pipecat_events.parse_server_event(json.dumps(message))


class RawRealtime:
    """One /v1/realtime connection speaking JSON by hand; every event received is checked with `check_event`."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.seen: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, http_url: str, **kw: Any) -> RawRealtime:
        ws = await websockets.connect(http_url.replace("http", "ws", 1) + "/v1/realtime?model=default", **kw)
        conn = cls(ws)
        created = await conn.recv()
        assert created["type"] == "session.created", created
        return conn

    async def send(self, message: dict[str, Any] | str) -> None:
        await self.ws.send(message if isinstance(message, str) else json.dumps(message))

    async def recv(self) -> dict[str, Any]:
        message = json.loads(await asyncio.wait_for(self.ws.recv(), EVENT_TIMEOUT))
        check_event(message)
        self.seen.append(message)
        return message

    async def until(self, kind: str) -> list[dict[str, Any]]:
        """Events up to and including the first of type `kind`."""
        got = []
        while True:
            m = await self.recv()
            got.append(m)
            if m["type"] == kind:
                return got

    async def error(self) -> dict[str, Any]:
        """The next error event's error (events before it are skipped)."""
        return (await self.until("error"))[-1]["error"]

    async def close(self) -> None:
        await self.ws.close()


def user_text(text: str, previous_item_id: str | None = None, **item: Any) -> dict[str, Any]:
    event = {"type": "conversation.item.create",
             "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **item}}
    return event if previous_item_id is None else {**event, "previous_item_id": previous_item_id}
