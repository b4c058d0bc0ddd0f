"""Fault injection: the connection is cut in the middle of an utterance (raw native protocol over loopback, speech
streamed in 200 ms `append`s of pcm16 with seqs, the transport aborted as a network failure would, while chunks are
in flight). The session is resumed from a new connection with its resume token; the client sends again the chunks
whose acks it has not seen (same seq) and finishes the utterance. What the server acknowledged is neither lost nor
heard twice: the words appended to the session match an uninterrupted session fed the same audio, an acknowledged
seq sent again is refused as out of order, the cut connection's Listener is freed, and another connection's session
goes on untouched.

/v1/realtime is not covered: the Realtime API has no resume (docs/realtime.md, "One conversation, one persistent
session"): a cut there closes the connection's session, Listener included, at once.

Needs the voice extra and models (skips naming them otherwise).
"""

from __future__ import annotations

import asyncio
import difflib
import re
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest
import pytest_asyncio
import websockets
from serving import RunningServer, default_engine
from test_cut_connection import connect, idle_pool, raw, recv_type, reference, reply
from voice_assets import needs_voice, speech

from streamserve.config import ServerConfig

pytestmark = pytest.mark.asyncio(loop_scope="module")  # the module's server runs in the module's loop

RATE = 16000
CHUNK = 2 * RATE // 5  # bytes of pcm16 in 200 ms
SAID = "Please tell me which city is the capital of France and why it became so famous."  # 3.9 s, no long pause
CUT = 11  # the chunk (2.2 s in: mid-speech) from which chunks are in flight when the connection is cut
IN_FLIGHT = 2  # chunks sent back to back, unacknowledged, right before the cut
MARK = " Thank you."  # a text chunk after the utterance: its ack says every chunk before it is in the KV cache
# no reply at the end of speech: the session holds only what was heard (and the mark)
VOICE = {"turn_detection": {"type": "server_vad", "create_response": False, "interrupt_response": False}}
CONFIG = ServerConfig(messages_per_second=1000.0, resume_ttl=60.0)
WAIT_S = 120  # a hang guard only


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def voiced() -> AsyncIterator[RunningServer]:
    needs_voice()
    srv = await RunningServer.start(CONFIG, default_engine, voice=True)
    yield srv
    await srv.stop()


