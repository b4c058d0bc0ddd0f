"""Audio on sessions of the session service (server/service/voice_sessions.py), driven through SessionService directly
with the real voice models and the default model: what a refused reply does to the running one's speech, voice settings,
and what is left running after the service shuts down mid-reply.

Needs the voice extra and models (skips naming them otherwise).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from serving import default_engine, engine_paused
from voice_assets import needs_voice

from streamserve.config import ServerConfig
from streamserve.engine import Engine
from streamserve.errors import StreamserveError
from streamserve.server.service.auth import Grant
from streamserve.server.service.results import (
    AppendRequest,
    ChunkResult,
    OpenRequest,
    ReplyAudio,
    ReplyAudioDone,
    ReplyDelta,
    ReplyDone,
)
from streamserve.server.service.service import SessionService

pytestmark = pytest.mark.asyncio(loop_scope="module")

WAIT_S = 120  # a hang guard only
SPEAK = {"speak": {"encoding": "pcm16", "rate": 24000, "channels": 1}}
TEXT = "In the beginning God created the heaven and the earth."


class Collector:
    """A connection as the service sees it: everything pushed, and a way to wait for a kind of result."""

    def __init__(self) -> None:
        self.results: list[Any] = []
        self.arrived = asyncio.Event()

    async def push(self, result: Any) -> None:
        self.push_nowait(result)

    def push_nowait(self, result: Any) -> bool:
        self.results.append(result)
        self.arrived.set()
        return True

    async def wait_for(self, kind: type, n: int = 1) -> list[Any]:
        while len(got := [r for r in self.results if isinstance(r, kind)]) < n:
            self.arrived.clear()
            await self.arrived.wait()
        return got


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def parts() -> AsyncIterator[tuple[Engine, Any]]:
    needs_voice()
    from streamserve.server.media.voice.runtime import VoiceRuntime

    engine = await asyncio.to_thread(default_engine)
    runtime = await asyncio.to_thread(VoiceRuntime.load)
    yield engine, runtime
    runtime.close()
    engine.shutdown()


def service_of(parts: tuple[Engine, Any]) -> SessionService:
    engine, runtime = parts
    return SessionService(engine, ServerConfig(), voice=runtime)


async def opened_with_text(service: SessionService, voice: dict[str, Any] | None = SPEAK
                           ) -> tuple[Collector, Any, str]:
    col = Collector()
    ctx = service.connect(col, Grant())
    sid = (await service.open(ctx, OpenRequest(voice=voice))).session
    await service.append(ctx, sid, AppendRequest(text=TEXT))
    await asyncio.wait_for(col.wait_for(ChunkResult), WAIT_S)
    return col, ctx, sid


async def test_a_refused_reply_leaves_the_running_reply_speaking(parts: tuple[Engine, Any]) -> None:
    """respond while a reply runs is refused (response_in_progress); the running reply's audio must go on (it was
    cancelled: the new reply's speech took over before the new reply was known to start)."""
    service = service_of(parts)
    col, ctx, sid = await opened_with_text(service)
    service.respond(ctx, sid, {"max_tokens": 200, "temperature": 0.0, "stop": []})
    await asyncio.wait_for(col.wait_for(ReplyDelta), WAIT_S)  # the reply runs, and its Speaker exists
    with engine_paused(service.engine):  # it cannot finish meanwhile: the second respond meets it running
        assert not [r for r in col.results if isinstance(r, ReplyDone)]
        speaker = service.audio.states[sid].speaker
        assert speaker is not None
        with pytest.raises(StreamserveError) as refused:
            service.respond(ctx, sid, {"max_tokens": 4})
        assert refused.value.code == "response_in_progress"
        assert not speaker.cancelled  # the running reply still speaks
    service.cancel(ctx, sid)
    audio_done = (await asyncio.wait_for(col.wait_for(ReplyAudioDone), WAIT_S))[0]
    assert audio_done.reason == "cancelled"  # by the cancel, now
    await service.close(ctx, sid)
    assert service.audio.active() == 0


