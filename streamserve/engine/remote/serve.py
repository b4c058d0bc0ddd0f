"""The backend loop's side of a `RemoteSession`: its FIFO of appends, replies and rewinds, run one at a time
against SGLang (a streaming session takes one request at a time), until the session closes.

A reply streams SGLang's cumulative `output_ids`; each new token joins the token log at once (the log always equals
SGLang's context once a request ends). When SGLang reports an abort (a cancel, a close, or a stop string this side
saw first), SGLang has dropped the whole turn, so the tokens received are prefilled again: what a cancelled reply
produced stays in the session, as on the engine backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import Any

from streamserve.engine.remote.http import BackendRequestError, BackendUnavailableError
from streamserve.engine.remote.session import RemoteSession, _Append, _end, _fail, _Reply, _Rewind
from streamserve.engine.snapshot import ChunkRecord
from streamserve.engine.streams import Delta
from streamserve.engine.work import Ack
from streamserve.errors import RewindError, SessionClosedError, StreamserveError

log = logging.getLogger("streamserve.engine")
PREFILL_PIECE = 4096  # tokens per prefill request when a rewind rebuilds a session
_rids = itertools.count(1)


async def serve(s: RemoteSession) -> None:
    """Run `s`'s queue until it is closed; then close its SGLang session. A dead backend fails every session."""
    s.wake = asyncio.Event()
    e = s.engine
    item: _Append | _Reply | _Rewind | None = None
    try:
        while True:
            item = s.take()
            if item is None:
                if s.closed:
                    break
                s.wake.clear()
                if (item := s.take()) is None:  # nothing was queued between the take and the clear
                    await s.wake.wait()
                    continue
            if isinstance(item, _Append):
                await run_append(s, item)
            elif isinstance(item, _Reply):
                await run_reply(s, item)
            else:
                await run_rewind(s, item)
            item = None
    except BackendUnavailableError as err:
        if item is not None:
            _fail(item, err, "error")
        e.backend_failed(err)
        return
    except asyncio.CancelledError:  # the backend is shutting down
        if item is not None:
            _fail(item, SessionClosedError("the server shut down"), "closed")
        raise
    with contextlib.suppress(StreamserveError):  # best effort: an unknown id is answered 200 too
        await e.http.close_session(s.backend_id)


async def run_append(s: RemoteSession, a: _Append) -> None:
    e, t0 = s.engine, time.monotonic()
    try:
        meta = await e.http.prefill(s.backend_id, a.ids, f"{s.id}-p{next(_rids)}")
    except BackendRequestError as err:  # SGLang refused it: its context is unchanged
        a.ticket.set_exception(err)
        return
    t1 = time.monotonic()
    s.cache = reuse(meta)
    with s.lock:
        start = len(s.token_ids)
        s.token_ids.extend(a.ids)
        s.timeline.append(ChunkRecord("input", a.seq, start, start + len(a.ids), a.capture, a.deadline))
    e.stats_.appended(len(a.ids), t0 - a.arrival, t1 - t0, t1 > a.deadline)
    a.ticket.set_result(Ack(a.seq, len(a.ids), (t0 - a.arrival) * 1e3, (t1 - t0) * 1e3, t1 > a.deadline))


def reuse(meta: dict[str, Any]) -> tuple[int, int]:
    """(context tokens, of which served from SGLang's cache) of a request, from its meta_info."""
    return int(meta.get("prompt_tokens") or 0), int(meta.get("cached_tokens") or 0)


def sampling_params(r: Any, max_new: int, seed: int | None) -> dict[str, Any]:
    """SGLang's sampling_params for a `Response` (stop ids are checked to include EOS at the call)."""
    p: dict[str, Any] = {"max_new_tokens": max_new, "temperature": r.temperature, "top_p": r.top_p,
                         "top_k": r.top_k if r.top_k > 0 else -1, "skip_special_tokens": False}
    if r.stop_token_ids:
        p["stop_token_ids"] = sorted(r.stop_token_ids)
    else:  # never stop early
        p["ignore_eos"] = True
    if r.stop:
        p["stop"] = list(r.stop)
    if seed is not None:
        p["sampling_seed"] = seed
    return p


