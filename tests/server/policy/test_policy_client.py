"""streamserve_client.policy: PolicyClient (asyncio) and SyncPolicyClient against /v1/policy (loopback)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from policy_fixture import POLICY, POLICY_CONFIG, freed, loader, obs
from serving import RunningServer, engine_paused, serve

from streamserve_client import InvalidInputError, PolicyClient, SyncPolicyClient, UnauthorizedError
from streamserve_client.policy import packb, policy_url, unpackb

pytestmark = pytest.mark.asyncio(loop_scope="module")
H, D = POLICY["action_horizon"], POLICY["action_dims"]


async def test_infer_reset_stale_and_errors(policy_server: RunningServer) -> None:
    async with PolicyClient(policy_server.url) as policy:  # /v1/policy is added
        assert policy.metadata["action_horizon"] == H and policy.metadata["streamserve"]["protocol"] == 1
        out = await policy.infer(obs(), timestamp=3.0)
        assert out["actions"].dtype == np.float32 and out["actions"].shape == (H, D) and out["timestamp"] == 3.0
        assert out["stale"] is False and out["episode"] == 0
        with engine_paused(policy_server.engine):
            late = await policy.infer(obs(), deadline_ms=1.0, step=2)
        assert late["stale"] is True and late["valid_from_step"] == 2
        np.testing.assert_array_equal(late["actions"], out["actions"][2:])
        ack = await policy.reset()
        assert ack["reset"] is True and ack["episode"] == 1
        first = await policy.reset(obs())
        assert first["episode"] == 2 and first["actions"].shape == (H, D)
        with pytest.raises(InvalidInputError) as info:
            await policy.infer(obs((0.0, float("nan"), 0.0)))
        assert info.value.code == "invalid_observation" and "NaN" in info.value.message
        with pytest.raises(InvalidInputError):  # the connection is closed (1011): every later call says why
            await policy.infer(obs())
    await freed(policy_server)


async def test_send_and_receive_pipeline_latest_wins(policy_server: RunningServer) -> None:
    async with PolicyClient(policy_server.url) as policy:
        await policy.infer(obs(), step=0)
        for step in range(1, 30):  # as fast as it can: some are replaced while waiting, none is answered twice
            await policy.send(obs(), step=step)
        await policy.send(obs(), step=99)
        steps = []
        while not steps or steps[-1] != 99:
            steps.append((await policy.receive())["valid_from_step"])
        assert steps == sorted(set(steps))
    await freed(policy_server)


async def test_sync_client_on_the_policy_port(policy_server: RunningServer) -> None:
    def control_loop(url: str) -> None:  # a blocking robot loop, in its own thread (the server runs on this loop)
        with SyncPolicyClient(url) as policy:
            assert policy.metadata["action_dims"] == D
            assert policy.infer(obs(), step=1)["valid_from_step"] == 1
            assert policy.reset()["episode"] == 1
            assert policy.infer(obs())["actions"].shape == (H, D)

    await asyncio.to_thread(control_loop, f"ws://127.0.0.1:{policy_server.server.policy.port}/")
    await freed(policy_server)


async def test_api_key(policy_checkpoint: Path) -> None:
    async with serve(replace(POLICY_CONFIG, api_key="k3y"), loader(policy_checkpoint)) as srv:
        with pytest.raises(UnauthorizedError):
            await PolicyClient(srv.url, api_key="wrong").connect()
        async with PolicyClient(srv.url, api_key="k3y") as policy:
            assert (await policy.infer(obs()))["actions"].shape == (H, D)
        await asyncio.sleep(0)
        await freed(srv)


async def test_encoding_round_trip_and_urls() -> None:
    arrays = {"a": np.arange(6, dtype="<f2").reshape(2, 3).T, "b": np.full((), 7, np.int64), "c": np.bool_(True)}
    back = unpackb(packb(arrays))
    assert back["a"].shape == (3, 2) and (back["a"] == arrays["a"]).all() and back["b"].shape == ()
    assert back["c"] is np.True_ or back["c"] == np.bool_(True)
    with pytest.raises(TypeError):
        packb({"s": np.array(["text"])})
    assert policy_url("ws://h:1") == "ws://h:1/v1/policy" and policy_url("ws://h:2/") == "ws://h:2/"


async def test_robots_at_once_each_on_its_own_session(policy_server: RunningServer) -> None:
    async def robot(k: int) -> list[int]:
        async with PolicyClient(policy_server.url) as policy:
            steps = []
            for step in range(6):
                out = await policy.infer(obs((0.1 * k, -0.1 * step, 0.0)), step=step)
                assert out["actions"].shape == (H, D) and out["stale"] is False
                steps.append(out["valid_from_step"])
            return steps

    assert await asyncio.gather(*(robot(k) for k in range(6))) == [list(range(6))] * 6
    await freed(policy_server)


async def test_an_error_frame_that_came_while_not_reading_is_raised_by_the_next_send(
        policy_server: RunningServer) -> None:
    async with PolicyClient(policy_server.url) as policy:
        await policy.send(obs((float("nan"), 0.0, 0.0)))  # refused; this client reads nothing yet
        ws = policy.ws
        assert ws is not None
        await asyncio.wait_for(ws.wait_closed(), 30)  # the server sent its error frame and closed
        with pytest.raises(InvalidInputError) as info:  # the next send finds the frame, not just a closed socket
            await policy.send(obs())
        assert info.value.code == "invalid_observation"
    await freed(policy_server)