async def test_transcript_chunks_never_cost_the_client_an_out_of_order_seq(parts: tuple[Engine, Any]) -> None:
    """A client numbering its own chunks while the session's speech is appended as transcript chunks: a chunk whose
    seq a transcript took meanwhile is appended (renumbered), acked with the client's seq and the seq it holds; a
    seq the client itself used is still refused; rewind to the client's seq reaches the client's chunk."""
    from streamserve.server.media.voice import listen as L

    service = service_of(parts)
    col = Collector()
    ctx = service.connect(col, Grant())
    sid = (await service.open(ctx, OpenRequest(voice={"turn_detection": False}))).session
    entry = service.registry.find(sid)
    assert entry is not None

    async def append(seq: int, text: str) -> ChunkResult:
        n = len([r for r in col.results if isinstance(r, ChunkResult)])
        await service.append(ctx, sid, AppendRequest(seq=seq, text=text))
        return (await asyncio.wait_for(col.wait_for(ChunkResult, n + 1), WAIT_S))[-1]

    first = await append(0, TEXT)
    assert first.seq == 0 and first.chunk_seq is None
    await service.audio.on_event(sid, L.TranscriptDelta(" And God said"))  # the server numbers it: seq 1
    said = next(r for r in col.results if type(r).__name__ == "Transcript")
    assert said.seq == 1
    mine = await append(1, " Let there be light.")  # the client's seq 1, sent before it heard of the transcript
    assert mine.error is None, mine.error
    assert mine.seq == 1 and mine.chunk_seq == 2
    with pytest.raises(StreamserveError):  # the client's own seq again: out of order, as ever
        await service.append(ctx, sid, AppendRequest(seq=1, text=" again"))
    later = await append(2, " And there was light.")
    assert later.error is None and later.seq == 2 and later.chunk_seq == 3
    rewound = await service.rewind(ctx, sid, None, 1, None)  # keep through the client's chunk 1 (held as 2)
    assert rewound.tokens == len(entry.session.token_ids) and rewound.tokens > 0
    assert later.tokens > 0 and rewound.next_seq == 3
    again = await append(2, " And God saw the light.")  # numbering from the rewind point again
    assert again.error is None and again.seq == 2
    await service.close(ctx, sid)


async def test_voice_settings_left_out_keep_their_value_and_g711_needs_no_rate(parts: tuple[Engine, Any]) -> None:
    """configure: a turn_detection key left out keeps the session's value (as input's keys do); G.711 input is
    8 kHz by definition, so it needs no rate (it was refused: checked at 16 kHz); out-of-range values are refused
    with nothing changed."""
    service = service_of(parts)
    col = Collector()
    ctx = service.connect(col, Grant())
    sid = (await service.open(ctx, OpenRequest(voice={"turn_detection": {"threshold": 0.7,
                                                                           "create_response": False}}))).session
    v = service.configure(ctx, sid, None, None, {"turn_detection": {"silence_duration_ms": 800}}).voice
    assert v is not None and v.turn_detection is not None
    assert v.turn_detection["threshold"] == 0.7 and v.turn_detection["create_response"] is False
    assert v.turn_detection["silence_duration_ms"] == 800
    v = service.configure(ctx, sid, None, None, {"input": {"encoding": "g711_ulaw"}}).voice
    assert v is not None and v.input["encoding"] == "g711_ulaw"
    await service.append(ctx, sid, AppendRequest(audio=bytes(160)))  # 20 ms of mu-law, no rate given
    ack = (await asyncio.wait_for(col.wait_for(ChunkResult), WAIT_S))[-1]
    assert ack.error is None and ack.tokens == 0
    with pytest.raises(StreamserveError) as bad:
        service.configure(ctx, sid, None, None, {"turn_detection": {"threshold": 1.5}})
    assert bad.value.code == "invalid_turn_detection"
    v = service.configure(ctx, sid, None, None, None).voice
    assert v is not None and v.turn_detection is not None and v.turn_detection["threshold"] == 0.7
    await service.close(ctx, sid)
    assert service.audio.active() == 0


