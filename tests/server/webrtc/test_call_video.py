"""The camera track of a call: frames sampled and labelled by the server's vision model (efficientnet-lite0), the
note appended to the conversation's chat session when the labels change. Skips naming the pull command (or the
extra) when the vision model, Pillow or the Adwaita icons (the real picture) are missing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from rtc import CallClient
from serving import serve

from streamserve.config import ServerConfig

ICON = Path("/usr/share/icons/Adwaita/512x512/devices/input-mouse.png")


def mouse() -> np.ndarray:
    """A real picture of one object (a computer mouse) on white, uint8 RGB [512, 512, 3]."""
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed: it comes with the vision extra")
    if not ICON.is_file():
        pytest.skip(f"{ICON} is not installed (the Adwaita icon theme)")
    icon = Image.open(ICON).convert("RGBA")
    canvas = Image.new("RGBA", icon.size, (255, 255, 255, 255))
    canvas.alpha_composite(icon)
    return np.array(canvas.convert("RGB"))


def vision_model() -> None:
    from streamserve.models.store import installed
    from streamserve.server.media.vision import VISION_MODEL

    if installed(VISION_MODEL) is None:
        pytest.skip(f"the vision model is not in the model cache: run `streamserve models pull {VISION_MODEL}`")


@pytest.mark.asyncio
async def test_camera_frames_become_a_note_in_the_session() -> None:
    vision_model()
    picture = mouse()
    async with serve(ServerConfig(), vision=True) as srv:
        assert srv.server.service is not None and srv.server.service.vision is not None
        c = CallClient(camera=picture)
        await c.connect(srv.http, session={"type": "realtime", "video": {"fps": 2}})
        call = next(iter(srv.server.calls.live.values()))
        session = call.conn.session
        assert session is not None and call.video_fps == 2.0
        chats = srv.server.service.chats
        notes: list[str] = []
        for _ in range(1200):  # poll (at most ~60 s): frames are encoded, decoded, sampled and labelled
            chat = chats.get(session)
            notes = [m["content"] for m in (chat.messages if chat is not None else []) if "(camera)" in m["content"]]
            if notes:
                break
            await asyncio.sleep(0.05)
        assert notes and "mouse" in notes[0], notes
        assert call.camera is not None and call.camera.sampled >= 1 and call.camera.notes == 1
        # the same scene again and again: no second note (labels unchanged)
        sampled = call.camera.sampled
        while call.camera.sampled < sampled + 2:
            await asyncio.sleep(0.05)
        assert call.camera.notes == 1
        # a note that had to wait (the person was speaking when it came) goes in at the next quiet sample, though
        # the scene has not changed since
        call.pending_note = "a note that waited"
        for _ in range(1200):
            chat = chats.get(session)
            if chat is not None and any("(camera) a note that waited" in m["content"] for m in chat.messages):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the waiting note never went in")
        assert call.pending_note is None and call.camera.notes == 1
        await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What do you see?"}]}})
        await c.send({"type": "response.create", "response": {"max_output_tokens": 8}})
        got = await c.until("response.done")
        done = got[-1]["response"]
        assert done["status"] in ("completed", "incomplete"), done  # the note before it did not break the chat
        # the client saw the note as a system item (the page shows these), added and then done at its ack
        seen = [(m["type"], m["item"]["content"][0]["text"]) for m in got
                if m["type"] in ("conversation.item.added", "conversation.item.done") and m["item"]["role"] == "system"]
        waited = "(camera) a note that waited"
        assert seen == [("conversation.item.added", notes[0]), ("conversation.item.done", notes[0]),
                        ("conversation.item.added", waited), ("conversation.item.done", waited)], seen
        # a note still waiting when a response starts (no quiet sample came: the person never paused) goes in
        # before the reply's prompt, after the person's message: the model answers on the latest scene
        await call.camera.close()  # no more samples: only the response can let the note in
        call.pending_note = "a note before the reply"
        await c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "And now?"}]}})
        await c.send({"type": "response.create", "response": {"max_output_tokens": 4}})
        await c.until("response.done")
        chat = chats.get(session)
        assert chat is not None
        tail = [(m["role"], m["content"]) for m in chat.messages][-3:]
        assert tail[:2] == [("user", "And now?"), ("system", "(camera) a note before the reply")], tail
        assert tail[2][0] == "assistant" and call.pending_note is None, tail
        await c.close()
