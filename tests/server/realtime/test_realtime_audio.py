"""/v1/realtime with voice, against a real server with the voice models: synthesised speech (the Piper voice) sent as
PCM16 24 kHz in 20 ms appends at real-time pace. Server VAD turns, the transcript streamed into the session, spoken
replies; barge-in and truncation; bad audio answered with error events. Skips (naming what to install or pull) when
the voice extra or a voice model is missing."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from openai import AsyncOpenAI
from rt import RawRealtime, check_event, user_text
from serving import serve
from voice_assets import speech

from streamserve.config import ServerConfig
from streamserve.engine import Engine

RATE = 24000
FRAME = RATE * 2 // 50  # bytes of 20 ms of PCM16 at 24 kHz
QUESTION = "Which city is the capital of France?"


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def spoken(text: str, lead_s: float = 0.4, tail_s: float = 1.5) -> bytes:
    """`text` spoken, with silence before and after (the tail lets the VAD see the end of speech)."""
    silence = np.zeros(int(RATE * lead_s), np.float32), np.zeros(int(RATE * tail_s), np.float32)
    return pcm16(np.concatenate([silence[0], speech(text, rate=RATE), silence[1]]))


async def frames(data: bytes) -> AsyncIterator[str]:
    """20 ms base64 frames of `data`, at real-time pace."""
    start = time.monotonic()
    for i in range(0, len(data), FRAME):
        yield base64.b64encode(data[i:i + FRAME]).decode()
        await asyncio.sleep(max(0.0, start + (i + FRAME) / (2 * RATE) - time.monotonic()))


@pytest.mark.asyncio
async def test_sdk_audio_conversation(voiced: None) -> None:
    data = spoken(QUESTION)
    async with serve(ServerConfig(), voice=True) as srv:
        client = AsyncOpenAI(api_key="unused", base_url=f"{srv.http}/v1")
        async with client.realtime.connect(model="default") as conn:
            created = await conn.recv()
            assert created.session.output_modalities == ["audio"]
            assert created.session.audio.input.transcription.model == "whisper-base"  # the text model's input path
            await conn.session.update(session={"type": "realtime", "max_output_tokens": 24})
            assert (await conn.recv()).type == "session.updated"

            async def send() -> None:
                async for frame in frames(data):
                    await conn.input_audio_buffer.append(audio=frame)

            sender = asyncio.create_task(send())
            kinds, audio, transcript, said = [], b"", "", None
            async for ev in conn:
                check_event(ev.to_dict())
                kinds.append(ev.type)
                if ev.type == "error":
                    raise AssertionError(ev.error)
                if ev.type == "conversation.item.input_audio_transcription.completed":
                    said = ev.transcript
                elif ev.type == "response.output_audio.delta":
                    audio += base64.b64decode(ev.delta)
                elif ev.type == "response.output_audio_transcript.delta":
                    transcript += ev.delta
                elif ev.type == "response.done":
                    done = ev.response
                    break
            await sender
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
             "conversation.item.input_audio_transcription.completed", "response.created",
             "response.output_audio.delta", "response.output_audio.done", "response.done"]
    assert all(k in kinds for k in order), kinds
    assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order), kinds  # in this order
    assert said is not None and "capital" in said.lower() and "france" in said.lower()
    assert len(audio) > RATE // 5 and len(audio) % 2 == 0  # at least 0.1 s of PCM16
    assert done.status in ("completed", "incomplete") and done.output[0].content[0].transcript == transcript


async def play(c: RawRealtime, data: bytes) -> None:
    async for frame in frames(data):
        await c.send({"type": "input_audio_buffer.append", "audio": frame})


@pytest.mark.asyncio
async def test_barge_in_cancels_and_truncates_to_what_was_heard(voiced: None) -> None:
    async with serve(ServerConfig(), voice=True) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "create_response": False, "interrupt_response": True}}}}})
        await c.send(user_text("In the beginning God created the heaven and the earth."))
        await c.send({"type": "response.create", "response": {"max_output_tokens": 400}})
        first = (await c.until("response.output_audio.delta"))[-1]
        item_id = first["item_id"]
        speaking = asyncio.create_task(play(c, spoken("Stop, please.", lead_s=0.1)))
        events = await c.until("response.done")
        kinds = [m["type"] for m in events]
        assert kinds.index("input_audio_buffer.speech_started") < kinds.index("response.done")
        done = events[-1]["response"]
        assert (done["status"], done["status_details"]["reason"]) == ("cancelled", "turn_detected")
        played = sum(len(base64.b64decode(m["delta"])) for m in c.seen if m["type"] == "response.output_audio.delta")
        heard_ms = min(300, played * 1000 // (2 * RATE))
        await c.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                      "audio_end_ms": heard_ms})
        truncated = (await c.until("conversation.item.truncated"))[-1]
        assert (truncated["item_id"], truncated["audio_end_ms"]) == (item_id, heard_ms)
        # the interrupting utterance becomes the next user item; its transcript can be final before the cancelled
        # reply's response.done (a pass over the held audio takes ~0.1 s), or after it
        if not any(m["type"] == "input_audio_buffer.committed" for m in c.seen):
            await c.until("input_audio_buffer.committed")
        await speaking
        await c.send({"type": "conversation.item.retrieve", "item_id": item_id, "event_id": "r"})
        item = (await c.until("conversation.item.retrieved"))[-1]["item"]
        heard = item["content"][0]["transcript"]
        spoken_text = done["output"][0]["content"][0]["transcript"]
        assert item["status"] == "incomplete" and len(heard) < len(spoken_text.strip())
        # the session holds what was heard, then the interruption: nothing the person did not hear
        chat = srv.server.service.chats
        (entry,) = srv.server.service.registry.all()
        # the truncation waited for the person's message to end, and its rewind and re-append run after that
        # message's committed event: poll (bounded) until the messages are back in
        for _ in range(400):
            messages = chat.get(entry.session.id).messages
            if len(messages) == 3:
                break
            await asyncio.sleep(0.05)
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        assert messages[1]["content"] == heard
        assert "stop" in messages[2]["content"].lower()
        await c.close()


@pytest.mark.asyncio
async def test_a_truncate_while_the_response_runs_is_taken(voiced: None) -> None:
    """Clients truncate as soon as they stop playing (at speech_started, before response.done): the item is
    truncatable from its first audio (it was refused with item_truncate_invalid_item_id until response.done). The
    response is stopped, and the session keeps what was heard."""
    async with serve(ServerConfig(), voice=True) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send(user_text("In the beginning God created the heaven and the earth."))
        await c.send({"type": "response.create", "response": {"max_output_tokens": 400}})
        item_id = (await c.until("response.output_audio.delta"))[-1]["item_id"]
        await c.send({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                      "audio_end_ms": 0, "event_id": "t"})
        got = await c.until("conversation.item.truncated")
        assert not [m for m in got if m["type"] == "error"], got
        assert got[-1]["item_id"] == item_id
        done = [m for m in c.seen if m["type"] == "response.done"]
        assert done and done[-1]["response"]["status"] == "cancelled"  # stopped before the rewind
        (entry,) = srv.server.service.registry.all()
        messages = srv.server.service.chats.get(entry.session.id).messages
        assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"] == ""
        await c.close()


@pytest.mark.asyncio
async def test_bad_audio_is_an_error_event_and_the_connection_goes_on(voiced: None) -> None:
    async with serve(ServerConfig(max_audio_buffer_s=1.0), voice=True) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x02\x03").decode()})
        assert (await c.error())["code"] == "invalid_audio_format"  # half a PCM16 sample
        await c.send({"type": "input_audio_buffer.append", "audio": "not base64!"})
        assert (await c.error())["param"] == "audio"
        too_long = base64.b64encode(bytes(2 * RATE * 2)).decode()  # 2 s, over max_audio_buffer_s
        await c.send({"type": "input_audio_buffer.append", "audio": too_long})
        assert (await c.error())["code"] == "audio_buffer_full"
        await c.send({"type": "input_audio_buffer.commit"})
        assert (await c.error())["code"] == "input_audio_buffer_commit_empty"
        await c.send({"type": "input_audio_buffer.clear"})
        await c.until("input_audio_buffer.cleared")
        await c.send(user_text("And God said"))
        await c.send({"type": "response.create", "response": {"max_output_tokens": 6}})
        done = (await c.until("response.done"))[-1]
        assert done["response"]["status"] in ("completed", "incomplete")
        await c.close()


@pytest.mark.models
@pytest.mark.asyncio
async def test_smollm2_answers_a_spoken_question(voiced: None) -> None:
    from streamserve.models import store

    if store.installed("smollm2-135m-instruct") is None:
        pytest.skip("smollm2-135m-instruct is not in the model cache; run `streamserve models pull "
                    "smollm2-135m-instruct`")

    def load() -> Engine:
        return Engine.from_pretrained("smollm2-135m-instruct", device="cpu", kv_memory="64MiB", offline=True)

    async with serve(ServerConfig(), load=load, voice=True) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": 40}})
        await play(c, spoken(QUESTION))
        events = await c.until("response.done")
        said = next(m["transcript"] for m in events
                    if m["type"] == "conversation.item.input_audio_transcription.completed")
        assert "capital" in said.lower()
        answer = events[-1]["response"]["output"][0]["content"][0]["transcript"]
        assert "Paris" in answer
        audio = b"".join(base64.b64decode(m["delta"]) for m in events if m["type"] == "response.output_audio.delta")
        assert len(audio) > RATE  # half a second of speech at least
        await c.close()


@pytest.mark.asyncio
async def test_g711_item_audio_is_transcribed_and_replies_speak_g711(voiced: None) -> None:
    from streamserve.media.audio import alaw_decode, ulaw_encode

    async with serve(ServerConfig(), voice=True) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send({"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
            "output": {"format": {"type": "audio/pcma"}}}}})
        session = (await c.until("session.updated"))[-1]["session"]
        assert session["audio"]["input"]["turn_detection"] is None
        assert session["audio"]["output"]["format"] == {"type": "audio/pcma"}
        question = base64.b64encode(ulaw_encode(speech(QUESTION, rate=8000))).decode()
        await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_audio", "audio": question}]}})
        item = (await c.until("conversation.item.added"))[-1]["item"]
        assert "capital" in item["content"][0]["transcript"].lower()
        await c.send({"type": "response.create", "response": {"max_output_tokens": 12}})
        events = await c.until("response.done")
        audio = b"".join(base64.b64decode(m["delta"]) for m in events if m["type"] == "response.output_audio.delta")
        assert len(audio) > 8000 // 10  # G.711: one byte a sample at 8 kHz
        assert float(np.sqrt(np.mean(alaw_decode(audio) ** 2))) > 0.01  # A-law speech, not silence
        await c.close()


@pytest.mark.asyncio
async def test_idle_timeout_triggers_a_response(voiced: None) -> None:
    async with serve(ServerConfig(), voice=True) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": 6, "audio": {
            "input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}}}}})
        await c.send(user_text("In the beginning"))
        await c.send({"type": "response.create"})
        await c.until("response.done")
        # nobody speaks: once the reply's audio has played out and 5 s passed, the server prompts a response
        events = await c.until("response.done")
        kinds = [m["type"] for m in events]
        assert "input_audio_buffer.timeout_triggered" in kinds
        assert kinds.index("input_audio_buffer.timeout_triggered") < kinds.index("response.created")
        await c.close()


@pytest.mark.asyncio
async def test_a_voice_connection_leaves_nothing_behind(voiced: None) -> None:
    async with serve(ServerConfig(resume_ttl=3600.0), voice=True) as srv:
        def state() -> tuple[int, int, int]:
            st = srv.engine.stats()
            return st["sessions_open"], st["kv_pages_used"], len(asyncio.all_tasks())

        before = state()
        c = await RawRealtime.connect(srv.http)
        await c.send(user_text("In the beginning God created the heaven and the earth."))
        await c.send({"type": "response.create", "response": {"max_output_tokens": 200}})
        await c.until("response.output_audio.delta")
        for frame in [base64.b64encode(bytes(FRAME)).decode()] * 10:  # the Listener has work too
            await c.send({"type": "input_audio_buffer.append", "audio": frame})
        await c.close()  # mid-reply, mid-speech: reply, Speaker, Listener and session all end
        after = state()
        for _ in range(600):  # poll (at most ~30 s): the closes run on executors
            if after == before:
                break
            await asyncio.sleep(0.05)
            after = state()
        assert after == before, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        srv.engine.check_integrity()


@pytest.mark.asyncio
async def test_semantic_vad_turns(voiced: None) -> None:
    """semantic_vad as OpenAI's Realtime API defines it: accepted and reported with its eagerness, a spoken question
    ends its turn and gets a reply; a bad eagerness is refused with the API's error and changes nothing."""
    async with serve(ServerConfig(), voice=True) as srv:
        c = await RawRealtime.connect(srv.http)
        await c.send({"type": "session.update", "session": {"type": "realtime", "max_output_tokens": 6, "audio": {
            "input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}}})
        updated = (await c.until("session.updated"))[-1]
        check_event(updated)
        assert updated["session"]["audio"]["input"]["turn_detection"] == {
            "type": "semantic_vad", "eagerness": "high", "create_response": True, "interrupt_response": True}
        await c.send({"type": "session.update", "session": {"type": "realtime", "audio": {
            "input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}}})
        error = (await c.until("error"))[-1]
        assert error["error"]["param"].endswith("turn_detection.eagerness")
        async for frame in frames(spoken(QUESTION, tail_s=2.5)):
            await c.send({"type": "input_audio_buffer.append", "audio": frame})
        events = await c.until("response.done")
        kinds = [m["type"] for m in events]
        assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("response.created")
        done = next(m for m in events if m["type"] == "conversation.item.input_audio_transcription.completed")
        assert "capital" in done["transcript"].lower()
        await c.close()
