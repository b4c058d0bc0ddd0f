"""The gate that holds a speculated reply's output (server/media/voice/speculate.py): held output leaves in order at the
release (output sent meanwhile queues behind it), nothing leaves after a discard, a full gate makes the sender
wait (bounded, never dropped), and what runs `then` runs only at a release."""

from __future__ import annotations

import asyncio

import pytest

from streamserve.server.media.voice.speculate import Gate, Speculations


@pytest.mark.asyncio
async def test_release_sends_in_order_then_passes_through() -> None:
    gate, out, after = Gate(), [], []

    async def send(x: str) -> None:
        out.append(x)
        if x == "b":  # sent during the release: queues behind what is held
            await gated("c")

    gated = gate.wrap(send)
    await gated("a")
    await gated("b")
    gate.then(lambda: after.append("released"))
    assert out == [] and gate.holding and not gate.settled.is_set()
    await gate.release()
    assert out == ["a", "b", "c"] and after == ["released"] and gate.settled.is_set()
    await gated("d")
    gate.then(lambda: after.append("now"))
    assert out == ["a", "b", "c", "d"] and after == ["released", "now"]


@pytest.mark.asyncio
async def test_discard_drops_everything_after_too() -> None:
    gate, out, after = Gate(), [], []

    async def send(x: bytes) -> None:
        out.append(x)

    await gate.send(send, b"audio")
    gate.then(lambda: after.append(1))
    gate.discard()
    await gate.send(send, b"later")
    gate.then(lambda: after.append(2))
    await gate.release()  # a release after a discard sends nothing
    assert out == [] and after == [] and gate.bytes == 0 and gate.held == [] and gate.settled.is_set()


@pytest.mark.asyncio
async def test_a_full_gate_makes_the_sender_wait_until_it_opens_or_drops() -> None:
    for end in ("release", "discard"):
        gate, out = Gate(limit=10), []

        async def send(x: bytes, out: list[bytes] = out) -> None:
            out.append(x)

        await gate.send(send, b"0123456789")  # the limit: the next send waits
        blocked = asyncio.ensure_future(gate.send(send, b"more"))
        await asyncio.sleep(0.05)
        assert not blocked.done() and gate.bytes == 10  # bounded: nothing more is held
        await (gate.release() if end == "release" else asyncio.sleep(0, gate.discard()))
        await asyncio.wait_for(blocked, 5)
        assert out == ([b"0123456789", b"more"] if end == "release" else [])


@pytest.mark.asyncio
async def test_hold_nowait_is_bounded_and_kept_in_order() -> None:
    gate, out = Gate(limit=8), []

    async def send(x: bytes) -> None:
        out.append(x)

    assert gate.hold_nowait(send, b"1234") and gate.hold_nowait(send, b"5678")
    assert not gate.hold_nowait(send, b"9")  # full: refused, not kept (the caller's "too far behind")
    await gate.release()
    assert out == [b"1234", b"5678"] and not gate.hold_nowait(send, b"x")  # open: the caller sends it itself
    gate2 = Gate()
    gate2.discard()
    assert gate2.hold_nowait(send, b"y") and out == [b"1234", b"5678"]  # dropped: nothing to do


def test_speculations_count_by_outcome() -> None:
    counts = Speculations()
    assert counts.enabled and counts.counts == {"started": 0, "released": 0, "taken_back": 0}
    counts.count("started")
    counts.count("taken_back")
    assert counts.counts == {"started": 1, "released": 0, "taken_back": 1}
