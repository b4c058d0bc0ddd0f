"""Images over the native protocol, end to end over loopback: the real server with its vision model
(EfficientNet-Lite0), the default model, the Python SDK. An image appended -> its ack -> the note in the session's
text; an unchanged scene -> 0 tokens; chat sessions; bad images -> typed errors and the connection goes on; no
vision -> unsupported_modality; a model with an image encoder -> embeds; nothing left behind by a close.

Needs Pillow (the vision extra) and the pulled model (skips naming them otherwise).
"""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest
import pytest_asyncio
import websockets
from serving import RunningServer, default_engine, engine_paused, serve

import streamserve_client as sc
from streamserve.config import ServerConfig
from streamserve.media.vision import VISION_EXTRA, VISION_MODEL

pytestmark = pytest.mark.asyncio(loop_scope="module")

CONFIG = ServerConfig(messages_per_second=1000.0)
ICONS = Path("/usr/share/icons/Adwaita/512x512/devices")
WAIT_S = 300  # a hang guard only


def needs_vision() -> None:
    pytest.importorskip("PIL.Image", reason=f"Pillow is not installed: {VISION_EXTRA}")
    from streamserve.models.store import installed

    if installed(VISION_MODEL) is None:
        pytest.skip(f"the vision model is not in the model cache: run `streamserve models pull {VISION_MODEL}`")


def picture(name: str, fmt: str = "PNG") -> bytes:
    """An Adwaita device icon on white, encoded (a real picture of one object)."""
    from PIL import Image

    path = ICONS / f"{name}.png"
    if not path.is_file():
        pytest.skip(f"{path} is not installed (the Adwaita icon theme)")
    icon = Image.open(path).convert("RGBA")
    canvas = Image.new("RGBA", icon.size, (255, 255, 255, 255))
    canvas.alpha_composite(icon)
    buf = io.BytesIO()
    canvas.convert("RGB").save(buf, fmt)
    return buf.getvalue()


def session_text(srv: RunningServer, session_id: str) -> str:
    entry = srv.server.service.registry.find(session_id)
    assert entry is not None
    return srv.engine.tokenizer.decode(list(entry.session.token_ids))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def seeing() -> AsyncIterator[RunningServer]:
    needs_vision()
    srv = await RunningServer.start(CONFIG, default_engine, vision=True)
    yield srv
    await srv.stop()


async def test_hello_reports_the_labels_path(seeing: RunningServer) -> None:
    async with sc.connect(seeing.url) as client:
        assert "image" in client.hello["modalities"]
        image = client.hello["image"]
        assert image["input"] == "labels" and image["model"] == VISION_MODEL and image["max_pixels"] > 0


async def test_an_image_becomes_a_note_once_per_scene(seeing: RunningServer) -> None:
    from PIL import Image

    async with sc.connect(seeing.url) as client:
        s = await client.open_session(max_tokens=4)
        await s.append(text="A desk.")
        ack = await s.append(image=picture("input-mouse"))
        assert ack.tokens > 0 and ack.seq == 1
        assert "The camera shows: mouse" in session_text(seeing, s.id)
        length = len(seeing.server.service.registry.find(s.id).session.token_ids)
        same = np.array(Image.open(io.BytesIO(picture("input-mouse", "JPEG"))))  # the same scene, as an array
        ack = await s.append(image=same)
        assert ack.tokens == 0 and ack.seq == 2  # nothing new to say: acked, nothing appended
        assert len(seeing.server.service.registry.find(s.id).session.token_ids) == length
        ack = await s.append(image=picture("input-gaming"))
        assert ack.tokens > 0
        text = session_text(seeing, s.id)
        assert text.count("The camera shows:") == 2 and "joystick" in text.split("The camera shows:")[-1]
        assert (await s.append(text=" What do you see?")).tokens > 0  # seqs go on after the 0-token ack
        reply = s.respond(temperature=0.0)
        assert await asyncio.wait_for(reply.wait(), WAIT_S) in ("length", "stop")
        await s.rewind(to_seq=0)  # the notes are gone: the same scene is noted again
        assert (await s.append(image=picture("input-gaming"), seq=10)).tokens > 0
        await s.close()
    images = seeing.server.service.images
    assert s.id not in images.notes and s.id not in images.locks  # a close forgets the session's scene


