"""An SGLang server's HTTP API, as the SGLang backend uses it: streaming sessions, generation, abort, health.

Every call runs on the backend's own event loop (remote/worker.py), never on the server's. The calls map one to one
onto SGLang's endpoints (sglang.srt.entrypoints.http_server):

    open_session   POST /open_session  {"session_id", "capacity_of_str_len", "streaming": true}  -> the id
    close_session  POST /close_session {"session_id"}                                          (200 even if unknown)
    prefill        POST /generate      {"input_ids", "session_params": {"id"}, "sampling_params":
                                        {"max_new_tokens": 0}}                    the ids join the session's context
    stream         POST /generate      {... "stream": true}  -> SSE `data: {...}` lines, then `data: [DONE]`
    abort          POST /abort_request {"rid"}                SGLang drops the aborted turn whole (input and output)

A streaming session takes one request at a time and builds each turn's context as the previous context, the previous
output and the new input ids. A failed connection, or a stream that ends without `[DONE]` (the server died: its
launcher kills its processes a few seconds after a crash), raises `BackendUnavailableError`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from streamserve.errors import StreamserveError

CAPACITY_OF_STR_LEN = 1 << 16  # required by /open_session, unused by streaming sessions


class BackendUnavailableError(StreamserveError):
    """The SGLang server cannot be reached, or died while serving a request: the sessions on it are gone."""

    code = "backend_unavailable"


class BackendRequestError(StreamserveError):
    """SGLang answered a request with an error (the message says which and why)."""

    code = "backend_error"


class SGLangHTTP:
    def __init__(self, url: str, connect_timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
        self._http: aiohttp.ClientSession | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:  # made on the backend's loop, at its first use
            self._http = aiohttp.ClientSession(timeout=self._timeout)
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            async with self.http.post(self.url + path, json=body) as r:
                raw = await r.read()
        except (aiohttp.ClientError, OSError) as e:
            raise BackendUnavailableError(f"the SGLang server at {self.url} cannot be reached ({type(e).__name__}: "
                                          f"{e}); its sessions are gone") from None
        if r.status != 200:
            raise BackendRequestError(f"SGLang answered {path} with HTTP {r.status}: {_message(raw)}")
        return json.loads(raw) if raw.strip() else None

    async def get_json(self, path: str) -> Any:
        try:
            async with self.http.get(self.url + path) as r:
                raw = await r.read()
        except (aiohttp.ClientError, OSError) as e:
            raise BackendUnavailableError(f"the SGLang server at {self.url} cannot be reached ({type(e).__name__}: "
                                          f"{e})") from None
        if r.status != 200:
            raise BackendRequestError(f"SGLang answered GET {path} with HTTP {r.status}: {_message(raw)}")
        return json.loads(raw)

    async def get_text(self, path: str) -> str | None:
        """A GET's body, or None when the endpoint is absent or failing (e.g. /metrics without --enable-metrics)."""
        try:
            async with self.http.get(self.url + path) as r:
                return (await r.text()) if r.status == 200 else None
        except (aiohttp.ClientError, OSError):
            return None

    async def healthy(self) -> bool:
        try:
            async with self.http.get(self.url + "/health") as r:
                return r.status == 200
        except (aiohttp.ClientError, OSError):
            return False

    # ---- sessions ------------------------------------------------------------------------------------
    async def open_session(self, session_id: str) -> None:
        got = await self._post("/open_session", {"session_id": session_id, "capacity_of_str_len": CAPACITY_OF_STR_LEN,
                                                 "streaming": True})
        if got != session_id:
            raise BackendRequestError(f"SGLang opened session {got!r} where {session_id!r} was asked for")

    async def close_session(self, session_id: str) -> None:
        await self._post("/close_session", {"session_id": session_id})

    async def prefill(self, session_id: str, ids: list[int], rid: str) -> dict[str, Any]:
        """Append `ids` to the session's context without generating; -> SGLang's meta_info."""
        out = await self._post("/generate", {"input_ids": ids, "session_params": {"id": session_id}, "rid": rid,
                                             "sampling_params": {"max_new_tokens": 0}})
        return out["meta_info"]

    async def stream(self, session_id: str, ids: list[int], rid: str, sampling: dict[str, Any]
                     ) -> AsyncIterator[dict[str, Any]]:
        """Generate after `ids`; yields each SSE chunk ({"output_ids" (all so far), "meta_info", ...})."""
        body = {"input_ids": ids, "session_params": {"id": session_id}, "rid": rid, "stream": True,
                "sampling_params": sampling}
        try:
            async with self.http.post(self.url + "/generate", json=body) as r:
                if r.status != 200:
                    raise BackendRequestError(f"SGLang answered /generate with HTTP {r.status}: "
                                              f"{_message(await r.read())}")
                async for line in r.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise BackendRequestError(f"SGLang failed the reply: {_message(data)}")
                    yield chunk
        except (aiohttp.ClientError, OSError) as e:
            raise BackendUnavailableError(f"the SGLang server at {self.url} failed during a reply "
                                          f"({type(e).__name__}: {e}); its sessions are gone") from None
        raise BackendUnavailableError(f"the SGLang server at {self.url} ended a reply without finishing it (it "
                                      "died); its sessions are gone")

    async def abort(self, rid: str) -> None:
        await self._post("/abort_request", {"rid": rid})


def _message(raw: bytes) -> str:
    """SGLang's error message from a body ({"error": {"message"}} or {"detail"}), else the body, short."""
    try:
        body = json.loads(raw)
        if isinstance(body, dict):
            err = body.get("error", body.get("detail", body))
            return str(err.get("message", err) if isinstance(err, dict) else err)[:300]
    except ValueError:
        pass
    return raw[:300].decode(errors="replace")