async def run_reply(s: RemoteSession, item: _Reply) -> None:
    e, r = s.engine, item.response
    try:
        if r.cancelled:
            return _end(r, "closed" if s.closed else "cancelled")
        start = len(s.token_ids)
        room = e.max_context - start
        max_new = min(r.max_tokens, room)
        if max_new <= 0:
            return _end(r, "context")
        r.detok = e.tokenizer.detokenizer(context=s.token_ids[max(0, start - 8):start])
        with s.lock:
            s.timeline.append(ChunkRecord("reply", None, start, start))
        received, finish, stopped = 0, None, False
        async for chunk in e.http.stream(s.backend_id, [], item.rid, sampling_params(r, max_new, item.seed)):
            ids = chunk.get("output_ids") or []
            for t in ids[received:]:  # cumulative: each chunk has every token so far
                with s.lock:
                    s.token_ids.append(t)
                    s.timeline[-1] = ChunkRecord("reply", None, start, len(s.token_ids))
                received += 1
                if r.first_token_at is None:
                    r.first_token_at = time.monotonic()
                    e.stats_.first_token(r.first_token_at - r.arrival)
                text, hit = r.add_token(t)
                if not stopped:  # past a stop string, tokens join the session (as SGLang has them) but not the text
                    r.outbox.put(Delta(text, [t]))
                stopped = stopped or hit
            meta = chunk.get("meta_info") or {}
            if reason := meta.get("finish_reason"):
                finish = reason.get("type")
                s.cache = reuse(meta)
            elif (r.cancelled or stopped) and not item.abort_sent:
                await s.abort(item)
        e.stats_.decoded(received, time.monotonic() - r.first_token_at if r.first_token_at is not None else 0.0)
        if finish == "abort" and received and not s.closed:  # SGLang dropped the turn: give it back what it made
            await e.http.prefill(s.backend_id, list(s.token_ids[start:start + received]), f"{s.id}-p{next(_rids)}")
        if stopped or finish == "stop":
            _end(r, "stop")
        elif finish == "abort":
            _end(r, "closed" if s.closed else "cancelled")
        else:
            _end(r, "context" if max_new < r.max_tokens and received >= max_new else "length")
    except BackendRequestError as err:  # this reply failed; SGLang's session is unknown now: the session fails
        log.warning("streamserve: SGLang failed a reply of session %s: %s", s.id, err)
        _end(r, "error", err)
        s.fail(err)
    finally:
        s.running = None


async def run_rewind(s: RemoteSession, w: _Rewind) -> None:
    """A new SGLang session holding the first `w.to` tokens replaces the current one."""
    e = s.engine
    if s.closed:
        return _fail(w, SessionClosedError(f"session {s.id} was closed"), "closed")
    if w.to == len(s.token_ids):
        w.done.set_result(w.to)
        return
    new = f"{s.id}.{s.revisions + 1}"
    try:
        await e.http.open_session(new)
        kept = list(s.token_ids[:w.to])
        try:
            for i in range(0, len(kept), PREFILL_PIECE):
                await e.http.prefill(new, kept[i:i + PREFILL_PIECE], f"{s.id}-p{next(_rids)}")
        except BaseException:
            with contextlib.suppress(StreamserveError):
                await e.http.close_session(new)
            raise
    except BackendRequestError as err:
        w.done.set_exception(RewindError(f"SGLang could not rebuild the session for the rewind: {err}"))
        return
    old, s.backend_id = s.backend_id, new
    with contextlib.suppress(StreamserveError):
        await e.http.close_session(old)
    with s.lock:
        s.revisions += 1
        del s.token_ids[w.to:]
        s.timeline = [x if x.end <= w.to else ChunkRecord(x.kind, x.seq, x.start, w.to, x.capture_time, x.deadline)
                      for x in s.timeline if x.start < w.to]
        s.next_seq = max((x.seq for x in s.timeline if x.seq is not None), default=-1) + 1
    w.done.set_result(w.to)
