"""/v1/policy beyond openpi: deadlines and stale replies, latest observation wins, reset, auth, freeing on disconnect.
The engine is held between steps (serving.engine_paused) where a test needs an observation to stay in flight, so
nothing here depends on timing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import websockets
from policy_fixture import POLICY, POLICY_CONFIG, connect, freed, infer, loader, obs, reply, sessions
from serving import RunningServer, engine_paused, serve

from streamserve.robot.codec import PolicyCodec
from streamserve.server.adapters.policy import wire
from streamserve.server.adapters.policy.connection import PolicyConnection

pytestmark = pytest.mark.asyncio(loop_scope="module")
H, D = 4, 2
POLICY_ACTIONS = POLICY["action_token_offset"]


def conn_of(srv: RunningServer) -> PolicyConnection:
    [c] = [c for c in srv.server.connections if isinstance(c, PolicyConnection)]
    return c


async def until(check: Callable[[], object], what: str) -> None:
    end = time.monotonic() + 30
    while not check():
        assert time.monotonic() < end, f"never: {what}"
        await asyncio.sleep(0.01)


async def test_late_reply_is_stale_with_the_last_chunks_remaining_actions(policy_server: RunningServer) -> None:
    codec = PolicyCodec.from_dict(POLICY)
    tick = 5 + H * D  # [<obs>, 3 state ids, <act>] + the chunk
    ws, _ = await connect(policy_server)
    conn = conn_of(policy_server)
    with engine_paused(policy_server.engine):  # the first observation cannot be answered in time: nothing to give
        out = await infer(ws, obs(step=0, deadline_ms=1.0, timestamp=5.0))
    assert out["stale"] is True and out["actions"].shape == (0, D) and out["valid_from_step"] == 0
    assert out["timestamp"] == 5.0
    await until(lambda: conn.current is None, "the late tick's chunk decoded")
    [s] = sessions(policy_server)
    late_chunk = codec.actions(s.token_ids[-H * D:])  # decoded whole though late: the last chunk now (step 0)
    with engine_paused(policy_server.engine):
        again = await infer(ws, obs(step=1, deadline_ms=1.0))
    np.testing.assert_array_equal(again["actions"], late_chunk[1:])  # shifted by the one step since
    await until(lambda: conn.current is None, "the late tick's chunk decoded")
    fresh = await infer(ws, obs(step=10))
    assert fresh["stale"] is False and fresh["valid_from_step"] == 10
    length = len(s)
    with engine_paused(policy_server.engine):
        late = await infer(ws, obs((0.5, 0.5, 0.5), step=12, deadline_ms=0.0))  # raised to --min-deadline-ms
    assert late["stale"] is True and late["valid_from_step"] == 12
    np.testing.assert_array_equal(late["actions"], fresh["actions"][2:])  # shifted by the two steps elapsed
    await until(lambda: conn.current is None, "the late tick's chunk decoded")
    with engine_paused(policy_server.engine):
        later = await infer(ws, obs(step=12 + H, deadline_ms=1.0))
    assert later["stale"] is True and later["actions"].shape == (0, D)  # the last chunk (step 12's) ran out
    nxt = await infer(ws, obs((0.2, 0.1, 0.0), step=30, deadline_ms=60_000.0))  # in time: a fresh chunk
    assert nxt["stale"] is False and nxt["actions"].shape == (H, D)
    assert len(s) - length == 3 * tick  # every tick whole, the late ones too: never a half chunk
    await ws.close()
    await freed(policy_server)


async def test_latest_observation_wins(policy_server: RunningServer) -> None:
    ws, _ = await connect(policy_server)
    await infer(ws, obs(step=0))  # the session is open
    conn = conn_of(policy_server)
    with engine_paused(policy_server.engine):
        await ws.send(wire.packb(obs(step=1)))
        await until(lambda: conn.current is not None and conn.current.step == 1, "step 1 in flight")
        for step in (2, 3, 4):  # each replaces the one waiting
            await ws.send(wire.packb(obs(step=step)))
        await until(lambda: conn.queued is not None and conn.queued.step == 4, "step 4 waiting")
    assert (await reply(ws))["valid_from_step"] == 1
    assert (await reply(ws))["valid_from_step"] == 4  # 2 and 3 were replaced: no reply
    assert (await infer(ws, obs(step=5)))["valid_from_step"] == 5  # and nothing else came in between
    await ws.close()
    await freed(policy_server)


async def test_reset_starts_a_new_episode_on_a_new_session(policy_server: RunningServer) -> None:
    ws, _ = await connect(policy_server)
    await infer(ws, obs(timestamp=1.0))
    assert (await infer(ws, obs(timestamp=1.2)))["valid_from_step"] == 10
    [first] = sessions(policy_server)
    ack = await infer(ws, {"reset": True})
    assert ack["reset"] is True and ack["episode"] == 1 and "actions" not in ack
    assert first.closed and not sessions(policy_server)  # freed at once
    out = await infer(ws, obs(timestamp=7.0))
    assert out["episode"] == 1 and out["valid_from_step"] == 0  # the step clock restarts
    [second] = sessions(policy_server)
    assert second.id != first.id
    with_obs = await infer(ws, obs(reset=True, timestamp=9.0))  # reset + observation: its chunk, new episode
    assert with_obs["episode"] == 2 and with_obs["actions"].shape == (H, D) and second.closed
    # a reset that is replaced while waiting is not lost: the observation replacing it starts the episode
    conn = conn_of(policy_server)
    with engine_paused(policy_server.engine):
        await ws.send(wire.packb(obs(step=1)))
        await until(lambda: conn.current is not None and conn.current.step == 1, "step 1 in flight")
        await ws.send(wire.packb({"reset": True}))
        await ws.send(wire.packb(obs(step=0)))
        await until(lambda: conn.queued is not None and conn.queued.state_ids is not None, "the observation waits")
    assert (await reply(ws))["episode"] == 2
    last = await reply(ws)
    assert last["episode"] == 3 and last["actions"].shape == (H, D) and len(sessions(policy_server)) == 1
    await ws.close()
    await freed(policy_server)


async def test_disconnect_mid_inference_frees_the_session(policy_server: RunningServer) -> None:
    ws, _ = await connect(policy_server)
    await infer(ws, obs())
    conn = conn_of(policy_server)
    with engine_paused(policy_server.engine):
        await ws.send(wire.packb(obs(step=3)))
        await until(lambda: conn.current is not None, "in flight")
        ws.transport.abort()  # gone without a closing handshake, a reply running
    await freed(policy_server)


async def test_api_key_bearer_and_openpi_api_key_header(policy_checkpoint: Path) -> None:
    async with serve(replace(POLICY_CONFIG, api_key="sekret"), loader(policy_checkpoint)) as srv:
        for port in (False, True):
            for header in ("Api-Key sekret", "Bearer sekret"):
                ws, _ = await connect(srv, port=port, headers={"Authorization": header})
                assert (await infer(ws, obs()))["actions"].shape == (H, D)
                await ws.close()
            for headers in ({"Authorization": "Api-Key wrong"}, None):
                with pytest.raises(websockets.InvalidStatus) as info:
                    await connect(srv, port=port, headers=headers)
                assert info.value.response.status_code == 401
        await freed(srv)


async def test_an_endless_episode_holds_constant_memory(policy_server: RunningServer) -> None:
    ws, meta = await connect(policy_server)
    tick = 5 + H * D  # [<obs>, 3 state ids, <act>] + the chunk
    for step in range(3 * meta["window"] // tick):  # the rolling window has turned over several times
        await infer(ws, obs((np.sin(step), np.cos(step), 0.1 * (step % 7)), step=step))
    [s] = sessions(policy_server)
    pages = s.pages_held
    conn = conn_of(policy_server)
    length = len(s)
    with engine_paused(policy_server.engine):  # late, with a new instruction: its chunk is still decoded, whole
        late = await infer(ws, obs(step=100, deadline_ms=1.0, prompt="x" * 59))
    assert late["stale"] is True
    await until(lambda: conn.current is None, "the late tick's chunk decoded")
    assert len(s) - length == 60 + tick
    assert set(s.token_ids[-H * D:]) <= set(range(POLICY_ACTIONS, POLICY_ACTIONS + 16))
    out = await infer(ws, obs(step=101, prompt="x" * 59))
    assert out["stale"] is False and len(s) - length == 60 + 2 * tick
    assert s.pages_held <= pages + 1  # constant memory
    await ws.close()
    await freed(policy_server)

