"""/v1/policy with camera images (the codec's image_keys): each image goes through the server's vision path, as a
native `append(image=...)` does, on the tick before the state: a text-only model gets a note of the image's ImageNet
labels (EfficientNet-Lite0; only when the labels change), a model with an image encoder its embeddings. Bad images
are invalid_observation; a server that takes no images refuses such a policy's clients at connect, naming the pull
command. The tests with the vision model skip naming the pull command when it (or Pillow, or the picture) is missing.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
import pytest
import websockets
from policy_fixture import POLICY, connect, expect_error, freed, infer, loader, obs, policy_checkpoint_at, policy_url
from policy_fixture import sessions as live_sessions
from serving import RunningServer

from streamserve.config import ServerConfig
from streamserve.media.encoder import save_image_projector
from streamserve.media.vision import MAX_PIXELS
from streamserve.robot.codec import PolicyCodec, PolicyInputError
from streamserve.server.adapters.policy import wire
from streamserve.server.adapters.policy.observation import parse_observation

H, D = POLICY["action_horizon"], POLICY["action_dims"]
CAMERA = "observation/image"
CONFIG = ServerConfig(messages_per_second=1000.0, max_frame_bytes=1 << 21)  # a 512 x 512 RGB frame fits
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


def png(rgb: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG")
    return out.getvalue()


def vision_model() -> None:
    from streamserve.models.store import installed
    from streamserve.server.media.vision import VISION_MODEL

    if installed(VISION_MODEL) is None:
        pytest.skip(f"the vision model is not in the model cache: run `streamserve models pull {VISION_MODEL}`")


def camera_checkpoint(folder: Path) -> Path:
    return policy_checkpoint_at(folder, image_keys=[CAMERA])


@pytest.mark.asyncio
async def test_an_image_becomes_a_label_note_before_the_state_and_only_when_the_scene_changes(tmp_path: Path) -> None:
    vision_model()
    picture = mouse()
    folder = camera_checkpoint(tmp_path / "cam")
    codec = PolicyCodec.load(folder)
    assert codec is not None
    srv = await RunningServer.start(CONFIG, loader(folder), vision=True)
    try:
        tok = srv.engine.tokenizer
        ws, meta = await connect(srv)
        assert meta["image_keys"] == [CAMERA] and meta["streamserve"]["images"]["input"] == "labels"
        state = (0.1, -0.2, 0.5)
        head = codec.prompt_ids(tok.encode("reach", add_special_tokens=False))
        tail = codec.state_ids(np.asarray(state))
        out = await infer(ws, obs(state, prompt="reach", **{CAMERA: picture}))
        assert out["actions"].shape == (H, D)
        [s] = live_sessions(srv)
        new = s.token_ids
        note = new[len(head):len(new) - len(tail) - H * D]  # between the prompt and the state
        assert new[:len(head)] == head and new[len(head) + len(note):len(new) - H * D] == tail
        text = tok.decode(note)
        assert note and "mouse" in text, text  # the label note reached the session, before the state
        assert set(new[-H * D:]) <= set(codec.action_ids)
        # the same scene again: the note is not repeated (0 tokens): the tick is the state and the reply only
        length = len(s)
        await infer(ws, obs(state, prompt="reach", **{CAMERA: picture}))
        assert len(s) - length == len(tail) + H * D and s.token_ids[length:length + len(tail)] == tail
        # a new episode (a new session): the same picture, sent as PNG bytes, is noted again
        again = await infer(ws, obs(state, prompt="reach", reset=True, **{CAMERA: png(picture)}))
        assert again["episode"] == 1
        [s2] = live_sessions(srv)
        assert s2 is not s and "mouse" in tok.decode(s2.token_ids[len(head):len(s2) - len(tail) - H * D])
        await ws.close()
        await freed(srv)
        assert not srv.server.service.images.notes  # what the episodes' notes held went with their sessions
        # a client gone while its image is being classified: nothing is left behind
        ws, _ = await connect(srv)
        await ws.send(wire.packb(obs(state, **{CAMERA: png(picture)})))
        await ws.close()
        await freed(srv)
        service = srv.server.service
        for _ in range(600):  # bounded: the vision thread finishes the image it had
            if service.vision.worker.pending == 0 and not service.images.notes:
                break
            await asyncio.sleep(0.05)
        assert service.vision.worker.pending == 0 and not service.images.notes and not service.images.noted
    finally:
        await srv.stop()


@pytest.mark.asyncio
async def test_bad_images_are_invalid_observations(tmp_path: Path) -> None:
    vision_model()
    picture = mouse()
    folder = camera_checkpoint(tmp_path / "cam")
    srv = await RunningServer.start(CONFIG, loader(folder), vision=True)
    try:
        bad = [obs(), obs(**{CAMERA: picture[:64, :64].astype(np.float32)}), obs(**{CAMERA: picture[:, :, :2].copy()}),
               obs(**{CAMERA: "a picture"}), obs(**{CAMERA: png(picture)[:200]})]  # the last: a truncated PNG
        for o in bad:
            ws, _ = await connect(srv)
            text = await expect_error(ws, wire.packb(o))
            assert text.startswith("invalid_observation:"), text
        await freed(srv)
    finally:
        await srv.stop()


def test_an_image_over_the_pixel_limit_is_refused_before_it_is_queued() -> None:
    codec = PolicyCodec.from_dict({**POLICY, "image_keys": [CAMERA]})
    huge = np.broadcast_to(np.zeros(3, np.uint8), (4097, 4097, 3))  # 16.8 M pixels, no memory
    assert huge.shape[0] * huge.shape[1] > MAX_PIXELS
    with pytest.raises(PolicyInputError, match="pixels"):
        parse_observation(obs(**{CAMERA: huge}), codec, 20.0)
    assert parse_observation(obs(), PolicyCodec.from_dict(POLICY), 20.0).images == []  # no image keys: none read


@pytest.mark.asyncio
async def test_a_server_without_vision_refuses_an_image_policy_naming_the_pull_command(tmp_path: Path) -> None:
    srv = await RunningServer.start(CONFIG, loader(camera_checkpoint(tmp_path / "cam")), vision=False)
    try:
        ws = await websockets.connect(policy_url(srv), max_size=None)
        text = await expect_error(ws)
        assert text.startswith("unsupported_observation:") and "streamserve models pull efficientnet-lite0" in text
        await freed(srv)
    finally:
        await srv.stop()


@pytest.mark.asyncio
async def test_a_model_with_an_image_encoder_gets_the_images_embeddings(tmp_path: Path) -> None:
    import json

    folder = camera_checkpoint(tmp_path / "enc")
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    patch, size = 8, 16  # (16 / 8) ** 2 = 4 embeddings per image
    save_image_projector(folder, np.random.default_rng(1).normal(0, 0.02, (patch * patch * 3, hidden))
                         .astype(np.float32), patch, size)
    codec = PolicyCodec.load(folder)
    assert codec is not None
    srv = await RunningServer.start(CONFIG, loader(folder), vision=False)  # no classifier: the model's own encoder
    try:
        tok = srv.engine.tokenizer
        ws, meta = await connect(srv)
        assert meta["streamserve"]["images"]["input"] == "encoder"
        image = np.random.default_rng(2).integers(0, 256, (32, 48, 3), dtype=np.uint8)
        state = (0.5, 0.5, 1.0)
        head = codec.prompt_ids(tok.encode("reach", add_special_tokens=False))
        tail = codec.state_ids(np.asarray(state))
        for tick in range(2):  # every image is embedded (no notes to compare): 4 vectors per tick
            length = 0 if tick == 0 else len(live_sessions(srv)[0])
            await infer(ws, obs(state, prompt="reach", **{CAMERA: image}))
            [s] = live_sessions(srv)
            new = s.token_ids[length:]
            start = len(head) if tick == 0 else 0
            assert new[start:start + 4] == [srv.engine.placeholder_id] * 4 and all(
                length + start + i in s.core.vectors for i in range(4))
            assert new[start + 4:start + 4 + len(tail)] == tail and len(new) == start + 4 + len(tail) + H * D
        await ws.close()
        await freed(srv)
    finally:
        await srv.stop()
