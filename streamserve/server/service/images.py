"""Images into sessions: the session service's image appends (`ImageSessions`), over the vision model of one
server (server/media/vision.py: `VisionRuntime`, its thread, the served model's image encoder).

Two paths, chosen per served model (hello's `image.input`):
- "encoder": the model's checkpoint ships an image encoder (streamserve/media/encoder.py,
  `image_projector.safetensors`): an image becomes an `embeds` chunk [T, hidden] the model reads in place of token
  embeddings;
- "labels": a text-only model, with the vision model loaded (EfficientNet-Lite0, streamserve/media/vision.py): the
  image's ImageNet labels become a short text note ("The camera shows: coffee mug, desk.") appended as text, and
  only when the session's label set changed (`SceneNotes`); an unchanged image is acked with 0 tokens. On a chat
  session the note goes in as a user message. A note shed under load or refused is noticed at the next image and
  said again.
Neither: images are refused with `unsupported_modality`, naming the extra and the pull command.

Decoding and inference never run on the event loop (every connection would stall) nor on the engine thread (decode
would stall): one thread of their own, one image at a time, with at most MAX_PENDING images waiting (more are
refused with `vision_busy`, nothing taken: a camera drops that frame). An image's bytes count against its
connection's media account (server/media/media_budget.py) from its append until it is labelled or encoded: past the
connection's or the server's media budget it is refused (`quota_exceeded`, `server_busy`), nothing taken.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from streamserve.media.vision import MAX_PIXELS, VISION_MODEL, SceneNotes, VisionUnavailableError
from streamserve.server.media import media_budget
from streamserve.server.media.vision import Worker, unavailable
from streamserve.server.service.results import AppendRequest, ChunkResult, ImageInfo

if TYPE_CHECKING:  # pragma: no cover
    from streamserve.media.encoder import ImageEncoder
    from streamserve.server.media.vision import VisionRuntime
    from streamserve.server.service.registry import SessionRegistry
    from streamserve.server.service.seqs import ClientSeqs


class ImageSessions:
    """Image appends of the session service (service.py): each becomes what the service appends (a note as
    text, a chat message, or embeds) or is answered at once (an unchanged scene: 0 tokens)."""

    def __init__(self, vision: VisionRuntime | None, encoder: ImageEncoder | None, registry: SessionRegistry,
                 seqs: ClientSeqs, chat: Callable[[str], bool]) -> None:
        self.vision, self.encoder, self.registry, self.seqs, self.chat = vision, encoder, registry, seqs, chat
        self.worker = vision.worker if vision is not None and encoder is None else Worker("streamserve-image")
        self.notes: dict[str, SceneNotes] = {}  # per session: the labels its last note named
        self.locks: dict[str, asyncio.Lock] = {}  # per session: images in arrival order (notes compare in order)
        self.noted: dict[str, int] = {}  # per session: the seq of its last note chunk, until its ack is seen

    def info(self) -> ImageInfo | None:
        if self.encoder is not None:
            return ImageInfo("encoder", None, MAX_PIXELS)
        return None if self.vision is None else ImageInfo("labels", VISION_MODEL, MAX_PIXELS)

    async def append(self, session_id: str, req: AppendRequest, deliver: Callable[[ChunkResult], Awaitable[None]],
                     then: Callable[[AppendRequest, Any], Awaitable[None]]) -> None:
        """An image append: what it becomes goes on through `then(request, chat message or None)` (the service's
        append); an image that adds nothing is answered through `deliver`. The session's images go one at a time
        (their notes compare in order, their chunks keep their seqs' order). Typed errors (invalid_image,
        vision_busy, unsupported_modality, and whatever `then` refuses), nothing taken."""
        if self.encoder is None and self.vision is None:
            raise unavailable()
        held = media_budget.Holding(media_budget.current(), "image")  # the append's connection (service.append)
        held.admit(req.image.nbytes if isinstance(req.image, np.ndarray) else len(req.image or b""))
        try:
            async with self.locks.setdefault(session_id, asyncio.Lock()):
                got = await self.prepare(session_id, req)
                held.drop()  # labelled or encoded: the image's bytes are no longer held
                if isinstance(got, ChunkResult):
                    return await deliver(got)
                try:
                    await then(*got)
                except BaseException:
                    self.rewound(session_id)  # the note is not in the session: the next image notes its scene again
                    raise
                if self.encoder is None and got[0].seq is not None:  # a note: shed or refused later, it is not said
                    self.noted[session_id] = got[0].seq  # its ack is looked at before the next note
        finally:
            held.drop()  # refused, failed or cancelled on the way: given back all the same

    async def prepare(self, session_id: str, req: AppendRequest) -> tuple[AppendRequest, Any] | ChunkResult:
        """-> (the request to append in the image's place, the chat message or None), or the ChunkResult of an
        image that adds nothing (its labels are the session's last note's)."""
        t0 = time.perf_counter()
        if self.encoder is not None:
            import torch

            if self.chat(session_id):
                raise VisionUnavailableError("images into a chat session of a model with an image encoder are not "
                                             "supported yet: open the session without chat")
            vectors = await self.worker.run(self._encode, req.image)  # [T, hidden] float32
            return replace(req, image=None, embeds=torch.from_numpy(vectors), kind=req.kind or "video"), None
        assert self.vision is not None
        labels = await self.vision.describe(req.image)
        self.check_last_note(session_id)
        if session_id not in self.notes and len(self.notes) >= len(self.registry) + 64:
            self.prune()
        note = self.notes.setdefault(session_id, SceneNotes()).update(labels)
        if note is None:  # the session already has this scene: nothing to append
            self.seqs.client_used(session_id, req.seq)
            entry = self.registry.find(session_id)
            seq = req.seq if req.seq is not None or entry is None else entry.session.next_seq
            return ChunkResult(session_id, seq, req.capture_time, 0, 0.0, round(1e3 * (time.perf_counter() - t0), 3))
        if self.chat(session_id):
            return replace(req, image=None, kind="text"), {"role": "user", "content": note}
        return replace(req, image=None, text=f"\n{note}\n", kind=req.kind or "video"), None

    def _encode(self, data: bytes | np.ndarray) -> np.ndarray:
        from streamserve.media.vision import decode_image

        assert self.encoder is not None
        return self.encoder.encode(decode_image(data))

    def check_last_note(self, session_id: str) -> None:
        """The session's last note chunk was shed (kind "video", under load) or failed: it is not in the session,
        so the scene is noted again. Its result is among the session's recent ones once it has come."""
        seq, entry = self.noted.get(session_id), self.registry.find(session_id)
        if seq is None or entry is None:
            return
        result = next((r for r in reversed(entry.recent) if r.seq == seq), None)
        if result is not None:
            del self.noted[session_id]
            if result.shed or result.error is not None:
                self.rewound(session_id)

    def rewound(self, session_id: str) -> None:
        """The session lost chunks (perhaps its last note): the next image is noted again whatever it shows."""
        self.noted.pop(session_id, None)
        notes = self.notes.get(session_id)
        if notes is not None:
            notes.reset()

    def prune(self) -> None:
        """Forget the notes of sessions the registry no longer holds (one it evicted to make room, say)."""
        for sid in [sid for sid in self.notes if self.registry.find(sid) is None]:
            self.forget(sid)

    def forget(self, session_id: str) -> None:
        self.notes.pop(session_id, None)
        self.noted.pop(session_id, None)
        lock = self.locks.get(session_id)
        if lock is not None and not lock.locked():
            del self.locks[session_id]

    def close(self) -> None:
        if self.vision is None or self.worker is not self.vision.worker:
            self.worker.close()