async def test_a_shed_note_is_noted_again(seeing: RunningServer) -> None:
    """A note is a "video" chunk: under load the engine may shed it (an older frame past its deadline with a newer
    one queued). The session then lacks it, so the same scene is noted again at the next image."""
    async with sc.connect(seeing.url) as client:
        s = await client.open_session()
        mouse = picture("input-mouse")
        stats = seeing.engine.stats
        with engine_paused(seeing.engine):
            note = asyncio.ensure_future(s.append(image=mouse, deadline_ms=20))
            await until(lambda: stats()["queued_chunks"] == 1)
            newer = asyncio.ensure_future(s.append(text=" (a newer frame)", kind="video", deadline_ms=20))
            await until(lambda: stats()["queued_chunks"] == 2)
            await asyncio.sleep(0.1)  # both deadlines pass while the engine is held
        first, second = await asyncio.wait_for(asyncio.gather(note, newer), WAIT_S)
        assert first.shed and first.tokens == 0 and not second.shed
        assert "The camera shows" not in session_text(seeing, s.id)
        assert (await s.append(image=mouse)).tokens > 0  # not taken for already said
        assert "The camera shows: mouse" in session_text(seeing, s.id)
        await s.close()


async def test_a_chat_session_gets_the_note_as_a_user_message(seeing: RunningServer) -> None:
    async with sc.connect(seeing.url) as client:
        s = await client.open_session(chat=True, max_tokens=4)
        await s.append(message={"role": "system", "content": "You describe what the camera shows."})
        ack = await s.append(image=picture("input-mouse"))
        assert ack.tokens > 0
        assert "User: The camera shows: mouse" in session_text(seeing, s.id)
        assert (await s.append(image=picture("input-mouse"))).tokens == 0
        reply = s.respond(temperature=0.0)
        assert await asyncio.wait_for(reply.wait(), WAIT_S) in ("length", "stop")
        await s.close()


async def test_bad_images_get_typed_errors_and_the_connection_goes_on(seeing: RunningServer) -> None:
    async with sc.connect(seeing.url) as client:
        s = await client.open_session()
        with pytest.raises(sc.InvalidInputError) as info:  # checked by the SDK before sending
            await s.append(image=b"GIF89a not a picture")
        assert info.value.code == "invalid_input"
        for bad in (b"\x89PNG\r\n\x1a\n" + b"\0" * 100, b"\xff\xd8\xff\xe0" + b"\x13" * 300):  # damaged files
            with pytest.raises(sc.InvalidInputError) as info:
                await s.append(image=bad)
            assert info.value.code == "invalid_image", info.value
        assert (await s.append(text="Still here.")).tokens > 0
    ws = await websockets.connect(seeing.url + "/v1/stream")  # arrays the SDK would refuse, sent raw
    try:
        await ws.recv()  # hello
        await ws.send(msgpack.packb({"type": "open", "id": 1}))
        sid = msgpack.unpackb(await ws.recv())["session"]
        arrays = [{"__ndarray__": True, "data": b"\0" * 12, "dtype": "<i2", "shape": [2, 2, 3]},  # int16
                  {"__ndarray__": True, "data": b"\0" * 5, "dtype": "|u1", "shape": [2, 2, 3]},  # short data
                  {"__ndarray__": True, "data": np.full(12, np.nan, "<f4").tobytes(), "dtype": "<f4",
                   "shape": [2, 2, 3]},  # NaN
                  {"__ndarray__": True, "data": b"\0" * 16, "dtype": "|u1", "shape": [2, 2, 4, 1]},  # 4 dims
                  {"data": b"\0" * 12}, "text, not an image"]
        for n, image in enumerate(arrays):
            await ws.send(msgpack.packb({"type": "append", "session": sid, "seq": n, "image": image}))
            m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), WAIT_S))
            assert m["type"] == "error" and m["code"] == "invalid_image" and not m["fatal"], m
        good = {"__ndarray__": True, "data": np.full((40, 40, 3), 200, np.uint8).tobytes(), "dtype": "|u1",
                "shape": [40, 40, 3]}
        await ws.send(msgpack.packb({"type": "append", "session": sid, "seq": 7, "image": good}))
        m = msgpack.unpackb(await asyncio.wait_for(ws.recv(), WAIT_S))
        assert m["type"] == "ack" and m["seq"] == 7, m
    finally:
        await ws.close()


async def test_a_connection_dropped_mid_image_leaves_nothing_held_and_the_scene_consistent(
        seeing: RunningServer) -> None:
    """The connection goes while its image waits for the vision thread (held busy here): the thread's queue drains,
    the session's image lock is free, and after a resume the scene notes agree with what the session holds (the
    note is in it and the same image adds nothing, or it is not and the image is noted); a close forgets them."""
    service = seeing.server.service
    worker = service.vision.worker
    ws = await websockets.connect(seeing.url + "/v1/stream")
    await ws.recv()  # hello
    await ws.send(msgpack.packb({"type": "open", "id": 1}))
    opened = msgpack.unpackb(await ws.recv())
    sid, token = opened["session"], opened["resume_token"]
    mouse = picture("input-mouse")
    gate = threading.Event()
    worker.executor.submit(gate.wait, WAIT_S)  # the vision thread is busy until the gate opens
    try:
        await ws.send(msgpack.packb({"type": "append", "session": sid, "seq": 0, "image": mouse}, use_bin_type=True))
        await until(lambda: worker.pending == 1)  # the image waits for the thread: its append is under way
        await ws.close()
    finally:
        gate.set()
    await until(lambda: service.registry.find(sid).owner is None)  # the disconnect is through
    await until(lambda: worker.pending == 0 and not service.images.locks[sid].locked()
                and service.engine.stats()["queued_chunks"] == 0)
    async with sc.connect(seeing.url) as client:
        s = await client.resume_session(sid, token)
        noted = "The camera shows: mouse" in session_text(seeing, sid)
        ack = await s.append(image=mouse, seq=5)
        assert (ack.tokens == 0) if noted else (ack.tokens > 0), (noted, ack)
        assert session_text(seeing, sid).count("The camera shows: mouse") == 1
        await s.close()
    assert sid not in service.images.notes and sid not in service.images.locks


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(WAIT_S * 100):  # a hang guard only
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


