"""media/vision.py and the image encoder of media/encoder.py: the EfficientNet-Lite0 network against its checkpoint
and against a functional forward written apart from it, preprocessing, labels of real pictures, decode_image's
limits and typed errors, SceneNotes, and the patch projector.

Tests that need the pulled classifier skip naming `streamserve models pull efficientnet-lite0`; those that decode
JPEG/PNG skip naming the vision extra without Pillow. The real pictures are the desktop's Adwaita device icons
(rendered objects, /usr/share/icons), used where they are installed.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from streamserve.media import vision as V
from streamserve.media.encoder import (
    IMAGE_PROJECTOR_FILE,
    ImageEncoderError,
    PatchProjector,
    load_image_encoder,
    save_image_projector,
    square_resize,
)

ICONS = Path("/usr/share/icons/Adwaita/512x512/devices")


def lite0_path() -> Path:
    from streamserve.models.store import installed

    path = installed(V.VISION_MODEL)
    if path is None:
        pytest.skip(f"the vision model is not in the model cache: run `streamserve models pull {V.VISION_MODEL}`")
    return path


@functools.lru_cache(maxsize=1)
def _classifier(path: str) -> V.Classifier:
    return V.load_classifier(path)


def classifier() -> V.Classifier:
    return _classifier(str(lite0_path()))


def pil() -> ModuleType:  # PIL.Image
    return pytest.importorskip("PIL.Image", reason=f"Pillow is not installed: {V.VISION_EXTRA}")


def picture(name: str, size: int | None = None) -> np.ndarray:
    """An Adwaita device icon on white, uint8 RGB [H, W, 3] (scaled to `size` px square when given)."""
    Image = pil()
    path = ICONS / f"{name}.png"
    if not path.is_file():
        pytest.skip(f"{path} is not installed (the Adwaita icon theme)")
    icon = Image.open(path).convert("RGBA")
    canvas = Image.new("RGBA", icon.size, (255, 255, 255, 255))
    canvas.alpha_composite(icon)
    rgb = canvas.convert("RGB")
    return np.array(rgb.resize((size, size), Image.BICUBIC) if size else rgb)


def encoded(rgb: np.ndarray, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    pil().fromarray(rgb).save(buf, fmt, **kw)
    return buf.getvalue()


# ---- the network -----------------------------------------------------------------------------------------------
def reference_forward(sd: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """EfficientNet-Lite0 written apart from media/vision.py: straight from the state dict's tensors, the block
    layout read from their shapes, TensorFlow "SAME" padding for the even sizes a 224 input meets (stride 1:
    (k - 1) / 2 each side; stride 2: (k - 2) / 2 before, k / 2 after)."""
    def bn(t: torch.Tensor, p: str) -> torch.Tensor:
        return F.batch_norm(t, sd[p + ".running_mean"], sd[p + ".running_var"], sd[p + ".weight"], sd[p + ".bias"],
                            False, 0.0, 1e-3)

    def conv(t: torch.Tensor, w: torch.Tensor, stride: int, groups: int = 1) -> torch.Tensor:
        k = w.shape[-1]
        before, after = ((k - 1) // 2, (k - 1) // 2) if stride == 1 else ((k - 2) // 2, k // 2)
        return F.conv2d(F.pad(t, (before, after, before, after)), w, stride=stride, groups=groups)

    strides = {0: 1, 1: 2, 3: 2, 5: 2, 11: 2}  # the first block of each stage that halves the size
    x = F.relu6(bn(conv(x, sd["_conv_stem.weight"], 2), "_bn0"))
    for i in range(16):
        p, y = f"_blocks.{i}.", x
        if p + "_expand_conv.weight" in sd:
            y = F.relu6(bn(conv(y, sd[p + "_expand_conv.weight"], 1), p + "_bn0"))
        dw = sd[p + "_depthwise_conv.weight"]
        y = F.relu6(bn(conv(y, dw, strides.get(i, 1), groups=dw.shape[0]), p + "_bn1"))
        y = bn(conv(y, sd[p + "_project_conv.weight"], 1), p + "_bn2")
        x = x + y if y.shape == x.shape else y
    x = F.relu6(bn(conv(x, sd["_conv_head.weight"], 1), "_bn1"))
    return F.linear(x.mean((2, 3)), sd["_fc.weight"], sd["_fc.bias"])


def test_the_network_has_the_checkpoints_tensors_and_loads_it_strictly() -> None:
    state = torch.load(lite0_path(), map_location="cpu", weights_only=True)
    mine = V.build_model().state_dict()
    assert {k: tuple(v.shape) for k, v in mine.items()} == {k: tuple(v.shape) for k, v in state.items()}
    assert len(state) == 296 and sum(v.numel() for k, v in state.items() if "num_batches" not in k) > 4_600_000
    assert classifier().names == V.imagenet_labels() and len(set(V.imagenet_labels())) == 1000


@pytest.mark.parametrize("real", [False, True])
def test_the_network_matches_a_forward_written_apart(real: bool) -> None:
    """Random weights (statistics too) and the real checkpoint alike: the same logits (symmetric padding instead
    of TensorFlow's moves them by ~15% of their range)."""
    model = V.build_model().eval()
    if real:
        model.load_state_dict(torch.load(lite0_path(), map_location="cpu", weights_only=True))
    else:  # He-scaled weights, batch norms near identity: the signal reaches the logits (padding shows in them)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, t in model.state_dict().items():
                r = torch.randn(t.shape, generator=g)
                if t.ndim > 1:
                    t.copy_(r * (2.0 / t[0].numel()) ** 0.5)
                elif name.endswith("running_var"):
                    t.copy_(torch.rand(t.shape, generator=g) * 0.5 + 0.75)
                elif t.is_floating_point():
                    t.copy_(1 + 0.1 * r if name.endswith(".weight") else 0.1 * r)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(x), reference_forward(model.state_dict(), x)
    assert got.shape == (2, 1000)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_a_damaged_checkpoint_is_a_model_load_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(V.ModelLoadError, match="pull it again"):
        V.load_classifier(junk)
    other = tmp_path / "other.pth"
    torch.save({"_fc.weight": torch.zeros(10, 1280)}, other)
    with pytest.raises(V.ModelLoadError, match="not an EfficientNet-Lite0"):
        V.load_classifier(other)


# ---- preprocessing ------------------------------------------------------------------------------------------------
def test_preprocessing_scales_crops_and_normalises() -> None:
    assert V.preprocess(np.full((300, 500, 3), 127, np.uint8)).abs().max() < 1e-5  # (x - 127) / 128
    assert torch.allclose(V.preprocess(np.full((224, 224, 3), 255, np.uint8)), torch.ones(1, 3, 224, 224))
    wide = np.zeros((224, 448, 3), np.uint8)  # -> 256 x 512, centre 224 kept: columns 144..368 of 512
    wide[:, :100] = 255  # the left 200 of 512 columns: cut off
    wide[:, 112:336, 1] = 255  # the middle half, green
    x = V.preprocess(wide)
    assert x.shape == (1, 3, 224, 224) and x.dtype == torch.float32
    assert float(x[0, 0].max()) < -0.9  # no red left
    assert float(x[0, 1, :, 40:184].min()) > 0.9  # green in the middle
    with pytest.raises(V.ImageError):
        V.preprocess(np.zeros((8, 8), np.uint8))


def test_labels_of_real_pictures_and_the_normalisation_the_checkpoint_was_trained_with() -> None:
    clf = classifier()
    mouse = picture("input-mouse")
    assert clf.labels(mouse)[0][0] == "mouse" and clf.labels(mouse)[0][1] > 0.5
    assert clf.labels(picture("input-gaming"))[0][0] == "joystick"
    assert clf.labels(picture("video-display"))[0][0] in ("desktop computer", "screen", "monitor", "television")
    assert "keyboard" in " ".join(name for name, _ in clf.labels(picture("input-keyboard"), top=2))
    # ImageNet's mean/std scaling (what torchvision models use) is not this checkpoint's: the mouse is lost
    x = V.preprocess(mouse) * V.STD + V.MEAN
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255, torch.tensor([0.229, 0.224, 0.225]) * 255
    with torch.no_grad():
        p = torch.softmax(clf.model((x - mean) / std.view(1, 3, 1, 1)), -1)[0]
    assert float(p[clf.names.index("mouse")]) < 0.5 * clf.labels(mouse)[0][1]


def test_labels_are_stable_under_resizing_and_jpeg() -> None:
    clf = classifier()
    for size in (300, 400, 512, 700):
        assert clf.labels(picture("input-mouse", size))[0][0] == "mouse", size
    jpeg = V.decode_image(encoded(picture("input-mouse"), "JPEG", quality=80))
    assert clf.labels(jpeg)[0][0] == "mouse"


# ---- decode_image ---------------------------------------------------------------------------------------------------
def png_with_size(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its pixel data is a few bytes of zeros): a bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_decode_image_takes_png_jpeg_and_arrays() -> None:
    rgb = np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    assert np.array_equal(V.decode_image(encoded(rgb)), rgb)
    smooth = np.dstack([*np.meshgrid(np.arange(30) * 8, np.arange(20) * 12), np.full((20, 30), 90)]).astype(np.uint8)
    assert np.abs(V.decode_image(encoded(smooth, "JPEG", quality=95)).astype(int) - smooth).mean() < 4
    assert np.array_equal(V.decode_image(encoded(np.dstack([rgb, np.zeros((20, 30), np.uint8)]))), rgb)  # RGBA
    grey = rgb[:, :, 0]
    assert np.array_equal(V.decode_image(encoded(grey)), np.dstack([grey] * 3))
    palette = pil().fromarray(rgb).convert("P")
    buf = io.BytesIO()
    palette.save(buf, "PNG")
    assert V.decode_image(buf.getvalue()).shape == (20, 30, 3)
    deep = pil().fromarray(grey.astype(np.uint16) * 257)  # mode I;16
    buf = io.BytesIO()
    deep.save(buf, "PNG")
    assert np.array_equal(V.decode_image(buf.getvalue())[:, :, 0], grey)  # 16 bits -> its top 8
    ro = rgb.copy()
    ro.flags.writeable = False  # as the protocol's arrays are (views of the frame)
    assert np.array_equal(V.decode_image(ro), rgb) and not np.shares_memory(V.decode_image(ro), ro)
    assert V.decode_image(ro).flags.writeable
    assert np.array_equal(V.decode_image(grey), np.dstack([grey] * 3))
    assert np.array_equal(V.decode_image(np.dstack([rgb, rgb[:, :, :1]])), rgb)
    assert np.array_equal(V.decode_image(rgb.astype(np.float32) / 255), rgb)


@pytest.mark.parametrize("data, match", [
    (b"", "empty"),
    (b"GIF89a" + b"\0" * 64, "not a JPEG or PNG"),
    (b"\xff\xd8\xff\xe0" + b"\x13" * 200, "damaged|not a JPEG"),
    (np.zeros((4, 4, 2), np.uint8), "shape"),
    (np.zeros((4,), np.uint8), "shape"),
    (np.zeros((0, 4, 3), np.uint8), "empty"),
    (np.zeros((4, 4, 3), np.int16), "uint8"),
    (np.zeros((4, 4, 3), bool), "uint8"),
    (np.full((4, 4, 3), np.nan, np.float32), "finite"),
    (np.full((4, 4, 3), 2.0, np.float32), r"\[0, 1\]"),
    (np.zeros((1, 20000, 3), np.uint8), "over the limit"),
    ("not bytes", "JPEG/PNG bytes or a numpy array"),
])
def test_decode_image_refuses_bad_input_with_a_typed_error(data: object, match: str) -> None:
    if isinstance(data, bytes) and data:
        pil()
    with pytest.raises(V.ImageError, match=match) as info:
        V.decode_image(data)  # type: ignore[arg-type]
    assert info.value.code == "invalid_image"


def test_truncated_files_and_bombs_are_refused_before_they_are_expanded() -> None:
    png = encoded(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    with pytest.raises(V.ImageError, match="damaged or truncated"):
        V.decode_image(png[:len(png) // 2])
    with pytest.raises(V.ImageError, match="over the limit"):
        V.decode_image(png_with_size(100_000, 100_000))  # 10 G pixels claimed in 100 bytes
    with pytest.raises(V.ImageError, match="over the limit"):
        V.decode_image(png_with_size(5000, 5000))  # 25 M pixels: over MAX_PIXELS
    with pytest.raises(V.ImageError, match="over the limit"):
        V.decode_image(encoded(np.zeros((40, 40, 3), np.uint8)), max_pixels=1000)
    with pytest.raises(V.ImageError, match="over the limit"):
        V.decode_image(b"\x89PNG" + b"\0" * (V.MAX_IMAGE_BYTES + 1))


# ---- SceneNotes ---------------------------------------------------------------------------------------------------
def test_scene_notes_speak_only_when_the_label_set_changes() -> None:
    notes = V.SceneNotes()
    assert notes.update([("tabby", 0.1)]) is None  # nothing sure and nothing said before: no note
    assert notes.update([("coffee mug", 0.6), ("desk", 0.3), ("cup", 0.1)]) == "The camera shows: coffee mug, desk."
    assert notes.update([("desk", 0.5), ("coffee mug", 0.4), ("cup", 0.05)]) is None  # the same set
    assert notes.update([("desk", 0.9)]) == "The camera shows: desk."
    assert notes.update([("desk", 0.05)]) == "The camera shows nothing it recognises."
    assert notes.update([]) is None
    many = [(f"thing {i}", 0.9 - i * 0.1) for i in range(6)]
    assert notes.update(many) == "The camera shows: thing 0, thing 1, thing 2."  # top 3
    notes.reset()
    assert notes.update(many) == "The camera shows: thing 0, thing 1, thing 2."  # said again after a rewind
    assert V.SceneNotes(min_confidence=0.5, top=1).update(many) == "The camera shows: thing 0."
    for bad in ({"min_confidence": 1.5}, {"top": 0}, {"top": True}):
        with pytest.raises(V.InvalidInputError):
            V.SceneNotes(**bad)  # type: ignore[arg-type]


# ---- the image encoder (a model that sees images natively) -------------------------------------------------------
def test_square_resize_is_the_centre_square_box_averaged() -> None:
    rgb = np.random.default_rng(2).integers(0, 256, (40, 32, 3), dtype=np.uint8)
    assert np.array_equal(square_resize(rgb, 32), rgb[4:36].astype(np.float32))  # same size: the crop itself
    half = square_resize(rgb, 16)
    assert np.allclose(half, rgb[4:36].astype(np.float64).reshape(16, 2, 16, 2, 3).mean((1, 3)), atol=1e-4)
    assert square_resize(rgb[:3, :3], 8).shape == (8, 8, 3)  # enlarged: nearest pixels


def test_patch_projector_embeds_patches_in_reading_order(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    hidden, patch, size = 24, 8, 16
    projection = (rng.standard_normal((patch * patch * 3, hidden)) * 0.1).astype(np.float32)
    save_image_projector(tmp_path, projection, patch, size)
    enc = load_image_encoder(tmp_path, hidden)
    assert isinstance(enc, PatchProjector) and enc.tokens == 4
    rgb = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    out = enc.encode(rgb)
    x = rgb.astype(np.float32) / 127.5 - 1.0
    want = np.stack([x[r:r + 8, c:c + 8].reshape(-1) @ projection for r in (0, 8) for c in (0, 8)])
    assert out.shape == (4, hidden) and out.dtype == np.float32 and np.allclose(out, want, atol=1e-4)
    assert enc.encode(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).shape == (4, hidden)
    with pytest.raises(ImageEncoderError):
        enc.encode(rgb[:, :, 0])
    with pytest.raises(ImageEncoderError, match="another model"):
        load_image_encoder(tmp_path, hidden + 1)
    (tmp_path / "text-only").mkdir()
    assert load_image_encoder(tmp_path / "text-only", hidden) is None
    (tmp_path / IMAGE_PROJECTOR_FILE).write_bytes(b"damaged")
    with pytest.raises(ImageEncoderError, match="cannot read"):
        load_image_encoder(tmp_path, hidden)
    with pytest.raises(ImageEncoderError):
        PatchProjector(projection, patch, 12)  # size not a multiple of the patch
