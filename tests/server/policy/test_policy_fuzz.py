"""Policy endpoint fuzz (issue 17): openpi's msgpack-NumPy frames, structured and byte-level, sent to a real server
on /v1/policy and on its policy port. Valid observations with fields swapped for random values; dtype bombs (object,
structured, big-endian, complex, bool, strings, datetimes), shape bombs (2**40 elements over a few bytes, negative,
zero and huge dims, non-integers), size bombs (declared bytes vs actual, very long strings and keys), nesting depth
bombs (msgpack nested thousands deep, built by hand), random bytes, truncated msgpack, text frames.

Every frame is answered with a reply (binary) or the endpoint's typed error (one text frame that is not
internal_error, then close 1011), or aiohttp's 1009 for a frame over twice --max-frame-bytes; every await is
bounded. After each example a bystander connection, opened before the fuzz, answers a reset + the same
observation with exactly the actions it answered first; at the end its episode goes on exactly as a reference
episode did, and every fuzzed connection's session is gone.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest
import websockets
from fuzz_options import fuzz
from hypothesis import strategies as st
from policy_fixture import STATE_KEY, connect, freed, infer, obs, pack_raw, sessions
from serving import RunningServer

from streamserve.server.adapters.policy import wire

WAIT = 60.0  # seconds any one reply or close may take (a tiny model on 2 shared cores)
LIMIT = 1 << 16  # POLICY_CONFIG.max_frame_bytes

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=10)
DTYPES = ["<f4", ">f4", ">f8", "<f2", "|b1", "|u1", "<i8", ">u8", "|O", "|O8", "<c8", "<c16", ">c8", "<f16",
          "|V4", "|V12", "<U1", "|S3", "<M8[s]", "<m8", "[('a','<f4')]", "(3,)f4", "f4,f4", "float128", "object",
          "", "zz9", "<f4 ", "\x00", "ñ"]
DIMS = st.one_of(st.integers(-3, 5), st.sampled_from([1 << 31, 1 << 40, 1 << 62, (1 << 63) - 1, 1 << 63,
                                                      (1 << 64) - 1, -(1 << 63)]))
SHAPES = st.one_of(st.lists(DIMS, max_size=10),
                   st.lists(st.one_of(DIMS, st.floats(), st.booleans(), st.none(), st.text(max_size=3),
                                      st.lists(st.integers(0, 3), max_size=2)), max_size=4),
                   values)


@st.composite
def arrays(draw: st.DrawFn) -> dict[bytes | str, Any]:
    """An encoded array whose dtype, shape and data are each sometimes wrong, sometimes a bomb."""
    dtype = draw(st.sampled_from(DTYPES) if draw(st.integers(0, 3)) else
                 st.one_of(st.text(max_size=12), st.binary(max_size=9), values))
    shape = draw(st.lists(DIMS, max_size=10) if draw(st.integers(0, 3)) else SHAPES)
    try:
        declared = int(np.prod(shape)) * np.dtype(dtype).itemsize  # the length that would be consistent
    except Exception:  # whatever NumPy makes of a junk dtype or shape: no consistent length
        declared = 0
    length = draw(st.sampled_from([declared] * 4 + [declared + 1, max(0, declared - 1), 0, 3]))
    if length > 4096:  # a shape bomb: a few bytes claiming many elements
        length = draw(st.sampled_from([0, 3, 4, 8, 4096]))
    data = b"\0" * min(max(length, 0), 2 * LIMIT) if draw(st.integers(0, 3)) else \
        draw(st.one_of(st.binary(max_size=64), values))
    flag = True if draw(st.integers(0, 4)) else draw(st.sampled_from([1, False, None, "yes"]))
    enc = draw(st.sampled_from([str.encode, str]))  # openpi's bytes keys, or str keys
    m = {enc("__ndarray__"): flag, enc("data"): data, enc("dtype"): dtype, enc("shape"): shape}
    if not draw(st.integers(0, 7)):
        m.pop(enc(draw(st.sampled_from(["data", "dtype", "shape"]))))
    return m


@st.composite
def generics(draw: st.DrawFn) -> dict[bytes, Any]:
    return {b"__npgeneric__": True if draw(st.integers(0, 3)) else draw(st.sampled_from([1, None])),
            b"data": draw(st.one_of(scalars, st.sampled_from([2**63 - 1, 2**64 - 1, -(2**63), 256, -129, 2**31]))),
            b"dtype": draw(st.one_of(st.sampled_from(DTYPES), st.text(max_size=6)))}


def valid() -> st.SearchStrategy[dict[str, Any]]:
    state = st.lists(st.floats(-1.0, 1.0, width=32), min_size=3, max_size=3)
    return st.builds(lambda s, extra: {STATE_KEY: np.asarray(s, np.float32), **extra}, state,
                     st.fixed_dictionaries({}, optional={
                         "prompt": st.sampled_from(["reach", "wave", ""]), "reset": st.booleans(),
                         "deadline_ms": st.floats(0.0, 500.0), "step": st.integers(0, 1000),
                         "timestamp": st.floats(0.0, 1e6), "observation/image": st.just(np.zeros((2, 2, 3), np.uint8)),
                         "other": values}))


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid observation with 1-3 fields swapped for random values, arrays, scalars or bombs."""
    m: dict[Any, Any] = draw(valid())
    keys = [*m, STATE_KEY, "prompt", "reset", "deadline_ms", "deadline", "step", "timestamp", b"observation/state"]
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(keys))
        if draw(st.integers(0, 4)) == 0:
            m.pop(key, None)
        else:
            m[key] = draw(st.one_of(values, arrays(), generics(),
                                    st.text(min_size=4000, max_size=5000),  # a prompt over MAX_PROMPT_CHARS
                                    st.just("x" * (3 * LIMIT)), st.just(b"\0" * (LIMIT - 50))))  # frame-size bombs
    return packed(m, wire.packb)


