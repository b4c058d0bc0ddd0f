"""One episode of a robot on one persistent session of the session service (the contract of docs/robot.md).

The session is opened with the codec's window and sinks (rolling positions: an endless episode holds constant KV
memory). A tick appends `[<task>, *prompt]` on the episode's first tick and whenever the instruction changes, then each
camera image of the codec's `image_keys`, in that order, through the service's image path (server/service/images.py, as
a native `append(image=...)`): a chunk of kind "image" holding a text note of its labels for a text-only model (none, 0
tokens, while the labels stay the same) or the model's image-encoder embeddings; then the observation's
state, chunks of kind "state": `[<obs>, s_1 .. s_Ds, <act>]`, or for a "projector" policy `[<obs>]`, one embedding
vector [1, hidden], `[<act>]` (codec.state_parts), followed in the same chunk by the observation's `action_prefix`
ids when it sent one (real-time chunking: the k rows the robot executes meanwhile, forced as the chunk's first
rows); then asks for a reply of exactly H*D - k tokens
constrained to the action ids (a logits mask in the engine's sampler), greedy, with no stop token, ids only, and
drafted from the last chunk moved on by the control steps since (codec.draft_ids): the engine verifies the draft in
the state chunk's own forward, so a chunk like the last one takes one forward instead of H*D, and the actions are
exactly the undrafted ones. The action tokens
stay in the session, so its history reads obs, act, obs, act, ... as in training, and each tick costs its own tokens
only. Every tick's chunk is decoded whole, a late one too (connection.py answers it stale at its deadline), so the
history never holds a half chunk.

The service's results for the session (the chunk's ack, the reply's deltas and end) reach the tick through
`on_result`, called by the connection (it is the service's ResultListener).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamserve.errors import StreamserveError
from streamserve.media.vision import ImageError
from streamserve.robot.codec import PolicyCodec, PolicyInputError
from streamserve.server.service.context import ClientContext
from streamserve.server.service.results import (
    AppendRequest,
    ChunkResult,
    OpenRequest,
    Pushed,
    ReplyDelta,
    ReplyDone,
    ServiceError,
)
from streamserve.server.service.service import INLINE_TOKENIZE_CHARS, SessionService

log = logging.getLogger("streamserve.server")


class ServiceFailure(StreamserveError):
    """A typed error the service pushed for the episode's session (its client-facing code and message kept)."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error
        self.code = error.code


