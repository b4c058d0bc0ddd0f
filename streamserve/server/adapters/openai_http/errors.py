"""OpenAI's error shape for the HTTP APIs: `{"error": {"message", "type", "param", "code"}}`, with the status the
SDK maps to its exception classes (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 409 ConflictError,
429 RateLimitError, 503 InternalServerError...). The session service's typed errors become these answers here."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from streamserve.errors import CapacityError, InvalidInputError, SessionNotFoundError, StreamserveError
from streamserve.server.service.results import QuotaExceededError, ServiceError, service_error

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
         503: "server_error"}
BUSY_CODES = {"server_busy", "engine_failed", "too_many_sessions"}  # 503: retry elsewhere or later


class ApiError(Exception):
    """An answer in OpenAI's error shape; `param` names the request field at fault (`input[2].content`)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def not_found(kind: str, object_id: str, param: str | None = None) -> ApiError:
    """An unknown id, or one another key made (never told apart: the answer says nothing of other keys' objects)."""
    return ApiError(404, f"No {kind} found with id '{object_id}'.", "not_found", param)


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


def from_exception(e: BaseException) -> ApiError:
    """A failure of the session service or the engine as an OpenAI error: a typed one keeps its code and message
    (bad input 400, a quota 429, capacity 503); anything else is a 500 with the request id the log also has."""
    if isinstance(e, ApiError):
        return e
    if isinstance(getattr(e, "error", None), ServiceError):  # pushed by the service for a turn's chunk or reply
        err = e.error  # type: ignore[attr-defined]
        status = 429 if err.code == "quota_exceeded" else 500 if err.code == "internal_error" else 400
        return ApiError(status, err.message, err.code)
    if isinstance(e, SessionNotFoundError):
        return ApiError(404, str(e), e.code)
    if isinstance(e, QuotaExceededError):
        return ApiError(429, str(e), e.code)
    if isinstance(e, InvalidInputError):
        return ApiError(400, str(e), e.code)
    if isinstance(e, CapacityError) or (isinstance(e, StreamserveError) and e.code in BUSY_CODES):
        return ApiError(503, str(e), e.code)
    err = service_error(e)  # logs an unexpected one with its request id
    if isinstance(e, StreamserveError):
        return ApiError(400 if err.code != "internal_error" else 500, err.message, err.code)
    return ApiError(500, f"{err.message} (request id {err.request_id})", err.code)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's body as a JSON object, or a 400 in OpenAI's shape."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise bad("We could not parse the JSON body of your request.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.", code="invalid_json")
    return body
