"""The HTTP answers the server's routes share: typed JSON errors (ours and OpenAI's shape) and the UTF-8 check
of header text."""

from __future__ import annotations

from typing import Any

from aiohttp import web


def utf8(header_text: str) -> bool:
    """Whether a header's text was UTF-8 on the wire: aiohttp keeps other bytes as lone surrogates, which
    str.encode() raises on (the credential checks, request.clone): a 500, found by tests/server/test_fuzz_http.py."""
    try:
        header_text.encode()
    except UnicodeEncodeError:
        return False
    return True


def error_response(status: int, code: str, message: str, request_id: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if request_id is not None:
        body["request_id"] = request_id
    return web.json_response(body, status=status, headers=headers)


def unauthorized() -> web.Response:
    return error_response(401, "unauthorized", "send 'Authorization: Bearer <api key or client secret>', or "
                          "the WebSocket subprotocol 'openai-insecure-api-key.<key or secret>'",
                          headers={"WWW-Authenticate": "Bearer"})


def openai_error(status: int, code: str, message: str) -> web.Response:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": code, "param": None}},
                             status=status)