@dataclass(eq=False)
class Tick:
    session: str
    start: int  # the session's length before the tick's tokens
    step: int | None = None  # the control step of its first action (valid_from_step)
    usage: dict[str, int] = field(default_factory=dict)  # the reply's (forwards, draft_tokens, accepted_tokens)
    tokens: list[int] = field(default_factory=list)  # the chunk's ids so far: the forced prefix, then the reply's
    unacked: int = 0  # chunks appended and not acked yet (the prompt's, the observation's)
    acked: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    done: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Episode:
    def __init__(self, service: SessionService, ctx: ClientContext, codec: PolicyCodec, number: int,
                 draft: bool = True) -> None:
        self.service, self.ctx, self.codec, self.number = service, ctx, codec, number
        self.session_id: str | None = None
        self.prompt: str | None = None  # the instruction the session holds; None: none appended yet
        self.tick: Tick | None = None
        self.draft = draft  # draft each chunk from the last one, shifted by the steps since (lossless)
        self.last: tuple[int, list[int]] | None = None  # (valid_from_step, ids) of the last whole chunk

    async def open(self) -> None:
        opened = await self.service.open(self.ctx, OpenRequest(window=self.codec.window, sinks=self.codec.sinks,
                                                               positions="rolling"))
        self.session_id = opened.session

    def length(self) -> int:
        assert self.session_id is not None
        return len(self.service.registry.get(self.ctx, self.session_id).session)

    async def prompt_tokens(self, prompt: str) -> list[int]:
        tok = self.service.engine.tokenizer
        if len(prompt) <= INLINE_TOKENIZE_CHARS:
            return tok.encode(prompt, add_special_tokens=False)
        loop = asyncio.get_running_loop()  # a long instruction is tokenized off the event loop
        return await loop.run_in_executor(self.service.tokenize_executor,
                                          lambda: tok.encode(prompt, add_special_tokens=False))

    async def start(self, parts: list[list[int] | np.ndarray], prompt: str, deadline_ms: float | None,
                    images: list[tuple[str, Any]] | None = None, step: int | None = None,
                    prefix: list[int] | None = None) -> Tick:
        """Append the tick's chunks (prompt, images, state parts: ids or [1, hidden] vectors; then `prefix`, the
        chunk's forced first rows, real-time chunking) and ask for the rest of its chunk of actions (for control
        step `step`: drafted from the last chunk moved on by the steps since); the results arrive through
        on_result."""
        if self.session_id is None:
            await self.open()
        assert self.session_id is not None
        import torch  # the projected state's vectors go in as an embeds chunk

        # (what it is, the request): the images' keys name them in errors
        chunks = [(key, AppendRequest(image=image, kind="image", deadline_ms=deadline_ms)) for key, image in images
                  or ()]
        prefix = list(prefix or ())
        if prefix:  # the forced rows follow <act> in the state's last (token) part: one chunk, one forward
            assert isinstance(parts[-1], list)
            parts = [*parts[:-1], [*parts[-1], *prefix]]
        chunks += [("state", AppendRequest(token_ids=list(p), kind="state", deadline_ms=deadline_ms)
                    if isinstance(p, list) else AppendRequest(embeds=torch.from_numpy(p), kind="state",
                                                              deadline_ms=deadline_ms)) for p in parts]
        if prompt != self.prompt:  # the first tick, or the instruction changed: its own chunk, as in robot/rollout.py
            ids = self.codec.prompt_ids(await self.prompt_tokens(prompt))
            chunks.insert(0, ("prompt", AppendRequest(token_ids=ids, kind="text", deadline_ms=deadline_ms)))
        tick = Tick(self.session_id, self.length(), step, tokens=list(prefix))
        self.tick = tick
        for what, req in chunks:
            tick.unacked += 1
            try:
                await self.service.append(self.ctx, self.session_id, req)
            except ImageError as e:  # decoded on the vision thread: a damaged file is the observation's fault
                tick.unacked -= 1
                raise PolicyInputError(f"the image {what!r} cannot be used: {e}") from e
            except BaseException:
                tick.unacked -= 1
                raise
        self.prompt = prompt
        draft = None
        if self.draft and self.last is not None and step is not None:
            draft = self.codec.draft_ids(self.last[1], step - self.last[0])[len(prefix):]
        self.service.respond(self.ctx, self.session_id, {
            "max_tokens": self.codec.n_action_tokens - len(prefix), "temperature": 0.0, "stop_token_ids": (),
            "allowed_token_ids": self.codec.action_ids, "draft_token_ids": draft, "detokenize": False})
        return tick

    def on_result(self, result: Pushed) -> None:
        t = self.tick
        if t is None or getattr(result, "session", None) != t.session:
            return  # an earlier tick's or episode's
        if isinstance(result, ChunkResult):
            if result.error is not None:
                _fail(t.acked, ServiceFailure(result.error))
                _fail(t.done, ServiceFailure(result.error))  # no reply can follow a failed chunk
            else:
                t.unacked -= 1
                if t.unacked == 0 and not t.acked.done():
                    t.acked.set_result(result.tokens)
        elif isinstance(result, ReplyDelta):
            t.tokens.extend(result.token_ids)
        elif isinstance(result, ReplyDone):
            t.usage = result.usage
            if not t.done.done():
                t.done.set_result(result.reason)
        elif isinstance(result, ServiceError):
            _fail(t.acked, ServiceFailure(result))
            _fail(t.done, ServiceFailure(result))

    async def settle(self, tick: Tick) -> bool:
        """Wait for the tick's chunk and reply to end; -> whether the reply is a whole chunk (H*D tokens)."""
        await tick.acked
        reason = await tick.done
        whole = reason == "length" and len(tick.tokens) == self.codec.n_action_tokens
        if whole and tick.step is not None:
            self.last = (tick.step, list(tick.tokens))
        return whole

    async def close(self) -> None:
        """Free the session's KV pages now (not parked for a resume: an episode is not resumable)."""
        sid, self.session_id, self.tick = self.session_id, None, None
        if sid is None:
            return
        with contextlib.suppress(StreamserveError):  # the engine closed it already (a failed step): nothing held
            await self.service.close(self.ctx, sid)


def _fail(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
        fut.exception()  # retrieved: a tick nobody settles any more logs nothing