async def test_without_vision_images_are_unsupported_naming_what_to_install() -> None:
    async with serve(CONFIG) as srv, sc.connect(srv.url) as client:
        assert "image" not in client.hello["modalities"] and client.hello.get("image") is None
        s = await client.open_session()
        with pytest.raises(sc.UnsupportedModalityError) as info:
            await s.append(image=np.zeros((8, 8, 3), np.uint8))
        assert VISION_EXTRA in info.value.message and f"streamserve models pull {VISION_MODEL}" in info.value.message
        assert (await s.append(text="Text still works.")).tokens > 0


async def test_loading_without_the_model_names_the_pull_command(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("PIL.Image", reason=f"Pillow is not installed: {VISION_EXTRA}")
    from streamserve.media.vision import VisionUnavailableError
    from streamserve.server.media.vision import VisionRuntime

    monkeypatch.setenv("STREAMSERVE_HOME", str(tmp_path))  # an empty model cache
    with pytest.raises(VisionUnavailableError, match=f"streamserve models pull {VISION_MODEL}") as info:
        VisionRuntime.load()
    assert info.value.code == "unsupported_modality"


async def test_the_vision_thread_is_bounded() -> None:
    needs_vision()
    from streamserve.server.media.vision import VisionBusyError, VisionRuntime

    runtime = VisionRuntime.load()
    runtime.worker.max_pending = 1
    try:
        frame = np.zeros((64, 64, 3), np.uint8)
        first, second = await asyncio.gather(runtime.labels(frame), runtime.labels(frame), return_exceptions=True)
        assert isinstance(first, list) and len(first) == 5 and isinstance(second, VisionBusyError)
        assert runtime.worker.pending == 0 and isinstance(await runtime.labels(frame), list)
    finally:
        runtime.close()


async def test_a_model_with_an_image_encoder_sees_images_as_embeddings(tmp_path: Path) -> None:
    """A checkpoint shipping an image projector takes images natively: appends become embeds chunks of (size /
    patch) ** 2 vectors, with no classifier (the server has no vision model loaded here); hello says so."""
    pytest.importorskip("PIL.Image", reason=f"Pillow is not installed: {VISION_EXTRA}")
    from streamserve.engine import Engine
    from streamserve.engine.loading import DEFAULT_MODEL_DIR
    from streamserve.media.encoder import save_image_projector

    folder = tmp_path / "seeing"
    folder.mkdir()
    for f in DEFAULT_MODEL_DIR.iterdir():
        (folder / f.name).symlink_to(f)
    hidden = Engine.from_pretrained(DEFAULT_MODEL_DIR, device="cpu", kv_memory="16MiB").config.hidden_size
    rng = np.random.default_rng(0)
    save_image_projector(folder, (rng.standard_normal((16 * 16 * 3, hidden)) * 0.01).astype(np.float32), 16, 64)

    def load() -> Engine:
        return Engine.from_pretrained(folder, device="cpu", kv_memory="128MiB")

    async with serve(CONFIG, load) as srv, sc.connect(srv.url) as client:
        assert client.hello["image"]["input"] == "encoder" and "image" in client.hello["modalities"]
        s = await client.open_session(max_tokens=4)
        await s.append(text="Look:")
        ack = await s.append(image=rng.integers(0, 256, (120, 160, 3), dtype=np.uint8), kind="image")
        assert ack.tokens == 16  # (64 / 16) ** 2
        assert (await s.append(image=np.zeros((64, 64, 3), np.uint8))).tokens == 16  # every image: no notes here
        reply = s.respond(temperature=0.0)
        assert await asyncio.wait_for(reply.wait(), WAIT_S) in ("length", "stop")
        with pytest.raises(sc.InvalidInputError) as info:
            await s.append(image=b"\x89PNG\r\n\x1a\n" + b"\0" * 50)
        assert info.value.code == "invalid_image"
        chat = await client.open_session(chat=True)
        with pytest.raises(sc.UnsupportedModalityError):
            await chat.append(image=np.zeros((64, 64, 3), np.uint8))
