"""/v1/policy: bad input is answered in openpi's way (one text frame, then close 1011) and breaks nothing else;
a server whose model is not a policy says so instead of sending metadata."""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_fixture import POLICY, STATE_KEY, connect, expect_error, freed, infer, obs, pack_raw, raw_array
from serving import RunningServer, serve

from streamserve.config import ServerConfig
from streamserve.errors import InvalidInputError
from streamserve.robot.codec import PolicyCodec
from streamserve.server.adapters.policy import wire
from streamserve.server.adapters.policy.observation import parse_observation

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

GOOD = np.array([0.1, 0.2, 0.3], np.float32)


def deep(n: int) -> object:
    v: object = 1
    for _ in range(n):
        v = [v]
    return v


BAD_FRAMES = {  # name -> (frame, a word the error text must hold)
    "malformed msgpack": (b"\xc1\x00\x01", "bad_message"),
    "truncated msgpack": (wire.packb(obs())[:-3], "bad_message"),
    "text frame": ("{\"observation/state\": [0, 0, 0]}", "binary"),
    "not a map": (wire.packb([1, 2, 3]), "invalid_observation"),
    "object dtype": (pack_raw({STATE_KEY: raw_array(b"\0" * 24, "|O8", [3])}), "not accepted"),
    "complex dtype": (pack_raw({STATE_KEY: raw_array(b"\0" * 48, "<c16", [3])}), "not accepted"),
    "void dtype": (pack_raw({STATE_KEY: raw_array(b"\0" * 12, "|V4", [3])}), "not accepted"),
    "unicode dtype": (pack_raw({STATE_KEY: raw_array(b"\0" * 12, "<U1", [3])}), "not accepted"),
    "garbage dtype": (pack_raw({STATE_KEY: raw_array(b"\0" * 12, "zz9", [3])}), "dtype"),
    "shape bomb": (pack_raw({STATE_KEY: raw_array(b"\0" * 4, "<f4", [1 << 40, 1 << 20])}), "needs"),
    "short data": (pack_raw({STATE_KEY: raw_array(b"\0" * 11, "<f4", [3])}), "needs"),
    "negative shape": (pack_raw({STATE_KEY: raw_array(b"", "<f4", [-1])}), "shape"),
    "too many dims": (pack_raw({STATE_KEY: raw_array(b"\0" * 4, "<f4", [1] * 9)}), "shape"),
    "deep nesting": (wire.packb({**obs(), "extra": deep(40)}), "deeper"),
    "missing state key": (wire.packb({"observation/image": np.zeros((2, 2, 3), np.uint8)}), "observation/state"),
    "NaN state": (wire.packb(obs((0.1, float("nan"), 0.2))), "NaN"),
    "inf state": (wire.packb(obs((0.1, float("inf"), 0.2))), "NaN"),
    "wrong state shape": (wire.packb(obs((0.1, 0.2))), "shape"),
    "bool state": (wire.packb({STATE_KEY: np.array([True, False, True])}), "numbers"),
    "prompt not text": (wire.packb(obs(prompt=3)), "prompt"),
    "NaN deadline": (wire.packb(obs(deadline_ms=float("nan"))), "deadline_ms"),
    "both deadlines": (wire.packb(obs(deadline_ms=5.0, deadline=1e9)), "not both"),
    "negative step": (wire.packb(obs(step=-1)), "step"),
    "reset not bool": (wire.packb(obs(reset="yes")), "reset"),
    "action_prefix of the whole chunk": (wire.packb(obs(action_prefix=np.zeros((4, 2), np.float32))), "action_prefix"),
    "action_prefix of wrong width": (wire.packb(obs(action_prefix=np.zeros((1, 3), np.float32))), "action_prefix"),
    "NaN action_prefix": (wire.packb(obs(action_prefix=np.array([[0.0, np.nan]], np.float32))), "action_prefix"),
    "frame over the limit": (wire.packb({**obs(), "pad": b"\0" * (1 << 16)}), "over the limit"),
    "prompt too long": (wire.packb(obs(prompt="y" * 5000)), "prompt"),
    # refused by the session service in the worker (a chunk over --max-chunk-tokens), not by the read loop
    "prompt over a chunk": (wire.packb(obs(prompt="y" * 3000)), "chunk_too_large"),
}


