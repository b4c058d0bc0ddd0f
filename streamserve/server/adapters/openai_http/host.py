"""What every OpenAI HTTP route needs of the server: the session service once the model is ready, and who is asking.

Auth is the server's (server/service/auth.py): with an API key configured, `Authorization: Bearer <key>`; without one,
any bearer or none. A client secret is refused here: it opens one Realtime session, not stored state. Stored state
(responses, conversations, reusable chat sessions) belongs to an *owner*: the sha256 of the bearer presented, so
that on a server without a key two clients with different keys never see each other's ids (404, as an unknown id).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from aiohttp import web

from streamserve.server.adapters.openai_http.errors import ApiError
from streamserve.server.adapters.openai_http.store import ObjectStore
from streamserve.server.adapters.openai_http.turns import Turns
from streamserve.server.service.auth import SECRET_PREFIX, Authenticator, bearer
from streamserve.server.service.service import SessionService
from streamserve.server.transports.http_replies import utf8


class ServerState(Protocol):
    """What the HTTP APIs read of the server (server/app.py `Server`)."""

    load_error: BaseException | None
    service: SessionService | None
    auth: Authenticator

    @property
    def engine_died(self) -> BaseException | None: ...


class Host:
    def __init__(self, server: ServerState) -> None:
        self.server = server

    def service(self) -> SessionService:
        """The session service, or 503 while the model loads (or after it failed to)."""
        s = self.server
        if s.load_error is not None or s.engine_died is not None:
            raise ApiError(503, "The model failed; see the server log.", "engine_failed")
        if s.service is None:
            raise ApiError(503, "The model is still loading; retry shortly.", "model_loading")
        return s.service

    def owner(self, request: web.Request) -> str:
        """The owner of the request's stored state (see the module's docstring), or 401 in OpenAI's shape."""
        given = bearer(request.headers.get("Authorization"))
        if given is not None and not utf8(given):
            given = None if not self.server.auth.required else "\x00"  # never a key of ours
        if given is not None and given.startswith(SECRET_PREFIX):
            raise ApiError(401, "A client secret opens one Realtime session; the HTTP APIs take the API key.",
                           "invalid_api_key")
        if self.server.auth.required and not self.server.auth.is_api_key(given):
            raise ApiError(401, "Incorrect API key provided: send 'Authorization: Bearer <api key>'.",
                           "invalid_api_key")
        return hashlib.sha256((given or "").encode()).hexdigest()[:32]

    def model_name(self) -> str:
        return self.service().engine.name

    def check_model(self, model: object, param: str = "model") -> None:
        """`model` names what this server serves (its name, or "default"); a missing one is taken as it."""
        if model is None:
            return
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string.", "invalid_type", param)
        if model not in (self.model_name(), "default"):
            raise ApiError(404, f"The model '{model}' does not exist: this server serves '{self.model_name()}' "
                           "(GET /v1/models).", "model_not_found", param)


class Api(Protocol):
    """What the routes' halves (chat_completions.py, responses.py, conversations.py) share: routes.py `OpenAIHttp`."""

    host: Host
    store: ObjectStore
    turns: Turns
