"""A blocking client for scripts and control loops: the asyncio client on a private event-loop thread.

    with streamserve_client.SyncClient("ws://127.0.0.1:8000") as client:
        s = client.open_session()
        s.append(text="In the beginning")
        for delta in s.respond(max_tokens=16):
            print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from streamserve_client.client import Client
from streamserve_client.errors import CallTimeoutError
from streamserve_client.protocol import Ack, Delta
from streamserve_client.session import Session

T = TypeVar("T")


class SyncClient:
    def __init__(self, url: str, api_key: str | None = None, reconnect: bool = True, timeout: float | None = 60.0):
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="streamserve-client", daemon=True)
        self._thread.start()
        self.client = Client(url, api_key=api_key, reconnect=reconnect)  # the asyncio client this one drives
        try:
            self.run(self.client.connect())
        except BaseException:
            self._stop()
            raise

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the asyncio client on its loop thread and wait (at most `timeout`) for it."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(self.timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()  # the call stops on the loop too: nothing keeps waiting (or holds its seq) behind us
            raise CallTimeoutError(f"the call took longer than {self.timeout} s; it was cancelled") from None
        except BaseException:
            fut.cancel()  # KeyboardInterrupt in the caller's thread
            raise

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def hello(self) -> dict[str, Any]:
        return self.client.hello

    def open_session(self, window: int | None = None, sinks: int | None = None, positions: str | None = None,
                     chunk_budget_ms: float | None = None, drafter: str | None = None, chat: bool = False,
                     **sampling: Any) -> SyncSession:
        return SyncSession(self, self.run(self.client.open_session(window, sinks, positions, chunk_budget_ms,
                                                                   drafter, chat, **sampling)))

    def resume_session(self, session_id: str, resume_token: str) -> SyncSession:
        return SyncSession(self, self.run(self.client.resume_session(session_id, resume_token)))

    def stats(self) -> dict[str, Any]:
        return self.run(self.client.stats())

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        return self.run(self.client.request(message))

    def drop_connection(self) -> None:
        """See Client.drop_connection."""
        self.run(self.client.drop_connection())

    def close(self) -> None:
        """Close the sessions (unless the connection is gone), the connection and the loop thread."""
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


class SyncSession:
    def __init__(self, client: SyncClient, session: Session) -> None:
        self.client, self.session = client, session
        self.id, self.resume_token = session.id, session.resume_token
        self.finish_reason: str | None = None  # of the latest reply

    def append(self, text: str | None = None, token_ids: list[int] | None = None, audio: Any = None,
               image: Any = None, *, message: dict[str, str] | list[dict[str, str]] | None = None, **kw: Any) -> Ack:
        return self.client.run(self.session.append(text, token_ids, audio, image, message=message, **kw))

    def respond(self, **params: Any) -> Iterator[Delta]:
        """Yield the reply's deltas as they come; closing the iterator early cancels the reply."""
        r = self.session.respond(**params)
        try:
            while True:
                try:
                    yield self.client.run(r.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if r.finish_reason is None and r.started:
                self.cancel()
                self.client.run(r.wait())
            self.finish_reason = r.finish_reason

    def cancel(self) -> None:
        self.client.run(self.session.cancel())

    def rewind(self, to_seq: int | None = None, to: int | None = None, to_message: int | None = None) -> int:
        return self.client.run(self.session.rewind(to_seq, to, to_message))

    def configure(self, chunk_budget_ms: float | None = None, **sampling: Any) -> dict[str, Any]:
        return self.client.run(self.session.configure(chunk_budget_ms, **sampling))

    def close(self) -> None:
        self.client.run(self.session.close())