async def test_shutdown_mid_reply_and_mid_speech_leaves_nothing_running() -> None:
    """The server stops (SIGTERM) while a session is spoken to and its reply is being spoken: shutdown returns, no
    Listener or Speaker is left, nor any of their tasks, and the media executor is shut."""
    needs_voice()
    import numpy as np

    from streamserve.server.media.voice.runtime import VoiceRuntime

    engine = await asyncio.to_thread(default_engine)
    runtime = await asyncio.to_thread(VoiceRuntime.load)
    service = SessionService(engine, ServerConfig(), voice=runtime)
    col, ctx, sid = await opened_with_text(service, {**SPEAK, "turn_detection": False})
    tone = (0.3 * np.sin(np.arange(3200) * 0.1) * 32767).astype("<i2").tobytes()  # 200 ms at 16 kHz
    for _ in range(5):  # a Listener mid-utterance (turn detection off: it goes on until a commit)
        await service.append(ctx, sid, AppendRequest(audio=tone, rate=16000))
    service.respond(ctx, sid, {"max_tokens": 200, "temperature": 0.0, "stop": []})
    await asyncio.wait_for(col.wait_for(ReplyAudio), WAIT_S)
    assert service.audio.active() == 2  # the Listener and the reply's Speaker
    await asyncio.wait_for(service.shutdown(), WAIT_S)
    assert service.audio.active() == 0
    for _ in range(3):  # tasks cancelled by the shutdown end at their next turn of the loop
        await asyncio.sleep(0)
    left = [t.get_name() for t in asyncio.all_tasks()
            if t.get_name().startswith(("streamserve-listener", "streamserve-speaker")) and not t.done()]
    assert not left, left


async def test_a_resume_right_after_a_disconnect_listens_afresh(parts: tuple[Engine, Any]) -> None:
    """The connection drops mid-utterance and another resumes at once, before the old Listener has stopped: the
    resumed session's audio goes to a new Listener (it went to the one being closed, and was dropped); once the old
    one has stopped, only the new one is live; close leaves none."""
    import numpy as np

    service = service_of(parts)
    _, ctx, sid = await opened_with_text(service, {"turn_detection": False})
    tone = (0.3 * np.sin(np.arange(3200) * 0.1) * 32767).astype("<i2").tobytes()  # 200 ms at 16 kHz
    await service.append(ctx, sid, AppendRequest(audio=tone, rate=16000))
    old = service.audio.states[sid].listener
    assert old is not None
    token = service.registry.find(sid).resume_token  # type: ignore[union-attr]
    service.disconnect(ctx)
    col2 = Collector()
    ctx2 = service.connect(col2, Grant())
    await service.resume(ctx2, sid, token)
    await service.append(ctx2, sid, AppendRequest(audio=tone, rate=16000))
    new = service.audio.states[sid].listener
    assert new is not None and new is not old
    assert (await asyncio.wait_for(col2.wait_for(ChunkResult), WAIT_S))[-1].error is None
    for _ in range(200):  # the old Listener stops in a task of its own (bounded wait)
        if service.audio.active() == 1:
            break
        await asyncio.sleep(0.05)
    assert service.audio.live == {new}
    await service.close(ctx2, sid)
    assert service.audio.active() == 0


async def test_a_chat_utterance_cut_by_a_disconnect_does_not_block_the_chat(
        parts: tuple[Engine, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    """A chat session's spoken user message is open (streamed in as it is said) when the connection drops: the
    utterance is lost, as documented, and its message is taken out; after a resume the client's own message goes in
    and is acked (it waited for ever for the cut message's end)."""
    from chat_checkpoints import chat_checkpoint

    from streamserve.server.media.voice import listen as L

    folder = chat_checkpoint(tmp_path_factory.mktemp("voice-chat"), "chatml", seed=5)
    engine = await asyncio.to_thread(Engine.from_pretrained, folder, device="cpu", kv_memory="64MiB")
    try:
        service = SessionService(engine, ServerConfig(), voice=parts[1])
        col = Collector()
        ctx = service.connect(col, Grant())
        sid = (await service.open(ctx, OpenRequest(voice={"turn_detection": False}), chat=True)).session
        await service.audio.on_event(sid, L.TranscriptDelta(" Hello there"))  # the person's message opens
        assert service.chats.open_message(sid) is not None or service.audio.states[sid].message_open
        token = service.registry.find(sid).resume_token  # type: ignore[union-attr]
        service.disconnect(ctx)
        col2 = Collector()
        ctx2 = service.connect(col2, Grant())
        await service.resume(ctx2, sid, token)
        await service.append(ctx2, sid, AppendRequest(seq=5), {"role": "user", "content": "Good morning."})
        ack = (await asyncio.wait_for(col2.wait_for(ChunkResult), WAIT_S))[-1]
        assert ack.error is None and ack.tokens > 0
        assert service.chats.open_message(sid) is None
        assert [m["content"] for m in service.chats.chat(sid).messages if m["role"] == "user"] == ["Good morning."]
        await service.close(ctx2, sid)
    finally:
        engine.shutdown()