def packed(m: dict[Any, Any], pack: Any = pack_raw) -> bytes:
    try:
        return pack(m)
    except (TypeError, ValueError, OverflowError):  # msgpack cannot pack it (an int past 64 bits): its text then
        return pack_raw({STATE_KEY: repr(m)[:200]})


def deep(n: int, kind: int) -> bytes:
    """An observation nested `n` deep in lists or maps, written directly (msgpack's packer stops at 512)."""
    inner = (b"\x91" if kind == 0 else b"\x81\xa1k") * n + b"\x01"
    return b"\x82" + msgpack.packb(STATE_KEY) + wire.packb(np.zeros(3, np.float32)) + msgpack.packb("x") + inner


def long_key(n: int) -> bytes:
    return pack_raw({STATE_KEY: np.zeros(3, np.float32).tobytes(), "k" * n: 1})


frames = st.one_of(
    mutated(),
    st.builds(packed, st.dictionaries(st.sampled_from([STATE_KEY, "prompt", "reset", "step"]),
                                        st.one_of(arrays(), generics()), min_size=1, max_size=2)),  # dtype/shape
    st.builds(deep, st.sampled_from([7, 8, 9, 50, 511, 1500, 100_000]), st.integers(0, 1)),  # depth bombs
    st.builds(long_key, st.sampled_from([1000, LIMIT - 100, LIMIT + 10])),  # size bombs in keys
    st.binary(max_size=300),  # random bytes
    st.builds(lambda v, cut: (b := wire.packb(v))[:max(0, len(b) - cut)], valid(), st.integers(1, 40)),  # truncated
    st.builds(lambda v: msgpack.packb(v, use_bin_type=True), values),  # msgpack that is not an observation
    st.builds(wire.packb, valid()),
    st.builds(lambda b: b"\xdd" + b + b"\x01", st.binary(min_size=4, max_size=4)),  # an array claiming 2**32 items
    st.text(max_size=100),  # a text frame
)


