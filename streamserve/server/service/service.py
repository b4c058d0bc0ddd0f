"""The session service: every session operation a front end offers, protocol-neutral.

Protocol adapters (server/adapters/: native.py, realtime/, ...) decode their frames into calls on this service and
render what it returns (results.py). It owns the registry of resumable sessions, the limits and quotas (checked before
anything is taken), sampling checks and the client-secret scope. It never waits for the model on the event loop:
operations that take the engine lock (open, rewind, close) run on a small executor of their own, long texts are
tokenized on another, so a burst of long texts can never delay an open or a close.

Per connection: a `ClientContext` (context.py). Audio: voice_sessions.py. Images: images.py (the vision model:
server/media/vision.py). Reaping, shutdown and the drain: lifecycle.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from streamserve.config import ACCELERATOR_STEP_TOKENS, SAMPLING_DEFAULTS, SESSION_DEFAULTS, ServerConfig, SessionConfig
from streamserve.engine import Engine, Session
from streamserve.engine.openmp import releasing
from streamserve.engine.sampling import check_sampling, check_seed, check_stop
from streamserve.errors import ChunkTooLargeError, InvalidInputError, SessionClosedError, SessionNotFoundError
from streamserve.server.media.media_budget import MediaBudget, charging
from streamserve.server.media.vision import model_image_encoder
from streamserve.server.media.voice.embed import model_encoder
from streamserve.server.service.acks import Acks
from streamserve.server.service.auth import Grant
from streamserve.server.service.chat import ChatSessions
from streamserve.server.service.context import ClientContext, page_reservation
from streamserve.server.service.images import ImageSessions
from streamserve.server.service.lifecycle import ServiceLifecycle
from streamserve.server.service.registry import Entry, SessionRegistry
from streamserve.server.service.results import (
    AppendRequest,
    ChunkResult,
    Closed,
    Committed,
    Configured,
    Limits,
    Opened,
    OpenRequest,
    QuotaExceededError,
    ReplyDelta,
    ReplyDone,
    ResultListener,
    Rewound,
    ServerInfo,
    ServiceError,
    Stats,
    WindowTooLargeError,
    service_error,
)
from streamserve.server.service.voice_sessions import VoiceSessions

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.server.media.vision import VisionRuntime
    from streamserve.server.media.voice.runtime import VoiceRuntime
log = logging.getLogger("streamserve.server")

CHARS_PER_TOKEN = 32  # text longer than max_chunk_tokens times this is refused before tokenizing
INLINE_TOKENIZE_CHARS = 512  # longer text is tokenized on the tokenizer executor, not on the event loop
ENGINE_WORKERS = 4  # threads for calls that wait for the engine lock (open, rewind, close)
TOKENIZE_WORKERS = 2
STATS_KEYS = ("model", "sessions_open", "sessions_parked", "kv_pages_used", "kv_pages_total", "steps",
              "queued_chunks", "queued_tokens", "responding", "chunks_shed", "decode_tokens_per_s")


class SessionService(ServiceLifecycle):
    def __init__(self, engine: Engine, config: ServerConfig, session_defaults: SessionConfig = SESSION_DEFAULTS,
                 step_tokens: int = ACCELERATOR_STEP_TOKENS, voice: VoiceRuntime | None = None,
                 vision: VisionRuntime | None = None) -> None:
        self.engine, self.config, self.defaults = engine, config, session_defaults
        self.voice = voice  # the voice models (server/media/voice): None when not loaded, and audio is refused
        if voice is not None:  # replies started at the likely end of a turn, held until it is confirmed
            voice.speculations.enabled = not config.no_speculation
        self.vision = vision  # the vision model (server/media/vision.py): None when not loaded, and images are refused
        self.step_tokens = step_tokens  # the most tokens of one session one engine step runs
        self.policy_model: str | None = None  # what WS /v1/policy serves (set by the server once it knows; hello)
        self.registry = SessionRegistry(engine, config.resume_ttl, config.max_sessions_per_connection,
                                        config.max_chunk_tokens, config.max_sessions, config.max_sessions_per_ip)
        self.engine_executor = ThreadPoolExecutor(ENGINE_WORKERS, thread_name_prefix="streamserve-engine")
        self.tokenize_executor = ThreadPoolExecutor(TOKENIZE_WORKERS, thread_name_prefix="streamserve-tokenize")
        self.tasks: set[asyncio.Task] = set()  # the service's own: acks follow their session to a resume
        self.chats = ChatSessions(engine, self.run_engine, self.spawn)  # sessions opened with `chat` (chat.py)
        self.audio = VoiceSessions(voice, self.registry, self.chats, config.max_audio_buffer_s,  # audio in and out
                                   self.respond, self.cancel_session, self.spawn,
                                   model_encoder(engine) if voice is not None else None)
        self.images = ImageSessions(vision, model_image_encoder(engine), self.registry, self.audio.seqs,  # vision.py
                                    lambda sid: self.chats.get(sid) is not None)
        self.budget = MediaBudget(config.max_media_bytes, config.max_media_bytes_per_connection)  # media_budget.py
        self.acks = Acks(self.registry, self.audio.seqs)  # chunk results to their session's connection (acks.py)
        self.deliver, self.finish_chunk = self.acks.deliver, self.acks.finish
        self.start_lifecycle()  # the snapshot store and the drain (server/service/lifecycle.py)

    # ---- what the server is --------------------------------------------------------------------------
    def metrics(self, registry: Any) -> None:
        """Register the service's Prometheus metrics: media bytes held and refused (media/media_budget.py); with
        voice, the STT queue depth, passes and their latencies by kind, batch sizes (media/voice/stt_scheduler.py),
        and the replies speculated by outcome (media/voice/speculate.py)."""
        self.budget.metrics(registry)
        if self.voice is not None:
            self.voice.stt.metrics(registry)
            self.voice.speculations.metrics(registry)

    def info(self) -> ServerInfo:
        e, c = self.engine, self.config
        audio, image = self.audio.info(), self.images.info()
        modalities = ("text", *(("audio",) if audio else ()), *(("image",) if image else ()))
        return ServerInfo(e.name, e.config.architecture, e.config.vocab_size, e.config.max_position_embeddings,
                          modalities, Limits(
                              c.max_frame_bytes, c.max_chunk_tokens, c.max_sessions_per_connection,
                              c.messages_per_second, c.bytes_per_second, c.resume_ttl, c.max_reply_tokens,
                              self.max_window(), c.max_pages_per_connection, c.max_queued_tokens_per_connection,
                              c.min_deadline_ms), self.chats.available, audio, image, tuple(e.capabilities),
                          self.policy_model)

    def max_window(self) -> int:
        """The largest window + sinks a session may ask for."""
        return min(self.config.max_window, self.engine.config.max_position_embeddings)

    async def run_engine(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """A call that may wait for the engine lock, off the event loop, on the engine executor."""
        # releasing: a call's own torch work (a snapshot's copies) leaves no OpenMP workers next to the engine thread
        return await asyncio.get_running_loop().run_in_executor(self.engine_executor,
                                                                lambda: releasing(lambda: fn(*args, **kw)))

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ---- connections -----------------------------------------------------------------------------------
    def connect(self, listener: ResultListener, grant: Grant) -> ClientContext:
        return ClientContext(listener, grant, grant.address)

    def disconnect(self, ctx: ClientContext) -> None:
        """The connection ended: its reply forwarders stop, its sessions wait for a resume."""
        ctx.gone = True
        self.budget.close(ctx)  # the media its buffers still hold goes back now, whenever they stop
        for t in list(ctx.tasks):
            t.cancel()
        for entry in self.registry.detach_all(ctx):
            self.chats.cancel(entry.session.id)  # a chat reply asked for and not started yet never starts
            self.audio.detach(entry.session.id)  # its Listener and Speaker go

    def held(self, ctx: ClientContext) -> list[str]:
        return [e.session.id for e in self.registry.owned(ctx)]

    def reserved_pages(self, ctx: ClientContext) -> int:
        return sum(e.reserved_pages for e in self.registry.owned(ctx)) + ctx.opening_pages

    # ---- checks ------------------------------------------------------------------------------------------
    def check_sampling(self, params: dict[str, Any]) -> dict[str, Any]:
        """Reply parameters within the engine's ranges and the server's max_reply_tokens (checked where they
        are given: `open` and `configure` too, so a session's defaults are always usable)."""
        d, limit = SAMPLING_DEFAULTS, self.config.max_reply_tokens
        max_tokens = params.get("max_tokens", min(d.max_tokens, limit))
        check_sampling(max_tokens, params.get("temperature", d.temperature), params.get("top_p", d.top_p),
                       params.get("top_k", d.top_k))
        check_seed(params.get("seed"))
        check_stop(params.get("stop"))
        if max_tokens > limit:
            raise InvalidInputError(f"max_tokens {max_tokens} is over this server's limit of {limit}")
        return {**params, "max_tokens": max_tokens}

    def floor_ms(self, ms: float) -> float:
        """Client deadlines below --min-deadline-ms are raised to it: a 0 ms deadline cannot jump the queue."""
        return max(ms, self.config.min_deadline_ms)

    def page_reservation(self, window: int | None, sinks: int, page_cap: int | None) -> int:
        """The most KV pages a session can ever hold (server/service/context.py)."""
        return page_reservation(self.engine.pool.page_size, self.engine.config.max_position_embeddings,
                                self.step_tokens, window, sinks, page_cap)

    # ---- session operations -----------------------------------------------------------------------------
    async def open(self, ctx: ClientContext, req: OpenRequest, chat: bool = False) -> Opened:
        """A new session; `chat`: one whose appends are chat messages, rendered by the model's chat template."""
        self.check_accepting()  # not while draining
        self.chats.check_open(chat)
        self.audio.configure("", req.voice, store=False)  # checked before anything is taken
        d = self.defaults
        window = req.window if req.window is not None else d.window
        sinks = req.sinks if req.sinks is not None else d.sinks
        if window is not None and window + sinks > self.max_window():
            raise WindowTooLargeError(f"window + sinks = {window + sinks} is over this server's limit of "
                                      f"{self.max_window()} tokens (the model's context and --max-window)")
        budget_ms = req.chunk_budget_ms if req.chunk_budget_ms is not None else d.chunk_budget * 1e3
        sampling = self.check_sampling(req.sampling or {})
        pages = self.page_reservation(window, sinks, d.page_cap)
        quota = self.config.max_pages_per_connection
        if quota is not None and self.reserved_pages(ctx) + pages > quota:
            raise QuotaExceededError(f"a session with window {window} needs {pages} KV pages reserved; this "
                                     f"connection has {quota - self.reserved_pages(ctx)} of its {quota} left "
                                     "(close a session, or open with a smaller window)")
        kw: dict[str, Any] = {"window": window, "sinks": sinks, "positions": req.positions or d.positions,
                              "page_cap": pages, "chunk_budget": self.floor_ms(budget_ms) / 1e3}
        if req.drafter is not None:
            kw["drafter"] = req.drafter
        ctx.grant.claim_open()
        ctx.opening_pages += pages
        entry = None
        opening = asyncio.ensure_future(self.run_engine(self.registry.open, ctx, sampling, reserved_pages=pages, **kw))
        try:
            entry = await asyncio.shield(opening)  # the engine thread goes on if this call is cancelled...
            if ctx.gone:  # the connection ended meanwhile: nobody can use or resume this session
                self.abandon(entry)
                entry = None
                raise SessionClosedError("this connection closed while the session was opening")
        except asyncio.CancelledError:
            opening.add_done_callback(self.abandoned)  # ...and the session it makes, nobody's, is closed
            raise
        finally:
            ctx.opening_pages -= pages
            ctx.grant.opened(entry.session.id if entry is not None else None)
        self.chats.start(entry.session, chat)
        self.audio.configure(entry.session.id, req.voice)
        return self.opened(entry, resumed=False)

    def abandoned(self, opening: asyncio.Future) -> None:
        """An open whose caller was cancelled finished."""
        if not opening.cancelled() and opening.exception() is None:
            self.abandon(opening.result())

    def abandon(self, entry: Entry) -> None:
        """Close a session nobody will hear of (its open's caller is gone)."""
        self.registry.remove(entry.session.id)
        self.spawn(self.close_session(entry.session))

    async def close_session(self, session: Session) -> None:
        try:
            await self.run_engine(session.close)
        except Exception:  # e.g. the executor is already shut down: the engine's shutdown frees everything
            log.exception("streamserve: closing an abandoned session failed")

    def opened(self, e: Entry, resumed: bool) -> Opened:
        s = e.session
        window, sinks, mode = s.policy.window, s.policy.sinks, str(s.policy.mode)
        return Opened(s.id, e.resume_token, resumed, s.next_seq, len(s.token_ids), window, sinks, mode,
                      s.chunk_budget * 1e3, e.reserved_pages, self.chats.get(s.id) is not None,
                      self.audio.configure(s.id, None))

    async def resume(self, ctx: ClientContext, session_id: str, token: str) -> tuple[Opened, list[ChunkResult]]:
        """-> (the session, the results of its latest chunks, sent again for the client to pick from). A session
        another instance handed over is taken from the snapshot store (server/service/lifecycle.py)."""
        ctx.grant.check_resume(session_id)
        try:
            found = self.registry.verified(session_id, token)  # the token first: nothing about the session without it
        except SessionNotFoundError:
            if self.store is None or self.draining or self.registry.find(session_id) is not None:
                raise
            return await self.take_over(ctx, session_id, token)
        quota = self.config.max_pages_per_connection
        if found.owner is not ctx and quota is not None \
                and self.reserved_pages(ctx) + found.reserved_pages > quota:
            raise QuotaExceededError(f"resuming this session needs {found.reserved_pages} KV pages of this "
                                     f"connection's quota of {quota}; {quota - self.reserved_pages(ctx)} are left")
        entry, previous = self.registry.resume(ctx, session_id, token)
        if previous is not None:  # taken over from a connection that has not noticed it is gone
            previous.listener.push_nowait(ServiceError("session_moved", "another connection resumed this session",
                                                       session=session_id))
            self.chats.cancel(session_id)
        return self.opened(entry, resumed=True), list(entry.recent)

    async def append(self, ctx: ClientContext, session_id: str, req: AppendRequest, message: Any = None) -> None:
        """Queue a chunk (a chat session's: `message`, {role, content}); its ChunkResult reaches whichever
        connection holds the session when it is done. Refusals (limits, quotas, input) raise here, queuing nothing."""
        s = self.registry.get(ctx, session_id).session
        if req.audio is not None:  # the session's Listener, or its model's encoder (server/service/voice_sessions.py)
            with charging(self.budget.account(ctx)):  # what the Listener holds counts against this connection
                return await self.audio.append(ctx, session_id, req, self.deliver, self.finish_chunk)
        if req.image is not None:  # its note (text or a chat message), or the model's image embeds (vision.py)
            with charging(self.budget.account(ctx)):  # the image's bytes, while it waits for the vision thread
                return await self.images.append(s.id, req, self.deliver,
                                                lambda r, m: self.append(ctx, session_id, r, m))
        message, req = self.chats.check_append(session_id, message, req)
        limit = self.config.max_chunk_tokens
        too_many = req.token_ids is not None and len(req.token_ids) > limit
        too_long = req.text is not None and len(req.text) > limit * CHARS_PER_TOKEN
        if too_many or too_long:
            raise ChunkTooLargeError(f"this chunk is over the limit of {limit} tokens per chunk; split it")
        long_text = req.text is not None and len(req.text) > INLINE_TOKENIZE_CHARS
        n_tokens = await self.count_tokens(req, long_text)
        cap = self.config.max_queued_tokens_per_connection
        if cap is not None and ctx.queued_tokens + n_tokens > cap:
            raise QuotaExceededError(f"this connection has {ctx.queued_tokens} tokens queued and not yet in the KV "
                                     f"cache; {n_tokens} more would pass its limit of {cap}: wait for acks")
        now = time.monotonic()
        deadline = None if req.deadline_ms is None else now + self.floor_ms(req.deadline_ms) / 1e3
        kw = {"text": req.text, "token_ids": req.token_ids, "embeds": req.embeds, "seq": req.seq, "capture_time": now,
              "deadline": deadline, "kind": req.kind or "text"}
        ctx.queued_tokens += n_tokens  # taken at the check: appends running at once count each other
        acquired = False
        try:
            await ctx.pending_acks.acquire()  # too many in flight: the adapter stops reading until acks go out
            acquired = True
            kw["seq"] = self.audio.seqs.assign(s.id, req.seq, s.next_seq)  # renumbered past transcripts (seqs.py)
            if message is not None:  # rendered and appended in its turn, after the chat's earlier operations
                fut = self.chats.add(s.id, message, {k: kw[k] for k in ("seq", "capture_time", "deadline")})
            elif long_text:  # tokenizing it on the event loop would stall every connection
                fut = await asyncio.get_running_loop().run_in_executor(self.tokenize_executor,
                                                                       lambda: s.submit_chunk(**kw))
            else:
                fut = s.submit_chunk(**kw)
        except BaseException:
            ctx.queued_tokens -= n_tokens
            if acquired:
                ctx.pending_acks.release()
            raise
        self.spawn(self.finish_chunk(ctx, s.id, req, n_tokens, fut))

    async def count_tokens(self, req: AppendRequest, long_text: bool) -> int:
        """Tokens a chunk adds, for the queued-token quota (text: without special tokens; the engine counts exactly)."""
        if req.text is None or self.config.max_queued_tokens_per_connection is None:
            return len(req.token_ids or ()) if req.embeds is None else len(req.embeds)
        if not long_text:
            return len(self.engine.tokenizer.encode(req.text, add_special_tokens=False))
        return len(await asyncio.get_running_loop().run_in_executor(
            self.tokenize_executor, lambda: self.engine.tokenizer.encode(req.text, add_special_tokens=False)))

    def respond(self, ctx: ClientContext, session_id: str, params: dict[str, Any],
                listener: ResultListener | None = None) -> None:
        """Start a reply (a chat session's: server/service/chat.py); its ReplyDeltas and ReplyDone reach this connection
        (or `listener`: a speculated reply's, held until the turn is confirmed: voice_speculation.py)."""
        entry = self.registry.get(ctx, session_id)
        params = self.check_sampling({**entry.sampling, **params})
        listener = self.audio.reply_listener(listener or ctx.listener, session_id)  # reply audio on: also spoken
        with charging(self.budget.account(ctx)):  # the reply's tasks (made here) charge its unsent audio there
            if self.chats.respond(listener, session_id, params):
                return
            stop = params.pop("stop", None)
            stream = entry.session.stream(**params, stop=stop)
            ctx.spawn(self.forward(listener, stream, session_id))

    async def forward(self, listener: ResultListener, stream: Any, session_id: str) -> None:
        try:
            async for d in stream:
                await listener.push(ReplyDelta(session_id, stream.id, d.text, d.token_ids))
            reason = stream.finish_reason
        except Exception as e:
            await listener.push(service_error(e, session_id))
            reason = "error"
        await listener.push(ReplyDone(session_id, stream.id, reason, stream.usage))

    def cancel(self, ctx: ClientContext, session_id: str) -> None:
        self.cancel_session(self.registry.get(ctx, session_id).session.id)

    def cancel_session(self, session_id: str) -> None:
        """End the session's running reply (and a chat reply asked for that has not started) and its audio."""
        entry = self.registry.find(session_id)
        if entry is not None:
            entry.session.cancel()
        self.chats.cancel(session_id)
        self.audio.hush(session_id)

    async def commit(self, ctx: ClientContext, session_id: str) -> Committed:  # the utterance ends now
        return await self.audio.commit(self.registry.get(ctx, session_id).session.id)

    async def rewind(self, ctx: ClientContext, session_id: str, to: int | None, to_seq: int | None,
                     to_message: int | None = None) -> Rewound:
        """Forget everything after token `to`, chunk `to_seq` or (chat sessions) the first `to_message` messages."""
        s = self.registry.get(ctx, session_id).session
        at = self.audio.seqs.resolve(s.id, to_seq)  # the client's seq of a renumbered chunk -> the chunk's
        n = await self.chats.rewind(session_id, to, at, to_message)
        if n is None:
            n = await self.run_engine(s.rewind, to, at)
        self.audio.seqs.rewound(s.id, to_seq)
        self.images.rewound(s.id)
        return Rewound(s.id, n, s.next_seq)

    def configure(self, ctx: ClientContext, session_id: str, sampling: dict[str, Any] | None,
                  chunk_budget_ms: float | None, voice: dict[str, Any] | None = None) -> Configured:
        entry = self.registry.get(ctx, session_id)
        self.audio.configure(session_id, voice, store=False)  # checked before anything changes
        if sampling is not None:
            entry.sampling = self.check_sampling({**entry.sampling, **sampling})
        if chunk_budget_ms is not None:
            entry.session.chunk_budget = self.floor_ms(chunk_budget_ms) / 1e3
        return Configured(session_id, entry.sampling, entry.session.chunk_budget * 1e3,
                          self.audio.configure(session_id, voice))

    async def close(self, ctx: ClientContext, session_id: str) -> Closed:
        entry = self.registry.get(ctx, session_id)
        self.registry.remove(session_id)  # its page reservation goes back to the connection with it
        self.chats.forget(session_id)
        self.images.forget(session_id)
        await self.audio.free_all(session_id)  # its Listener and Speaker have stopped when `closed` goes out
        await self.run_engine(entry.session.close)
        return Closed(session_id, "client")

    def stats(self, ctx: ClientContext) -> Stats:
        """Server-wide figures need the API key, as on /healthz and /metrics; a client secret (one session) sees
        the model and its own connection only."""
        st = self.engine.stats()
        keys = STATS_KEYS if ctx.grant.secret is None else ("model",)
        return Stats({k: st[k] for k in keys}, len(self.registry.owned(ctx)), self.reserved_pages(ctx),
                     ctx.queued_tokens)
