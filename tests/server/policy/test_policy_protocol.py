"""/v1/policy: openpi's protocol round trips on a tiny random policy checkpoint (loopback)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import websockets
from policy_fixture import POLICY, POLICY_CONFIG, connect, freed, infer, loader, obs, sessions
from serving import RunningServer, engine_paused

from streamserve.robot.codec import PolicyCodec
from streamserve.robot.rollout import EnginePolicy

pytestmark = pytest.mark.asyncio(loop_scope="module")
H, D = POLICY["action_horizon"], POLICY["action_dims"]


async def test_metadata_first_then_one_reply_per_observation(policy_server: RunningServer) -> None:
    ws, meta = await connect(policy_server)
    assert meta["action_horizon"] == H and meta["action_dims"] == D and meta["state_key"] == "observation/state"
    ext = meta["streamserve"]
    assert ext["latest_observation_wins"] is True and ext["max_queued_observations"] == 1
    assert ext["action_shape"] == [H, D] and "deadline_ms" in ext["observation_keys"]
    first = await infer(ws, obs(timestamp=10.0))
    assert first["actions"].dtype == np.float32 and first["actions"].shape == (H, D)
    assert first["stale"] is False and first["valid_from_step"] == 0 and first["timestamp"] == 10.0
    assert set(first["server_timing"]) == {"infer_ms"}  # openpi: prev_total_ms from the second reply on
    second = await infer(ws, obs((0.3, 0.3, -1.0), timestamp=10.1))
    assert second["valid_from_step"] == 5  # 0.1 s at 50 Hz on the client's clock
    assert set(second["server_timing"]) == {"infer_ms", "prev_total_ms"}
    low, high = np.array(POLICY["action_low"]), np.array(POLICY["action_high"])
    assert ((second["actions"] >= low) & (second["actions"] <= high)).all()
    await ws.close()
    await freed(policy_server)


async def test_session_grows_by_exactly_each_tick_and_emits_only_action_tokens(policy_server: RunningServer,
                                                                               policy_checkpoint: Path) -> None:
    codec = PolicyCodec.load(policy_checkpoint)
    assert codec is not None
    tok = policy_server.engine.tokenizer
    ws, _ = await connect(policy_server)
    states = [(0.1 * i, -0.05 * i, 1.5 - 0.2 * i) for i in range(6)]
    prompts = ["reach", "reach", "reach", "wave", "wave", "reach"]
    length, prompt = 0, None
    for state, p in zip(states, prompts, strict=True):
        out = await infer(ws, obs(state, prompt=p))
        [s] = sessions(policy_server)
        expect = codec.state_ids(np.asarray(state))
        if p != prompt:  # the first tick, and whenever the instruction changes
            expect = codec.prompt_ids(tok.encode(p, add_special_tokens=False)) + expect
        new = s.token_ids[length:]
        assert len(new) == len(expect) + H * D
        assert new[:len(expect)] == expect
        actions = new[len(expect):]
        assert set(actions) <= set(codec.action_ids)  # constrained decoding: never a token outside them
        np.testing.assert_array_equal(out["actions"], codec.actions(actions))
        length, prompt = len(s), p
    await ws.close()
    await freed(policy_server)


async def test_policy_port_serves_the_endpoint_at_root(policy_server: RunningServer) -> None:
    ws, meta = await connect(policy_server, port=True)
    assert meta["streamserve"]["action_shape"] == [H, D]
    out = await infer(ws, obs())
    assert out["actions"].shape == (H, D)
    await ws.close()
    await freed(policy_server)


async def test_absolute_deadline_and_the_policy_ports_healthz(policy_server: RunningServer) -> None:
    url = f"http://127.0.0.1:{policy_server.server.policy.port}/healthz"
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    ws, _ = await connect(policy_server)
    in_time = await infer(ws, obs(deadline=time.time() + 600, step=0))
    assert in_time["stale"] is False
    with engine_paused(policy_server.engine):  # a deadline already past: answered at once from the last chunk
        late = await infer(ws, obs(deadline=time.time() - 5, step=1))
    assert late["stale"] is True and late["actions"].shape == (H - 1, D)
    await ws.close()
    await freed(policy_server)


async def test_shutdown_closes_policy_connections_and_frees_their_sessions(policy_checkpoint: Path) -> None:
    srv = await RunningServer.start(POLICY_CONFIG, loader(policy_checkpoint))
    engine = srv.engine
    ws, _ = await connect(srv, port=True)
    await infer(ws, obs())
    stop = asyncio.create_task(srv.stop())
    with pytest.raises(websockets.ConnectionClosed) as info:
        await asyncio.wait_for(ws.recv(), 60)
    await stop
    assert info.value.rcvd is not None and info.value.rcvd.code == 1001
    assert engine.stats()["kv_pages_used"] == 0 and engine.stats()["sessions_open"] == 0


async def test_the_endpoint_acts_as_the_engine_policy_of_robot_rollout(policy_server: RunningServer) -> None:
    """The same observations through /v1/policy and through robot/rollout.py's EnginePolicy (the engine directly):
    the same chunks, bit for bit (greedy, the same tokens on a session of the same window)."""
    observations = [obs((np.sin(i), np.cos(i), 0.3 * i - 1), prompt="reach" if i < 5 else "wave") for i in range(8)]
    ws, _ = await connect(policy_server)
    served = [(await infer(ws, o))["actions"] for o in observations]
    await ws.close()
    await freed(policy_server)

    def direct() -> list[np.ndarray]:
        with EnginePolicy(policy_server.engine) as policy:
            return [policy(o) for o in observations]

    for a, b in zip(served, await asyncio.to_thread(direct), strict=True):
        np.testing.assert_array_equal(a, b)