def chunks() -> list[bytes]:
    """Silence (0.5 s), SAID spoken, silence (1 s: past the VAD's 500 ms), as pcm16 at 16 kHz in 200 ms chunks."""
    x = np.concatenate([np.zeros(RATE // 2, np.float32), speech(SAID, RATE), np.zeros(RATE, np.float32)])
    pcm = np.clip(np.rint(x * 32768), -32768, 32767).astype("<i2").tobytes()
    return [pcm[i:i + CHUNK] for i in range(0, len(pcm), CHUNK)]


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def at_most_one_word_apart(want: list[str], got: list[str]) -> bool:
    """Whether `got` is `want` with at most one place changed, and there one word of `want` replaced by at most two
    (a word split in two halves heard as two fragments), dropped, or one word added that `want` never says (a
    fragment: a word of `want` said again would be audio heard twice)."""
    changes = [op for op in difflib.SequenceMatcher(a=want, b=got, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not changes:
        return True
    if len(changes) > 1:
        return False
    kind, a0, a1, b0, b1 = changes[0]
    if kind == "insert":
        return b1 - b0 == 1 and got[b0] not in want
    return a1 - a0 == 1 and b1 - b0 <= 2  # replace (a word for one or two fragments) or delete (one word)


async def open_voice(ws: websockets.ClientConnection) -> tuple[str, str]:
    await ws.send(raw({"type": "open", "id": 1, "voice": VOICE}))
    opened = await recv_type(ws, "opened")
    return opened["session"], opened["resume_token"]


async def send_audio(ws: websockets.ClientConnection, sid: str, seq: int, data: bytes) -> None:
    await ws.send(raw({"type": "append", "session": sid, "seq": seq, "audio": data, "rate": RATE}))


async def read_all(ws: websockets.ClientConnection, into: list[dict[str, Any]]) -> None:
    """Every message of the connection into `into`, until it ends."""
    try:
        async for frame in ws:
            into.append(msgpack.unpackb(frame))
    except websockets.ConnectionClosed:
        pass


async def until(seen: list[dict[str, Any]], found: Any) -> dict[str, Any]:
    """Wait (bounded) for the first message in `seen` for which `found` is true."""
    async def wait() -> dict[str, Any]:
        while True:
            for m in seen:
                if found(m):
                    return m
            await asyncio.sleep(0.02)

    return await asyncio.wait_for(wait(), WAIT_S)


async def detached(served: RunningServer, sid: str) -> None:
    """Until the server has seen the cut: the session is held by no connection."""
    registry = served.server.service.registry  # type: ignore[union-attr]
    while registry.find(sid).owner is not None:
        await asyncio.sleep(0.02)


async def session_text(served: RunningServer, ws: websockets.ClientConnection, sid: str, seq: int,
                       seen: list[dict[str, Any]]) -> str:
    """The session's whole text, once the mark (chunk `seq`, after the utterance's transcript chunks) is in."""
    await ws.send(raw({"type": "append", "session": sid, "seq": seq, "text": MARK}))
    await until(seen, lambda m: m["type"] == "ack" and m["seq"] == seq)
    entry = served.server.service.registry.find(sid)  # type: ignore[union-attr]
    assert entry is not None
    return served.engine.tokenizer.decode(list(entry.session.token_ids))


async def uninterrupted(served: RunningServer) -> str:
    """The text of an uninterrupted session fed the same audio, at the same real-time pace."""
    ws = await connect(served)
    seen: list[dict[str, Any]] = []
    sid, _ = await open_voice(ws)
    reader = asyncio.ensure_future(read_all(ws, seen))
    audio = chunks()
    for seq, data in enumerate(audio):
        await send_audio(ws, sid, seq, data)
        await asyncio.sleep(0.2)
    await until(seen, lambda m: m["type"] == "transcript" and "final" in m)
    text = await session_text(served, ws, sid, len(audio), seen)
    assert not [m for m in seen if m["type"] == "error"]
    await ws.send(raw({"type": "close", "session": sid, "id": 2}))
    await until(seen, lambda m: m["type"] == "closed")
    await ws.close()
    await reader
    return text


async def test_a_cut_in_the_middle_of_an_utterance_neither_loses_nor_repeats_audio(voiced: RunningServer) -> None:
    service = voiced.server.service
    assert service is not None
    want = await uninterrupted(voiced)
    assert "capital" in words(want), want  # the reference heard the speech
    # another connection, mid-session through the cut: it goes on as if nothing happened
    other = await connect(voiced)
    await other.send(raw({"type": "open", "id": 1}))
    other_sid = (await recv_type(other, "opened"))["session"]
    await other.send(raw({"type": "append", "session": other_sid, "seq": 0, "text": "In the beginning"}))
    other_tokens = (await recv_type(other, "ack"))["tokens"]

    audio = chunks()
    ws = await connect(voiced)
    seen: list[dict[str, Any]] = []
    sid, token = await open_voice(ws)
    reader = asyncio.ensure_future(read_all(ws, seen))
    for seq in range(CUT):  # real-time pace, each ack waited for: these are acknowledged before the cut
        await send_audio(ws, sid, seq, audio[seq])
        await until(seen, lambda m, s=seq: m["type"] == "ack" and m["seq"] == s)
        await asyncio.sleep(0.2)
    await until(seen, lambda m: m["type"] == "turn" and m["event"] == "speech_started")  # mid-utterance
    state = service.audio.states[sid]
    old = state.listener
    assert old is not None and old in service.audio.live
    for seq in range(CUT, CUT + IN_FLIGHT):  # in flight when the network fails
        await send_audio(ws, sid, seq, audio[seq])
    ws.transport.abort()
    await reader
    assert not [m for m in seen if m["type"] == "error"]
    acked = {m["seq"] for m in seen if m["type"] == "ack"}
    # the server sees the cut before the resume: the session is detached and its Listener ends its utterance (a
    # resume that races the cut takes the session over with its Listener, which then simply goes on listening)
    await asyncio.wait_for(detached(voiced, sid), WAIT_S)

    ws2 = await connect(voiced)
    seen2: list[dict[str, Any]] = []
    reader2 = asyncio.ensure_future(read_all(ws2, seen2))
    await ws2.send(raw({"type": "resume", "session": sid, "resume_token": token, "id": 2}))
    await ws2.send(raw({"type": "stats", "id": 3}))  # answered after the results the resume sends again
    resumed = await until(seen2, lambda m: m["type"] == "opened")
    assert resumed["resumed"]
    await until(seen2, lambda m: m["type"] == "stats")
    acked |= {m["seq"] for m in seen2 if m["type"] == "ack"}  # results the cut kept from the old connection
    assert set(range(CUT)) <= acked <= set(range(CUT + IN_FLIGHT))
    # a naive retry of an acknowledged chunk is refused (out of order), never heard twice; the session goes on
    await ws2.send(raw({"type": "append", "session": sid, "seq": CUT - 1, "audio": audio[CUT - 1], "rate": RATE}))
    refused = await until(seen2, lambda m: m["type"] == "error")
    assert refused["code"] == "invalid_input" and refused["seq"] == CUT - 1, refused
    seen2.remove(refused)
    for seq in range(CUT, len(audio)):  # the chunks whose acks never came (same seqs), then the rest of the speech
        if seq not in acked:
            await send_audio(ws2, sid, seq, audio[seq])
            await asyncio.sleep(0.2)
    await until(seen2, lambda m: m["type"] == "turn" and m["event"] == "speech_stopped")
    stopped = next(i for i, m in enumerate(seen2) if m["type"] == "turn" and m["event"] == "speech_stopped")
    await until(seen2, lambda m: m["type"] == "transcript" and "final" in m and seen2.index(m) > stopped)
    got = await session_text(voiced, ws2, sid, len(audio), seen2)
    assert not [m for m in seen2 if m["type"] == "error"]

    print(f"\nreference: {want!r}\ncut:       {got!r}")
    # Nothing lost, nothing heard twice. Exact equality is not always possible: the cut splits the utterance in two
    # (the cut Listener ends it after the last chunk it acknowledged, which of the chunks in flight the server read
    # first is a race; the new Listener hears the rest as an utterance of its own), so a word the split falls in is
    # heard by two Whisper passes over its halves, and may come out whole, as a fragment, or not at all. What must
    # hold: the words are the reference's, but for at most one word at the split (seen on a 2-core CPU: identical,
    # only the punctuation at the split differs). Audio lost at the cut (the utterance's unagreed words, as before
    # the cut Listener ended its utterance) drops several words; audio heard twice repeats them.
    assert at_most_one_word_apart(words(want), words(got)), (want, got)
    assert not re.search(r"[.,!?][A-Za-z]", got), got  # the utterance after the cut is a new word, not glued on

    # the cut connection's Listener was freed (the resumed session listens with a new one)
    async def freed() -> None:
        while old in service.audio.live:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(freed(), WAIT_S)
    # the other connection's session took its chunks and answers as an uninterrupted one does
    await other.send(raw({"type": "append", "session": other_sid, "seq": 1, "text": " God created"}))
    assert (await recv_type(other, "ack"))["tokens"] > 0
    _, expected = await reference(voiced, "In the beginning God created", 4)
    assert await reply(other, other_sid, 4) == expected
    await ws2.send(raw({"type": "close", "session": sid, "id": 4}))
    await until(seen2, lambda m: m["type"] == "closed")
    await other.send(raw({"type": "close", "session": other_sid, "id": 3}))
    await recv_type(other, "closed")
    await ws2.close()
    await other.close()
    await reader2
    assert other_tokens > 0
    await idle_pool(voiced)  # no session, no KV page left
    assert service.audio.active() == 0
