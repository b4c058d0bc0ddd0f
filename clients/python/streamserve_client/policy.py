"""A robot's client of streamserve's policy endpoint (`WS /v1/policy`, openpi's protocol and its extensions).

    async with PolicyClient("ws://127.0.0.1:8000") as policy:      # /v1/policy is added to a URL with no path
        print(policy.metadata["action_horizon"])
        out = await policy.infer({"observation/state": state}, deadline_ms=40)
        if out["stale"]: ...                                       # late: the last chunk's remaining actions
        chunk = out["actions"]                                     # float32 [H, D] (fewer rows when stale)
        await policy.reset()                                       # a new episode

    with SyncPolicyClient("ws://127.0.0.1:8000") as policy:        # the same, blocking, for control loops
        chunk = policy.infer(obs)["actions"]

The wire is openpi's: msgpack maps whose NumPy arrays travel as {b"__ndarray__": True, b"data", b"dtype", b"shape"}
(scalars as __npgeneric__). The server speaks first with the metadata; one reply per observation; an error is a
text frame followed by close 1011, raised here as a typed error. `send` + `receive` pipeline observations: the
server keeps at most one waiting and a newer one replaces it (latest observation wins: the replaced one gets no
reply), so a loop that sends every tick and reads what comes never falls behind. NumPy 1.26 and 2.x; no torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgpack
import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection

from streamserve_client.errors import (
    CallTimeoutError,
    ConnectionLostError,
    InvalidInputError,
    ProtocolViolationError,
    ServerBusyError,
    StreamserveClientError,
    UnauthorizedError,
    from_message,
)

PATH = "/v1/policy"
CLOSE_TIMEOUT_S = 2.0
METADATA_TIMEOUT_S = 10.0
T = TypeVar("T")


def packb(obj: Any) -> bytes:
    """Dicts, lists, numbers, strings and NumPy arrays/scalars -> one frame in openpi's encoding."""
    return msgpack.packb(obj, default=_pack, use_bin_type=True)


