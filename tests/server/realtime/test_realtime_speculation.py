"""/v1/realtime: a reply speculated at the likely end of a turn (server/media/voice/speculate.py). A pause in the middle
of an utterance, long enough for the VAD to score silence and for the first half's words to look complete but
shorter than the hangover, starts a reply that is taken back when speech resumes: not one event or audio byte of
it reaches the client, the chat returns exactly to where it stood (token ids, messages, the open message), and
the final transcript holds both halves; the reply at the real end is released as if it had started then."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from rt import RawRealtime
from serving import serve
from speculation_probe import watch_take_backs
from test_realtime_turns import RATE, play
from voice_assets import norm_words, speech

from streamserve.config import ServerConfig
from streamserve.server.adapters.realtime import speculation

PAUSE_S, HANGOVER_MS = 0.45, 1000


def paused_utterance() -> bytes:
    """A question, a pause shorter than the hangover, a second question, then silence."""
    parts = [np.zeros(RATE // 2, np.float32), speech("What is the capital of France?", rate=RATE),
             np.zeros(int(RATE * PAUSE_S), np.float32), speech("And what about Spain?", rate=RATE),
             np.zeros(int(RATE * 2.5), np.float32)]
    return (np.clip(np.concatenate(parts), -1.0, 1.0) * 32767).astype("<i2").tobytes()


@pytest.mark.asyncio
async def test_a_pause_shorter_than_the_hangover_leaks_nothing_and_rewinds_exactly(
        voiced: None, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = watch_take_backs(monkeypatch, speculation)
    async with serve(ServerConfig(), voice=True) as srv:
        assert srv.server.service is not None and srv.server.service.voice is not None
        counts = srv.server.service.voice.speculations.counts
        c = await RawRealtime.connect(srv.http)
        vad = {"type": "server_vad", "silence_duration_ms": HANGOVER_MS}
        await c.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["audio"],
                                                            "max_output_tokens": 8,
                                                            "audio": {"input": {"turn_detection": vad}}}})
        await c.until("session.updated")
        sender = asyncio.create_task(play(c, paused_utterance()))
        got = await c.until("response.done")
        await sender
        kinds = [m["type"] for m in got]
        assert "error" not in kinds, got
        assert counts["taken_back"] >= 1, counts  # the pause did start a reply, and it was taken back
        assert counts["released"] == 1, counts  # the real end: speculated too, and released
        assert checks and all(all(ok) for ok in checks), checks
        assert kinds.count("input_audio_buffer.speech_started") == 1  # one utterance, never split
        assert kinds.count("response.created") == 1  # the taken-back reply sent nothing
        committed = kinds.index("input_audio_buffer.committed")
        assert kinds.index("input_audio_buffer.speech_stopped") < committed < kinds.index("response.created")
        assert not any(k.startswith(("response.", "output_audio")) for k in kinds[:committed]), kinds
        done = next(m for m in got if m["type"] == "conversation.item.input_audio_transcription.completed")
        words = norm_words(done["transcript"])
        assert "france" in words and "spain" in words, done  # both halves in the final transcript
        session = srv.server.service.chats.get(c_session(srv))
        assert session is not None
        assert [m["role"] for m in session.messages] == ["user", "assistant"]  # nothing of the taken-back reply
        assert session.messages[0]["content"] == done["transcript"]
        assert session.template.decode(session.session.token_ids).startswith(session.render(session.messages[:1]))
        await c.close()


def c_session(srv: Any) -> str:
    """The id of the one chat session the server holds (the connection's)."""
    ids = list(srv.server.service.chats.transcripts)
    assert len(ids) == 1, ids
    return ids[0]
