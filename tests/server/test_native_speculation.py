"""The native protocol: a chat voice reply speculated at the likely end of a turn (server/service/voice_speculation.py).
A pause in the middle of an utterance, shorter than the hangover, starts a reply that is taken back when speech
resumes: none of its results reaches the client, the chat returns exactly to the mark (token ids, messages, the
open message), and the final transcript holds both halves; the reply at the real end is released. The SDK as users
run it; the real voice models. Needs the voice extra and models (skips naming them otherwise)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from serving import serve
from speculation_probe import watch_take_backs
from test_native_audio import RATE, WAIT_S, collect, stream
from voice_assets import needs_voice, norm_words, speech

import streamserve_client as sc
from streamserve.config import ServerConfig
from streamserve.server.service import voice_speculation

VOICE = {"turn_detection": {"type": "server_vad", "silence_duration_ms": 1000, "create_response": True},
         "speak": {"encoding": "pcm16", "rate": 24000, "channels": 1}, "input": {"rate": RATE}}


def paused_utterance() -> bytes:
    parts = [np.zeros(RATE // 2, np.float32), speech("What is the capital of France?", RATE),
             np.zeros(int(RATE * 0.45), np.float32), speech("And what about Spain?", RATE),
             np.zeros(int(RATE * 2.5), np.float32)]
    return np.clip(np.rint(np.concatenate(parts) * 32768), -32768, 32767).astype("<i2").tobytes()


@pytest.mark.asyncio
async def test_a_chat_voice_session_takes_a_speculated_reply_back_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    needs_voice()
    checks = watch_take_backs(monkeypatch, voice_speculation)
    async with serve(ServerConfig(messages_per_second=1000.0), voice=True) as srv:
        assert srv.server.service is not None and srv.server.service.voice is not None
        counts = srv.server.service.voice.speculations.counts
        async with sc.connect(srv.url) as client:
            session = await client.open_session(chat=True, voice=VOICE, max_tokens=8, temperature=0.0)
            events = asyncio.ensure_future(collect(session, sc.ReplyAudioDone))
            await stream(session, paused_utterance())
            got = await asyncio.wait_for(events, WAIT_S)
            chat = srv.server.service.chats.get(session.id)
            assert chat is not None
            messages = list(chat.messages)
    assert counts["taken_back"] >= 1 and counts["released"] == 1, counts
    assert checks and all(all(ok) for ok in checks), checks
    kinds = [type(e) for e in got]
    assert kinds.count(sc.SpeechStarted) == 1 and kinds.count(sc.ReplyDone) == 1, kinds
    final = next(e for e in got if isinstance(e, sc.TranscriptFinal))
    first_reply = min(i for i, k in enumerate(kinds) if k in (sc.ReplyText, sc.ReplyAudio, sc.ReplyDone))
    assert kinds.index(sc.SpeechStopped) < got.index(final) < first_reply  # nothing of a reply before the end
    assert {"france", "spain"} <= set(norm_words(final.text)), final.text
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == final.text