@MODULE_LOOP
@pytest.mark.parametrize("name", list(BAD_FRAMES))
async def test_bad_observation_is_a_text_frame_then_1011(policy_server: RunningServer, name: str) -> None:
    frame, word = BAD_FRAMES[name]
    ws, _ = await connect(policy_server)
    assert (await infer(ws, obs()))["actions"].shape == (4, 2)  # an episode's session is open when it fails
    text = await expect_error(ws, frame)
    assert word in text and "Traceback" not in text
    await freed(policy_server)  # its session is freed; the server goes on serving
    ws, _ = await connect(policy_server)
    assert (await infer(ws, obs()))["actions"].shape == (4, 2)
    await ws.close()
    await freed(policy_server)


def test_decoder_round_trips_every_accepted_dtype_and_shape() -> None:
    arrays = [np.arange(6, dtype=dt).reshape(2, 3) for dt in ("<i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4",
                                                             "<u8", "<f2", "<f4", "<f8", ">f4", ">i8")]
    arrays += [np.arange(6, dtype="<f4").reshape(2, 3).T,  # not C-contiguous: sent in C order
               np.array([True, False]), np.zeros((0, 5), np.float32), np.full((), 1.5, np.float32),
               np.ones((1, 2, 1, 3, 1), np.int16)]
    frame = wire.packb({"a": arrays, "g": [np.float64(2.5), np.int8(-3), np.bool_(True)]})
    back = wire.unpackb(frame, 1 << 20)
    for a, b in zip(arrays, back["a"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all()
    # np.float64 is a Python float: msgpack packs it as one (as openpi's packer does)
    assert [type(x) for x in back["g"]] == [float, np.int8, np.bool_] and back["g"][1] == -3
    # openpi's own packing (bytes keys) and str keys both decode
    assert wire.unpackb(msgpack.packb({"__ndarray__": True, "data": b"\1\0", "dtype": "<i2", "shape": [1]}),
                        64).tolist() == [1]
    with pytest.raises(wire.WireError):
        wire.packb(np.array(["x"], dtype=object))


@MODULE_LOOP
async def test_a_model_without_a_policy_codec_refuses_naming_default_policy() -> None:
    async with serve(ServerConfig()) as srv:  # the default (chat) model: no policy.json
        import websockets

        ws = await websockets.connect(f"{srv.url}/v1/policy")
        text = await expect_error(ws)
        assert "no_policy" in text and "--model default-policy" in text
        assert not srv.server.service.registry.all()


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
                       | st.binary(max_size=16),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12) | st.binary(
                           max_size=12), inner, max_size=4), max_leaves=20)
ARRAYISH = st.fixed_dictionaries({b"__ndarray__": st.sampled_from([True, 1, False]), b"data": st.binary(max_size=32),
                                  b"dtype": st.sampled_from(["<f4", "|u1", "<i8", "|O", "<c8", "|b1", "<M8", "x"]),
                                  b"shape": st.lists(st.integers(-2, 1 << 40), max_size=10)})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64) | st.builds(lambda v: msgpack.packb(v, use_bin_type=True),
                                          st.dictionaries(st.sampled_from([STATE_KEY, "prompt", "reset", "step",
                                                                           "deadline_ms", "deadline", "timestamp"]),
                                                          JSONISH | ARRAYISH, max_size=5)))
def test_any_frame_decodes_or_is_refused_with_a_typed_error(frame: bytes) -> None:
    codec = PolicyCodec.from_dict(POLICY)
    # WireError, PolicyInputError: the text frame + 1011; nothing else may escape
    with contextlib.suppress(InvalidInputError):
        parse_observation(wire.unpackb(frame, 1 << 16), codec, 20.0)
