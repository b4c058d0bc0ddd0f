"""/v1/policy serving a "projector" policy: each tick appends [<obs>], the projected state (one embedding vector),
[<act>], and the served chunks equal robot/rollout.py's EnginePolicy's on the same observations. A damaged
projector file is refused to clients (text frame, 1011) and logged, never a crash at a tick."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
import websockets
from policy_fixture import (
    POLICY,
    POLICY_CONFIG,
    connect,
    expect_error,
    freed,
    infer,
    loader,
    obs,
    policy_url,
    projector_checkpoint,
)
from policy_fixture import sessions as live_sessions
from serving import RunningServer

from streamserve.robot.codec import PolicyCodec
from streamserve.robot.projector import StateProjector, save_state_projector
from streamserve.robot.rollout import EnginePolicy

pytestmark = pytest.mark.asyncio(loop_scope="module")
H, D = POLICY["action_horizon"], POLICY["action_dims"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return projector_checkpoint(tmp_path_factory.mktemp("proj-srv") / "tiny-projector")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(checkpoint: Path) -> AsyncIterator[RunningServer]:
    srv = await RunningServer.start(POLICY_CONFIG, loader(checkpoint))
    yield srv
    await srv.stop()


async def test_each_tick_appends_obs_the_projected_state_act_then_action_tokens(server: RunningServer,
                                                                              checkpoint: Path) -> None:
    codec = PolicyCodec.load(checkpoint)
    assert codec is not None
    proj = StateProjector.load(checkpoint, codec)
    tok = server.engine.tokenizer
    ws, meta = await connect(server)
    assert meta["state_encoding"] == "projector"
    length = 0
    for i, prompt in enumerate(["reach", "reach", "wave"]):
        state = (0.3 * i - 0.5, 0.2, -1.0 + i)
        out = await infer(ws, obs(state, prompt=prompt))
        [s] = live_sessions(server)
        new = s.token_ids[length:]
        head = codec.prompt_ids(tok.encode(prompt, add_special_tokens=False)) if i in (0, 2) else []
        assert new[:len(head)] == head  # the instruction on the first tick and when it changes
        at = length + len(head)
        assert s.token_ids[at:at + 3] == [codec.obs_token, server.engine.placeholder_id, codec.act_token]
        vec = s.core.vectors[at + 1]
        torch.testing.assert_close(vec, torch.from_numpy(proj.embed(np.asarray(state))[0]).to(vec.dtype))
        actions = s.token_ids[at + 3:]
        assert len(new) == len(head) + 3 + H * D and set(actions) <= set(codec.action_ids)
        np.testing.assert_array_equal(out["actions"], codec.actions(actions))
        length = len(s)
    await ws.close()
    await freed(server)


async def test_the_endpoint_acts_as_the_engine_policy_on_the_same_observations(server: RunningServer) -> None:
    observations = [obs((np.sin(i), np.cos(i), 0.4 * i - 1.5), prompt="reach" if i < 4 else "wave")
                    for i in range(7)]
    ws, _ = await connect(server)
    served = [(await infer(ws, o))["actions"] for o in observations]
    await ws.close()
    await freed(server)

    def direct() -> list[np.ndarray]:
        with EnginePolicy(server.engine) as policy:
            return [policy(o) for o in observations]

    for a, b in zip(served, await asyncio.to_thread(direct), strict=True):
        np.testing.assert_array_equal(a, b)
    await freed(server)


async def test_a_projector_file_of_another_model_is_refused_to_clients(tmp_path: Path) -> None:
    folder = projector_checkpoint(tmp_path / "wrong")
    save_state_projector(folder, np.zeros((5, 3)), np.zeros(5))  # hidden 5: not this model's
    srv = await RunningServer.start(POLICY_CONFIG, loader(folder))
    try:
        ws = await websockets.connect(policy_url(srv), max_size=None)
        text = await expect_error(ws)
        assert text.startswith("no_policy:") and "unusable" in text
        await freed(srv)
    finally:
        await srv.stop()

