"""A blocking client for scripts and control loops: the asyncio client on a private event-loop thread.

    with streamserve_client.SyncClient("ws://127.0.0.1:8000") as client:
        s = client.open_session()
        s.append(text="In the beginning")
        for delta in s.respond(max_tokens=16):
            print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from streamserve_client.client import Client
from streamserve_client.session import Ack, Delta, Response, Session

T = TypeVar("T")


class SyncClient:
    def __init__(self, url: str, api_key: str | None = None, reconnect: bool = True, timeout: float | None = 60.0):
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamserve-client", daemon=True)
        self._thread.start()
        self._client = Client(url, api_key=api_key, reconnect=reconnect)
        try:
            self._run(self._client.connect())
        except BaseException:
            self._stop()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self.timeout)

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def hello(self) -> dict[str, Any]:
        return self._client.hello

    def open_session(self, window: int | None = None, sinks: int | None = None, positions: str | None = None,
                     chunk_budget_ms: float | None = None, drafter: str | None = None,
                     **sampling: Any) -> SyncSession:
        return SyncSession(self, self._run(self._client.open_session(window, sinks, positions, chunk_budget_ms,
                                                                     drafter, **sampling)))

    def resume_session(self, session_id: str, resume_token: str) -> SyncSession:
        return SyncSession(self, self._run(self._client.resume_session(session_id, resume_token)))

    def stats(self) -> dict[str, Any]:
        return self._run(self._client.stats())

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._run(self._client.close())
            finally:
                self._stop()

    def _stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class SyncSession:
    def __init__(self, client: SyncClient, session: Session) -> None:
        self._c, self._s = client, session
        self.id, self.resume_token = session.id, session.resume_token

    def append(self, text: str | None = None, token_ids: list[int] | None = None, audio: Any = None,
               image: Any = None, **kw: Any) -> Ack:
        return self._c._run(self._s.append(text, token_ids, audio, image, **kw))

    def respond(self, **params: Any) -> Iterator[Delta]:
        """Yield the reply's deltas as they come; closing the iterator early cancels the reply."""
        r: Response = self._s.respond(**params)
        try:
            while True:
                try:
                    yield self._c._run(r.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if r.finish_reason is None and r._started:
                self.cancel()
                self._c._run(r.wait())
            self.finish_reason = r.finish_reason

    def cancel(self) -> None:
        self._c._run(self._s.cancel())

    def rewind(self, to_seq: int | None = None, to: int | None = None) -> int:
        return self._c._run(self._s.rewind(to_seq, to))

    def configure(self, chunk_budget_ms: float | None = None, **sampling: Any) -> dict[str, Any]:
        return self._c._run(self._s.configure(chunk_budget_ms, **sampling))

    def close(self) -> None:
        self._c._run(self._s.close())
