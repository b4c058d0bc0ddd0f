"""The OpenAI HTTP routes on the server's app: each handler answers its own ApiError in OpenAI's shape."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from streamserve.server.adapters.openai_http.audio import AudioRoutes
from streamserve.server.adapters.openai_http.chat_completions import ChatCompletions
from streamserve.server.adapters.openai_http.conversations import Conversations
from streamserve.server.adapters.openai_http.errors import ApiError, from_exception
from streamserve.server.adapters.openai_http.host import Host
from streamserve.server.adapters.openai_http.responses import Responses
from streamserve.server.adapters.openai_http.store import ObjectStore, Resume, Stored
from streamserve.server.adapters.openai_http.turns import Turns
from streamserve.server.transports.clients import expect

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
STARTED = int(time.time())


def answering(handler: Handler) -> Handler:
    """Any failure of `handler` becomes OpenAI's error shape (a typed one keeps its status and code)."""
    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception as e:
            return from_exception(e).response()
    return wrapped


class OpenAIHttp:
    """The adapter: owns the HTTP APIs' sessions and stored state for the server's lifetime."""

    def __init__(self, server: Any) -> None:  # server/app.py `Server` (host.py ServerState, and its config)
        self.host = Host(server)
        c = server.config
        self.store = ObjectStore(c.max_stored_responses_bytes, c.stored_responses_ttl, c.snapshot_store, self.gone)
        self.turns = Turns(self.host.service, self.parked, c.stored_responses_ttl)
        self.session_ttl = c.http_session_ttl
        self.audio, self.chat = AudioRoutes(self.host), ChatCompletions(self)
        self.responses, self.conversations = Responses(self), Conversations(self)

    def routes(self) -> list[web.RouteDef]:
        table: list[tuple[str, str, Handler]] = [
            ("GET", "/v1/models", self.models), ("GET", "/v1/models/{model}", self.model), *self.chat.table(),
            *self.responses.table(), *self.conversations.table(), *self.audio.table()]
        return [web.route(method, path, answering(handler), expect_handler=expect) for method, path, handler in table]

    # ---- sessions and stored state over time ---------------------------------------------------------------
    def gone(self, obj: Stored) -> None:
        """A stored object left (deleted, evicted, expired): the session holding its state goes too."""
        owner = self.turns.owners.get(obj.owner)
        res = None if owner is None else owner.residents.get(obj.session_id or "")
        if owner is not None and res is not None and res.holder == obj.id:
            self.host.service().spawn(self.turns.let_go(owner, res.id))

    def parked(self, holder: str, session_id: str, resume: Resume | None) -> None:
        """A session holding `holder`'s state was parked (`resume`: where) or closed (None)."""
        obj = self.store.objects.get(holder)
        if obj is not None and obj.session_id == session_id:
            obj.resume, obj.session_id = resume, None

    async def reap(self) -> None:
        """The server's reaper, every second: stored objects past their TTL, sessions idle past theirs."""
        self.store.expire()
        await self.turns.reap(self.session_ttl)

    async def hand_off(self, moved: set[str]) -> None:
        """A drain handed these sessions over to the snapshot store: their holders say where, and every stored
        object is written there too, for the instance that gets the next request (store.py)."""
        for obj in self.store.objects.values():
            owner = self.turns.owners.get(obj.owner)
            res = None if owner is None else owner.residents.get(obj.session_id or "")
            if res is not None and res.id in moved:
                obj.resume = Resume(res.id, res.token)
        await asyncio.to_thread(self.store.persist())  # the objects serialised here, on the loop; written there

    def held(self) -> int:
        """Sessions the HTTP APIs hold now (for the leak checks)."""
        return sum(len(o.residents) for o in self.turns.owners.values())

    # ---- models --------------------------------------------------------------------------------------------
    def model_object(self) -> dict[str, object]:
        return {"id": self.host.model_name(), "object": "model", "created": STARTED, "owned_by": "streamserve"}

    async def models(self, request: web.Request) -> web.Response:
        self.host.owner(request)
        return web.json_response({"object": "list", "data": [self.model_object()]})

    async def model(self, request: web.Request) -> web.Response:
        self.host.owner(request)
        name = request.match_info["model"]
        if name not in (self.host.model_name(), "default"):
            raise ApiError(404, f"The model '{name}' does not exist.", "model_not_found", "model")
        return web.json_response(self.model_object())
