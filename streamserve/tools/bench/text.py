"""Text sessions on the native protocol, through the client SDK (streamserve_client), paced in real time.

Each session has its own connection and one persistent session (window --window, 4 sinks). Every --chunk-ms it
appends the next few words of a text (2.5 words a second on average, as speech), with the chunk's scheduled time as
its capture time and --chunk-ms as its deadline, and waits for the ack before the next chunk (a late ack makes the
next chunk late too: its latency counts from its own schedule). Every --reply-every chunks it asks for a greedy
reply of --reply-tokens tokens, read while the chunks keep coming (they queue behind the reply on the server).

Measures (ms): `append_ms` (scheduled time -> ack), `reply_first_token_ms` and `reply_total_ms` (asked -> first
delta / done). A missed deadline: an append acked later than one chunk period after its scheduled time.
Counts: chunks, tokens appended, shed chunks, acks the server flagged deadline_missed, replies, reply tokens,
replies skipped (the previous one was still running).
"""

from __future__ import annotations

import asyncio
import random
import time

import streamserve_client as sc
from streamserve.tools.bench.config import BenchConfig
from streamserve.tools.bench.record import SessionRecord, code_of, wind_down

SINKS = 4
# Genesis 1:1-5, King James Version (public domain): the default model was trained on this Bible
WORDS = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
         "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
         "said, Let there be light: and there was light. And God saw the light, that it was good: and God divided "
         "the light from the darkness. And God called the light Day, and the darkness he called Night. And the "
         "evening and the morning were the first day.").split()


def fatal(e: BaseException) -> bool:
    """Whether the session cannot go on after `e` (its connection or the session itself is gone)."""
    if isinstance(e, sc.StreamserveClientError):
        return e.fatal or isinstance(e, (sc.ConnectionLostError, sc.UnknownSessionError, sc.StepFailedError))
    return True  # timeouts and socket errors: the session's state is unknown


async def text_session(cfg: BenchConfig, key: str | None, rec: SessionRecord, start: float) -> None:
    """One text session from monotonic time `start` for cfg.duration seconds; its figures go to `rec`."""
    period = cfg.chunk_ms / 1000
    rng = random.Random(rec.index)
    pos = rng.randrange(len(WORDS))
    client = sc.Client(cfg.url, api_key=key, reconnect=False)  # a dropped connection is an error, not hidden
    reply: asyncio.Task[None] | None = None
    try:
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        await asyncio.wait_for(client.connect(), cfg.turn_timeout)
        window = cfg.window or None
        session = await asyncio.wait_for(client.open_session(window=window, sinks=SINKS if window else None),
                                         cfg.turn_timeout)
        rec.started = True
        t0 = time.monotonic()
        k = 0
        while (due := t0 + k * period) < t0 + cfg.duration:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            n = rng.randint(1, 3)  # 1-3 words per 200 ms chunk: about speech's pace
            text = " " + " ".join(WORDS[(pos + i) % len(WORDS)] for i in range(n))
            pos += n
            k += 1
            rec.counts["chunks"] += 1
            try:
                ack = await asyncio.wait_for(session.append(text=text, capture_time=due, deadline_ms=cfg.chunk_ms),
                                             cfg.turn_timeout)
            except (sc.StreamserveClientError, asyncio.TimeoutError, OSError) as e:
                rec.error(code_of(e))
                if fatal(e):
                    return
                continue
            late = time.monotonic() - due
            rec.latency("append_ms", late)
            rec.missed += late > period
            rec.counts["tokens_appended"] += ack.tokens
            rec.counts["shed"] += ack.shed
            rec.counts["server_deadline_missed"] += ack.deadline_missed
            if cfg.reply_every and k % cfg.reply_every == 0:
                if reply is None or reply.done():
                    reply = asyncio.create_task(ask_reply(cfg, session, rec))
                else:
                    rec.counts["replies_skipped"] += 1
        if reply is not None:
            await reply
        rec.completed = True  # errors that ended the session returned above
    except (sc.StreamserveClientError, asyncio.TimeoutError, OSError) as e:
        rec.error(code_of(e))
    finally:
        await wind_down(reply, client.close)


async def ask_reply(cfg: BenchConfig, session: sc.Session, rec: SessionRecord) -> None:
    """A greedy reply of cfg.reply_tokens tokens, read to its end (or cfg.turn_timeout: `timeout`)."""
    asked = time.monotonic()
    first = True

    async def read() -> None:
        nonlocal first
        async for delta in session.respond(max_tokens=cfg.reply_tokens, temperature=0.0):
            if first:
                rec.latency("reply_first_token_ms", time.monotonic() - asked)
                first = False
            rec.counts["reply_tokens"] += len(delta.token_ids)

    try:
        await asyncio.wait_for(read(), cfg.turn_timeout)
    except (sc.StreamserveClientError, asyncio.TimeoutError, OSError) as e:
        rec.error(code_of(e))
        return
    rec.latency("reply_total_ms", time.monotonic() - asked)
    rec.counts["replies"] += 1