async def exchange(srv: RunningServer, port: bool, warm: bool, batch: list[bytes | str]) -> None:
    """One fuzzed connection: (optionally a valid observation first, so that an episode's session is open when
    it fails) then each frame, each answered before the next is sent."""
    ws, _ = await asyncio.wait_for(connect(srv, port), WAIT)
    try:
        if warm:
            assert (await asyncio.wait_for(infer(ws, obs()), WAIT))["actions"].shape == (4, 2)
        for frame in batch:
            await ws.send(frame)
            got = await asyncio.wait_for(ws.recv(), WAIT)
            if isinstance(got, bytes):  # the frame was a valid observation (or a bare reset)
                reply = wire.unpackb(got, 1 << 20)
                assert "actions" in reply or reply.get("reset") is True, reply
                continue
            assert not got.startswith("internal_error") and "Traceback" not in got, (frame[:200], got)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), WAIT)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011, closed.value
            return
    except websockets.ConnectionClosed as e:  # only aiohttp's own close of a frame over 2x the limit
        assert e.rcvd is not None and e.rcvd.code == 1009, e
    finally:
        await asyncio.wait_for(ws.close(), WAIT)


@pytest.mark.asyncio(loop_scope="module")
async def test_the_policy_endpoint_survives_hostile_frames(policy_server: RunningServer,
                                                           request: pytest.FixtureRequest) -> None:
    first, second = obs((0.1, -0.2, 0.5)), obs((-0.6, 0.4, 1.5))
    reference, _ = await connect(policy_server)  # what an undisturbed episode answers
    expected = [(await infer(reference, o))["actions"] for o in (first, second)]
    await reference.close()
    await freed(policy_server)
    bystander, _ = await connect(policy_server, port=True)
    assert np.array_equal((await infer(bystander, first))["actions"], expected[0])
    loop = asyncio.get_running_loop()

    async def example(case: tuple[bool, bool, list[bytes | str]]) -> None:
        await exchange(policy_server, *case)
        again = await asyncio.wait_for(infer(bystander, {**first, "reset": True}), WAIT)  # a new episode: as before
        assert np.array_equal(again["actions"], expected[0]) and again["stale"] is False, again

    cases = st.tuples(st.booleans(), st.booleans(), st.lists(frames, min_size=1, max_size=3))
    await asyncio.to_thread(fuzz, request.config, "policy", cases,  # hypothesis runs in a worker thread
                            lambda c: asyncio.run_coroutine_threadsafe(example(c), loop).result(300), 200,
                            pinned=[(False, True, [EMPTY_BOMB])])
    assert np.array_equal((await infer(bystander, second))["actions"], expected[1])  # its episode went on intact
    for _ in range(600):  # bounded: the last fuzzed connection's teardown may still be freeing its session
        if len(sessions(policy_server)) == 1:
            break
        await asyncio.sleep(0.05)
    assert len(sessions(policy_server)) == 1  # the bystander's: every fuzzed connection's session is gone
    await bystander.close()
    await freed(policy_server)
    policy_server.engine.check_integrity()


def empty_bomb(shape: list[int]) -> bytes:
    return pack_raw({STATE_KEY: {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": shape}})


# found while writing this fuzz (probing the decoder): the byte count (0) matched, then NumPy's reshape raised
# ValueError, which the connection answered with internal_error
EMPTY_BOMB = empty_bomb([0, 1 << 62])


@pytest.mark.parametrize("shape", [[0, 1 << 62], [0, (1 << 64) - 1], [1 << 31, 0, 1 << 31, 1 << 31]])
def test_an_empty_array_with_dimensions_numpy_cannot_hold_is_a_wire_error(shape: list[int]) -> None:
    with pytest.raises(wire.WireError, match="cannot hold"):
        wire.unpackb(empty_bomb(shape), LIMIT)
