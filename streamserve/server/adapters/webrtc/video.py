"""A call's camera track: drained continuously (only the newest frame is kept: nothing queues), sampled at `fps`
(default DEFAULT_FPS, at most MAX_FPS), each sample converted to an RGB array [H, W, 3] uint8 and labelled by the
server's vision model (`service.vision.labels(rgb) -> [(label, confidence)]`, server/media/vision.py). SceneNotes
(streamserve.media.vision) turns labels into a short text note only when they change; the note goes to `on_note`
(the call appends it to the conversation's session as a sheddable video chunk, call.py). `on_note` is called after
every sample, with None when nothing changed: a note that had to wait (the person was speaking) goes in at the next
quiet sample, not only when the scene changes again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

log = logging.getLogger("streamserve.server")

DEFAULT_FPS = 1.0  # camera frames sampled a second (the session configuration's `video.fps` changes it)
MAX_FPS = 5.0


class CameraSampler:
    def __init__(self, track: MediaStreamTrack, fps: float, vision: Any,
                 on_note: Callable[[str | None], Awaitable[None]]) -> None:
        self.track, self.fps, self.vision, self.on_note = track, fps, vision, on_note
        self.latest: Any = None  # the newest frame received and not yet sampled
        self.received = self.sampled = self.notes = self.failures = 0
        self.scene = self.make_scene()
        self.tasks = [asyncio.create_task(self.drain(), name="streamserve-webrtc-camera-drain")]
        if vision is not None and self.scene is not None:
            self.tasks.append(asyncio.create_task(self.sample(), name="streamserve-webrtc-camera-sample"))

    @staticmethod
    def make_scene() -> Any:
        try:
            from streamserve.media.vision import SceneNotes
        except ImportError:  # the vision module is not there: frames are drained and dropped
            log.warning("streamserve: no streamserve.media.vision: camera frames are not labelled")
            return None
        return SceneNotes(min_confidence=0.2, top=3)

    async def drain(self) -> None:
        try:
            while True:
                self.latest = await self.track.recv()
                self.received += 1
        except MediaStreamError:
            pass  # the track ended

    async def sample(self) -> None:
        period = 1.0 / self.fps
        while True:
            start = time.monotonic()
            frame, self.latest = self.latest, None
            if frame is not None:
                try:
                    rgb = await asyncio.to_thread(frame.to_ndarray, format="rgb24")  # [H, W, 3] uint8
                    labels = await self.vision.labels(rgb)
                    self.sampled += 1
                    note = self.scene.update(labels)
                    if note:
                        self.notes += 1
                    await self.on_note(note or None)
                except Exception:  # one bad frame, or the vision thread busy (vision_busy): skipped, counted
                    self.failures += 1
                    if self.failures == 1:  # the first is worth a traceback; the rest only a count
                        log.exception("streamserve: a camera frame could not be labelled")
            await asyncio.sleep(max(0.0, start + period - time.monotonic()))  # a slow model lowers the rate

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.wait(self.tasks)
