"""The session service's lifecycle half (split from service.py, whose `SessionService` inherits it): reaping
detached sessions past their resume TTL, the server's shutdown, and the live hand-off of sessions between instances
(docs/protocol.md, Drain and hand-off; the store: server/service/handoff.py).

Drain (`hand_off`, called by server/app.py once new connections are refused): the service stops taking work (the
native adapter reads no more operations but cancel, close and stats; opens are refused), waits until every running
reply and queued chunk of the sessions it hands over has ended and its result was delivered (bounded; then the
replies are cancelled), and puts a record of each such session in the store: native sessions, open or detached,
plain or chat. Sessions of connection-bound protocols (Realtime, WebRTC, policy) and sessions that take audio are
not handed over (their Listener, Speaker and voice settings live here only): they close as at a shutdown. Each
handed-over session is then closed here, so its KV pages come back at once.

Take-over (`take_over`, from `resume` of an id this instance does not hold): the record is claimed from the store
(the token checked against its hash in constant time first: a wrong token leaves the record for the right client),
restored with the same id, registered with the same token, and answered as a local resume is.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from streamserve.config import ServerConfig
from streamserve.engine import Engine, Session
from streamserve.errors import SnapshotError, StreamserveError
from streamserve.server.service.context import ClientContext
from streamserve.server.service.handoff import (
    DamagedRecordError,
    DirectoryStore,
    ForeignModelError,
    HandoffRecord,
    SnapshotStore,
    check_id,
    token_hash,
)
from streamserve.server.service.registry import Entry, SessionRegistry
from streamserve.server.service.results import ChunkResult, Closed, Opened, QuotaExceededError, ServiceError

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.server.media.vision import VisionRuntime
    from streamserve.server.media.voice.runtime import VoiceRuntime
    from streamserve.server.service.chat import ChatSessions
    from streamserve.server.service.images import ImageSessions
    from streamserve.server.service.voice_sessions import VoiceSessions

log = logging.getLogger("streamserve.server")

DRAIN_CANCEL_WAIT_S = 5.0  # after the drain's wait, cancelled replies get this long to end
QUIET_POLL_S = 0.01
EXPIRE_EVERY_S = 30.0  # how often the reaper removes expired records from the store


class ServerDrainingError(StreamserveError):
    """This instance is draining: it takes no new sessions (connect again: the proxy picks another instance)."""

    code = "server_busy"


class ServiceLifecycle:
    """SessionService's reaping and shutdown (a mixin: SessionService holds the state named here)."""

    engine: Engine
    registry: SessionRegistry
    chats: ChatSessions
    audio: VoiceSessions
    images: ImageSessions
    voice: VoiceRuntime | None
    vision: VisionRuntime | None
    tasks: set[asyncio.Task]
    engine_executor: ThreadPoolExecutor
    tokenize_executor: ThreadPoolExecutor
    config: ServerConfig
    if TYPE_CHECKING:
        async def run_engine(self, fn: Any, *args: Any, **kw: Any) -> Any: ...
        def cancel_session(self, session_id: str) -> None: ...
        def reserved_pages(self, ctx: ClientContext) -> int: ...
        def opened(self, e: Entry, resumed: bool) -> Opened: ...

    def start_lifecycle(self) -> None:
        """The snapshot store (--snapshot-store; None: a drain is a graceful shutdown) and the drain's state."""
        self.store: SnapshotStore | None = None
        if self.config.snapshot_store is not None:
            self.store = DirectoryStore(self.config.snapshot_store)
        self.draining = False  # set by hand_off: the native adapter then reads only cancel, close and stats
        self.operations = 0  # native operations being carried out now (the drain waits for them)
        self.expired_at = 0.0  # when the reaper last removed expired records from the store

    def check_accepting(self) -> None:
        if self.draining:
            raise ServerDrainingError("this server is draining: it takes no new sessions; connect again")

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def reap(self) -> None:
        """Close detached sessions past their resume TTL, and forget sessions the engine closed."""
        for entry in self.registry.expired():
            self.chats.forget(entry.session.id)
            self.audio.forget(entry.session.id)
            self.images.forget(entry.session.id)
            await self.run_engine(entry.session.close)
        if self.store is not None and time.monotonic() - self.expired_at > EXPIRE_EVERY_S:
            self.expired_at = time.monotonic()
            await self.run_engine(self.store.expire)

    def announce_shutdown(self, ctx: ClientContext) -> None:
        for entry in self.registry.owned(ctx):
            ctx.listener.push_nowait(Closed(entry.session.id, "shutdown"))

    async def shutdown(self) -> None:
        """Close every session, stop the engine and the executors (the server's cleanup)."""
        for t in list(self.tasks):
            t.cancel()
        for entry in self.registry.all():
            self.registry.remove(entry.session.id)
            await self.audio.free_all(entry.session.id)
            await self.run_engine(entry.session.close)
        await self.run_engine(self.engine.shutdown)
        self.engine_executor.shutdown(wait=False)
        self.tokenize_executor.shutdown(wait=False)
        if self.voice is not None:
            self.voice.close()
        self.images.close()
        if self.vision is not None:
            self.vision.close()

    # ---- drain: hand the sessions over to the instance that receives their resume ---------------------
    def portable(self, e: Entry) -> bool:
        """Whether a drain hands the session over: a native session (open or detached) that takes no audio, on a
        backend that can snapshot it (not SGLang's: its sessions close as at a shutdown)."""
        return e.portable and not e.session.closed and e.session.id not in self.audio.states \
            and "snapshot" in self.engine.capabilities

    def quiet(self, entries: list[Entry]) -> bool:
        """Nothing runs on these sessions any more, and every result of theirs was delivered."""
        if self.operations or self.tasks:  # an operation being carried out; an ack, a chat reply, audio
            return False
        if not entries:
            return True
        loop = self.engine.loop
        with loop.cv:
            busy = loop.scheduler.busy_sessions()
        for e in entries:
            chat = self.chats.get(e.session.id)
            if e.session.id in busy or (chat is not None and chat.turns.locked()) \
                    or (e.owner is not None and any(not t.done() for t in e.owner.tasks)):
                return False
        return True

    async def settle(self, entries: list[Entry], timeout: float) -> bool:
        """Wait (bounded) until `quiet`; -> whether it is."""
        end = time.monotonic() + timeout
        while not self.quiet(entries):
            if time.monotonic() > end:
                return False
            await asyncio.sleep(QUIET_POLL_S)
        return True

    async def hand_off(self, timeout: float) -> set[str]:
        """Drain (see the module's docstring); -> the ids of the sessions now in the store."""
        self.draining = True
        entries = [e for e in self.registry.all() if self.portable(e)]
        for e in self.registry.all():
            if not self.portable(e):  # closed as at a shutdown: nothing of theirs need finish
                self.cancel_session(e.session.id)
                self.audio.detach(e.session.id)
        if self.store is None:
            return set()
        if not await self.settle(entries, timeout):
            log.warning("streamserve: drain: replies still running after %.0f s are cancelled", timeout)
            for e in entries:
                self.cancel_session(e.session.id)
            await self.settle(entries, DRAIN_CANCEL_WAIT_S)
        moved: set[str] = set()
        for e in entries:
            t0 = time.perf_counter()
            try:
                record = await self.run_engine(self.record_of, e)
                await self.run_engine(self.store.put, record)
            except Exception as ex:  # this session closes as at a shutdown; the others go on
                log.error("streamserve: drain: session %s could not be handed over (%s: %s); it closes",
                          e.session.id, type(ex).__name__, ex)
                continue
            moved.add(e.session.id)
            self.registry.remove(e.session.id)
            self.chats.forget(e.session.id)
            self.images.forget(e.session.id)
            await self.run_engine(e.session.close)  # its KV pages come back now
            log.info("streamserve: drain: session %s handed over (%d tokens, %.1f ms)", e.session.id,
                     len(record.snapshot.token_ids), (time.perf_counter() - t0) * 1e3)
        return moved

    def record_of(self, e: Entry) -> HandoffRecord:
        """The session's hand-off record (blocking: the chat's state may render, the snapshot waits for the engine)."""
        chat = self.chats.export(e.session.id)
        snap = e.session.snapshot()
        detached_for = 0.0 if e.detached_at is None else time.monotonic() - e.detached_at
        # a protocol may keep its records longer than a resume (the HTTP APIs: as long as their stored responses)
        ttl = getattr(getattr(e.owner, "listener", None), "record_ttl", None) or self.config.resume_ttl
        return HandoffRecord(e.session.id, token_hash(e.resume_token), snap,  # type: ignore[arg-type]
                             time.time() + ttl - detached_for, dict(e.sampling),
                             e.reserved_pages, e.session.chunk_budget, chat, [asdict(r) for r in e.recent])

    # ---- fork: a copy of a session (its KV pages and chat), nothing computed again ---------------------------
    async def fork(self, ctx: ClientContext, session_id: str) -> Opened:
        """A new session of `ctx` holding what `session_id` holds (copied through a snapshot, chat state included);
        the session must be between operations (a reply running: ResponseInProgressError)."""
        self.check_accepting()
        entry = self.registry.get(ctx, session_id)
        ctx.grant.claim_open()
        copied = None
        try:
            copied = await self.run_engine(self.copied, ctx, entry)
        finally:
            ctx.grant.opened(copied.session.id if copied is not None else None)
        return self.opened(copied, resumed=False)

    def copied(self, ctx: ClientContext, entry: Entry) -> Entry:
        """Blocking: `entry`'s session copied and registered for `ctx` (closed again on any failure)."""
        chat = self.chats.export(entry.session.id)
        s: Session = self.engine.restore(entry.session.snapshot())
        try:
            self.chats.adopt(s, chat)
            return self.registry.adopt(ctx, s, secrets.token_urlsafe(32), dict(entry.sampling), entry.reserved_pages,
                                       [])
        except BaseException:
            self.chats.transcripts.pop(s.id, None)
            s.close()
            raise

    # ---- take-over: a resume of a session another instance handed over ------------------------------------
    async def take_over(self, ctx: ClientContext, session_id: str, token: str) -> tuple[Opened, list[ChunkResult]]:
        """Claim the session from the store, restore it with its id, hold it for `ctx` under its token."""
        assert self.store is not None
        claim = await self.run_engine(self.store.claim, check_id(session_id), token, self.engine.fingerprint)
        rec = claim.record
        quota = self.config.max_pages_per_connection
        if quota is not None and self.reserved_pages(ctx) + rec.reserved_pages > quota:
            claim.release()
            raise QuotaExceededError(f"resuming this session needs {rec.reserved_pages} KV pages of this "
                                     f"connection's quota of {quota}; {quota - self.reserved_pages(ctx)} are left")
        restoring = asyncio.ensure_future(self.run_engine(self.restored, ctx, rec, token))
        try:
            entry = await asyncio.shield(restoring)  # the engine thread goes on if this call is cancelled...
        except DamagedRecordError:
            claim.commit()  # it can never be restored: it goes
            raise
        except asyncio.CancelledError:
            restoring.add_done_callback(lambda f: self.taken_over(f, claim, ctx))  # ...and ends as if it finished
            raise
        except BaseException:
            claim.release()  # e.g. no room here now: the record stays for another try
            raise
        claim.commit()
        if ctx.gone:  # the connection ended meanwhile: the session waits for a resume, as its other sessions do
            self.registry.detach_all(ctx)
        return self.opened(entry, resumed=True), list(entry.recent)

    def taken_over(self, restoring: asyncio.Future, claim: Any, ctx: ClientContext) -> None:
        """A take-over whose caller was cancelled finished: the session is held (detached) or the record goes back."""
        if restoring.cancelled() or restoring.exception() is not None:
            claim.release()
            return
        claim.commit()
        if ctx.gone:
            self.registry.detach_all(ctx)

    def restored(self, ctx: ClientContext, rec: HandoffRecord, token: str) -> Entry:
        """Blocking: the record's session, restored here and registered (closed again on any failure)."""
        try:
            s: Session = self.engine.restore(rec.snapshot, session_id=rec.session_id)
        except SnapshotError as e:  # its pages or vectors do not fit: it never will
            if str(e).startswith("damaged"):
                raise DamagedRecordError(f"damaged hand-off record: {e}") from None
            raise ForeignModelError(f"this server cannot resume session {rec.session_id!r}: {e}") from None
        try:
            if rec.chunk_budget is not None:
                s.chunk_budget = float(rec.chunk_budget)
            try:
                recent = [ChunkResult(**{**r, "error": None if r.get("error") is None else ServiceError(**r["error"])})
                          for r in rec.recent]
                self.chats.adopt(s, rec.chat)
            except (TypeError, ValueError) as e:
                raise DamagedRecordError(f"damaged hand-off record: {e}") from None
            return self.registry.adopt(ctx, s, token, rec.sampling, rec.reserved_pages, recent)
        except BaseException:
            self.chats.transcripts.pop(s.id, None)
            s.close()
            raise