def _pack(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind not in "biuf":
        raise TypeError(f"arrays of dtype {obj.dtype} cannot be sent (bool, integers and floats only)")
    if isinstance(obj, np.ndarray):
        # tobytes() is C order whatever the strides (ascontiguousarray would make a 0-d array 1-d)
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send {type(obj).__name__}")


def unpackb(frame: bytes) -> Any:
    """A server frame -> Python values with NumPy arrays (ProtocolViolationError when it is not openpi's encoding)."""
    try:
        return _walk(msgpack.unpackb(frame, raw=False, strict_map_key=False))
    except (ValueError, TypeError, KeyError, msgpack.exceptions.UnpackException) as e:
        raise ProtocolViolationError(f"the server sent a frame that is not msgpack-NumPy: {e}") from None


def _walk(v: Any) -> Any:
    if isinstance(v, dict):
        get = {k.decode() if isinstance(k, bytes) else k: x for k, x in v.items()}
        if get.get("__ndarray__") is True:
            dt = np.dtype(get["dtype"])
            if dt.kind not in "biuf":
                raise ValueError(f"dtype {dt} is not numeric")
            return np.frombuffer(get["data"], dtype=dt).reshape(get["shape"])
        if get.get("__npgeneric__") is True:
            return np.dtype(get["dtype"]).type(get["data"])
        return {k: _walk(x) for k, x in get.items()}
    if isinstance(v, list):
        return [_walk(x) for x in v]
    return v


def policy_url(url: str) -> str:
    """`ws://host:port` -> `ws://host:port/v1/policy`; a URL with a path (`/` on a --policy-port) is kept."""
    return url + PATH if not urlsplit(url).path else url


def _error(text: str) -> StreamserveClientError:
    """The server's error frame `code: message` -> a typed error."""
    code, sep, message = text.partition(": ")
    if not sep or " " in code:
        code, message = "internal_error", text
    err = from_message({"code": code, "message": message, "fatal": True})  # the native protocol's families
    if type(err) is StreamserveClientError and code.startswith("invalid_"):  # e.g. invalid_observation
        err = InvalidInputError(message, code=code, fatal=True)
    return err


class PolicyClient:
    def __init__(self, url: str, api_key: str | None = None, max_frame_bytes: int = 1 << 24) -> None:
        self.url, self.api_key, self.max_frame_bytes = policy_url(url), api_key, max_frame_bytes
        self.ws: ClientConnection | None = None
        self.metadata: dict[str, Any] = {}
        self.failed: StreamserveClientError | None = None
        self._lock = asyncio.Lock()  # infer/reset: one observation in flight, its reply read by its caller

    async def __aenter__(self) -> PolicyClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> dict[str, Any]:
        """Open the connection; -> the policy's metadata (also `self.metadata`)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            self.ws = await websockets.connect(self.url, additional_headers=headers, max_size=self.max_frame_bytes,
                                               close_timeout=CLOSE_TIMEOUT_S, compression=None)
        except websockets.InvalidStatus as e:
            if e.response.status_code == 401:
                raise UnauthorizedError("the server wants an API key (api_key=...) or a different one") from None
            raise
        try:
            meta = await asyncio.wait_for(self.receive(), METADATA_TIMEOUT_S)
        except asyncio.TimeoutError:
            await self.close()
            raise ConnectionLostError(f"the server sent no metadata within {METADATA_TIMEOUT_S:.0f} s") from None
        except BaseException:
            await self.close()
            raise
        self.metadata = meta
        return meta

    @staticmethod
    def observation(obs: dict[str, Any], deadline_ms: float | None = None, deadline: float | None = None,
                    timestamp: float | None = None, step: int | None = None, reset: bool = False,
                    action_prefix: Any = None) -> dict[str, Any]:
        """An observation with streamserve's extension fields set (those given). `action_prefix` (real-time
        chunking): the actions [k, D], k < H, the robot executes from `step` on while the reply is computed (e.g.
        `ActionQueue.rows(step, k)`); the reply's first k rows are these, and only the rest is decoded."""
        out = dict(obs)
        for key, v in (("deadline_ms", deadline_ms), ("deadline", deadline), ("timestamp", timestamp)):
            if v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise InvalidInputError(f"{key} must be a finite number, got {v!r}")
                out[key] = float(v)
        if step is not None:
            out["step"] = int(step)
        if reset:
            out["reset"] = True
        if action_prefix is not None:
            prefix = np.asarray(action_prefix, dtype=np.float32)
            if prefix.size and (prefix.ndim != 2 or not np.isfinite(prefix).all()):
                raise InvalidInputError(f"action_prefix is a finite [k, D] array, got shape {list(prefix.shape)}")
            out["action_prefix"] = prefix
        return out

    async def send(self, obs: dict[str, Any], **extensions: Any) -> None:
        """Send an observation without waiting for its reply (pipelining; latest observation wins on the server)."""
        if self.failed is not None:
            raise self.failed.copy()
        if self.ws is None:
            raise ConnectionLostError("not connected")
        try:
            await self.ws.send(packb(self.observation(obs, **extensions)))
        except websockets.ConnectionClosed as e:
            raise await self._closed(e) from None

    async def receive(self) -> dict[str, Any]:
        """The next frame from the server: a reply (a map), or its error raised."""
        if self.failed is not None:
            raise self.failed.copy()
        if self.ws is None:
            raise ConnectionLostError("not connected")
        try:
            frame = await self.ws.recv()
        except websockets.ConnectionClosed as e:
            raise await self._closed(e) from None
        if isinstance(frame, str):  # openpi's error convention: the text, then close 1011
            self.failed = _error(frame)
            await self.close()
            raise self.failed.copy()
        reply = unpackb(frame)
        if not isinstance(reply, dict):
            raise ProtocolViolationError("the server sent a frame that is not a map")
        return reply

    async def _closed(self, e: websockets.ConnectionClosed) -> StreamserveClientError:
        """The connection is closed: the server's error frame, if it sent one that is still unread (it may have
        come while this client was not reading, e.g. just before a send), else why it closed."""
        while self.ws is not None:
            try:
                frame = await asyncio.wait_for(self.ws.recv(), CLOSE_TIMEOUT_S)
            except (websockets.ConnectionClosed, asyncio.TimeoutError):
                break
            if isinstance(frame, str):
                self.failed = _error(frame)
                return self.failed.copy()
        if e.rcvd is not None and e.rcvd.code == 1013:
            self.failed = ServerBusyError(f"server busy: {e.rcvd.reason}", code="busy")
        else:
            self.failed = ConnectionLostError(f"the connection closed: {e}")
        return self.failed.copy()

    async def infer(self, obs: dict[str, Any], deadline_ms: float | None = None, deadline: float | None = None,
                    timestamp: float | None = None, step: int | None = None,
                    action_prefix: Any = None) -> dict[str, Any]:
        """One observation -> its reply: `actions` float32 [H, D], `server_timing`, and streamserve's `stale`,
        `valid_from_step`, `episode` (and `timestamp`, echoed). `deadline_ms` / `deadline` (Unix seconds): a
        reply that would be late comes at the deadline with `stale: True` and the previous chunk's remaining
        actions. `action_prefix`: see `observation` (real-time chunking)."""
        async with self._lock:
            await self.send(obs, deadline_ms=deadline_ms, deadline=deadline, timestamp=timestamp, step=step,
                            action_prefix=action_prefix)
            return await self.receive()

    async def reset(self, obs: dict[str, Any] | None = None, **extensions: Any) -> dict[str, Any]:
        """Start a new episode (a fresh session on the server). Without `obs` the reply is {"reset": True,
        "episode": n, ...}; with one, it is that observation's reply on the new episode."""
        async with self._lock:
            await self.send(obs or {}, reset=True, **extensions)
            return await self.receive()

    async def close(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            await ws.close()


class SyncPolicyClient:
    """PolicyClient on a private event-loop thread, for blocking control loops."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float | None = 30.0) -> None:
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamserve-policy", daemon=True)
        self._thread.start()
        self.client = PolicyClient(url, api_key)
        try:
            self.run(self.client.connect())
        except BaseException:
            self._stop()
            raise

    @property
    def metadata(self) -> dict[str, Any]:
        return self.client.metadata

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(self.timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise CallTimeoutError(f"the call took longer than {self.timeout} s; it was cancelled") from None
        except BaseException:
            fut.cancel()
            raise

    def infer(self, obs: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return self.run(self.client.infer(obs, **kw))

    def reset(self, obs: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        return self.run(self.client.reset(obs, **kw))

    def send(self, obs: dict[str, Any], **kw: Any) -> None:
        self.run(self.client.send(obs, **kw))

    def receive(self) -> dict[str, Any]:
        return self.run(self.client.receive())

    def __enter__(self) -> SyncPolicyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self.run(self.client.close())
            finally:
                self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()
