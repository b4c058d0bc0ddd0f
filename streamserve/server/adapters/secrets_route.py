"""`POST /v1/realtime/client_secrets`: OpenAI's request and response shape, so that the official `openai`
SDK's `client.realtime.client_secrets.create()` works against this server (`client_secrets_route`, at the end, is
the route; `mint_client_secret` does no I/O).

Request (all optional): `{"expires_after": {"anchor": "created_at", "seconds": 10..7200 (default 600)},
"session": {"type": "realtime", ...}}`. Response: `{"value": "ek_...", "expires_at": <unix seconds>,
"session": {"type": "realtime", "object": "realtime.session", "id": "sess_...", "model": ..., ...}}`.
Errors use OpenAI's shape: `{"error": {"message", "type", "code", "param"}}`.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from aiohttp import web

from streamserve.server.service.auth import DEFAULT_SECRET_TTL, MAX_SECRET_TTL, MIN_SECRET_TTL, Authenticator
from streamserve.server.transports.http_replies import openai_error

ECHOED_SESSION_FIELDS = ("instructions", "max_output_tokens", "output_modalities", "include", "tracing")


def bad_request(code: str, message: str, param: str | None = None, status: int = 400) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "code": code, "param": param}}


def mint_client_secret(auth: Authenticator, body: Any, model: str | None) -> tuple[int, dict[str, Any]]:
    """The parsed request body -> (HTTP status, JSON answer)."""
    if not isinstance(body, dict):
        return bad_request("invalid_type", "the body must be a JSON object")
    unknown = sorted(set(body) - {"expires_after", "session"})
    if unknown:
        return bad_request("unknown_parameter", f"unknown parameter(s) {unknown}", unknown[0])
    expires = body.get("expires_after") or {}
    if not isinstance(expires, dict) or set(expires) - {"anchor", "seconds"}:
        return bad_request("invalid_value", "expires_after must be {anchor, seconds}", "expires_after")
    if expires.get("anchor", "created_at") != "created_at":
        return bad_request("invalid_value", "expires_after.anchor must be 'created_at'", "expires_after.anchor")
    seconds = expires.get("seconds", DEFAULT_SECRET_TTL)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not MIN_SECRET_TTL <= seconds <= MAX_SECRET_TTL:
        return bad_request("invalid_value", f"expires_after.seconds must be an integer from {MIN_SECRET_TTL} to "
                                            f"{MAX_SECRET_TTL}", "expires_after.seconds")
    session = body.get("session") or {}
    if not isinstance(session, dict):
        return bad_request("invalid_type", "session must be an object", "session")
    if session.get("type", "realtime") != "realtime":
        return bad_request("unsupported_value", "only realtime sessions are served here", "session.type")
    try:
        value, record = auth.mint(seconds)
    except OverflowError:
        return bad_request("rate_limit_exceeded", "too many live client secrets; retry when some expire",
                           status=429)
    answer_session = {"type": "realtime", "object": "realtime.session", "id": "sess_" + secrets.token_urlsafe(12),
                      "model": session.get("model", model), "expires_at": int(record.expires_at),
                      **{k: session[k] for k in ECHOED_SESSION_FIELDS if k in session}}
    return 200, {"value": value, "expires_at": int(record.expires_at), "session": answer_session}


async def client_secrets_route(server: Any, request: web.Request) -> web.Response:
    """The route: minted with the API key only (a client secret cannot mint more)."""
    if not server.operator(request):
        return openai_error(401, "invalid_api_key", "send 'Authorization: Bearer <api key>'")
    try:
        body = await request.json() if request.can_read_body else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return openai_error(400, "invalid_json", "the body must be a JSON object")
    status, answer = mint_client_secret(server.auth, body, server.engine.name if server.engine else None)
    return web.json_response(answer, status=status)
