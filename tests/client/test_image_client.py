"""The SDK's image appends against the fake server: JPEG/PNG bytes go out as msgpack bin, arrays in openpi's form
(uint8 as it is, float as float32), Pillow images as arrays; what the server would refuse is refused before sending
(nothing reaches the server, the session's seqs are not used up). The real server: tests/server/test_native_image.py."""

from __future__ import annotations

import io

import numpy as np
import pytest
from fake_server import FakeServer

import streamserve_client as sc

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16  # the SDK checks the signature; the server decodes
JPEG = b"\xff\xd8\xff\xe0" + b"\0" * 16


@pytest.mark.asyncio
async def test_images_go_out_as_bytes_or_ndarrays(fake_server: FakeServer) -> None:
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    async with sc.connect(fake_server.url) as client:
        session = await client.open_session()
        await session.append(image=PNG)
        await session.append(image=bytearray(JPEG), kind="image")
        await session.append(image=rgb[:, ::-1])  # not contiguous: sent as a contiguous copy
        await session.append(image=np.full((2, 2), 0.5))  # float64 grey -> float32
    appends = [m for m in fake_server.received if m["type"] == "append"]
    assert [m["seq"] for m in appends] == [0, 1, 2, 3]
    assert appends[0]["image"] == PNG and appends[1]["image"] == JPEG and appends[1]["kind"] == "image"
    arr = appends[2]["image"]
    assert arr["__ndarray__"] is True and arr["dtype"] == "|u1" and arr["shape"] == [2, 3, 3]
    assert np.array_equal(np.frombuffer(arr["data"], np.uint8).reshape(2, 3, 3), rgb[:, ::-1])
    grey = appends[3]["image"]
    assert grey["dtype"] == "<f4" and grey["shape"] == [2, 2]
    assert np.frombuffer(grey["data"], "<f4").tolist() == [0.5] * 4
    assert "kind" not in appends[0]  # the server's default for images (video: sheddable)


@pytest.mark.asyncio
async def test_a_pillow_image_is_sent_as_its_array(fake_server: FakeServer) -> None:
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    picture = Image.new("RGB", (4, 2), (10, 20, 30))
    async with sc.connect(fake_server.url) as client:
        session = await client.open_session()
        await session.append(image=picture)
        buf = io.BytesIO()
        picture.save(buf, "PNG")
        await session.append(image=buf.getvalue())
    first, second = [m for m in fake_server.received if m["type"] == "append"]
    assert first["image"]["shape"] == [2, 4, 3] and set(first["image"]["data"]) == {10, 20, 30}
    assert second["image"] == buf.getvalue()


@pytest.mark.asyncio
@pytest.mark.parametrize("image, match", [
    (b"GIF89a....", "JPEG or PNG"),
    (b"", "JPEG or PNG"),
    (np.zeros((2, 2, 2), np.uint8), "shape"),
    (np.zeros((2,), np.uint8), "shape"),
    (np.zeros((0, 2, 3), np.uint8), "shape"),
    (np.zeros((2, 2, 3), np.int16), "uint8"),
    (np.full((2, 2, 3), np.nan, np.float32), "finite"),
    (np.full((2, 2, 3), 1.5, np.float32), r"\[0, 1\]"),
    (np.zeros((100, 100, 3), np.uint8), "over the server's limit of 1000"),
])
async def test_bad_images_are_refused_before_sending(fake_server: FakeServer, image: object, match: str) -> None:
    fake_server.hello = {**fake_server.hello, "modalities": ["text", "image"],
                         "image": {"input": "labels", "model": "efficientnet-lite0", "max_pixels": 1000}}
    async with sc.connect(fake_server.url) as client:
        session = await client.open_session()
        with pytest.raises(sc.InvalidInputError, match=match):
            await session.append(image=image)  # type: ignore[arg-type]
        assert (await session.append(text="still fine")).seq == 0  # the refused image took no seq
    assert [m["type"] for m in fake_server.received if m["type"] != "close"] == ["open", "append"]
