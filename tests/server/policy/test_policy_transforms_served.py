"""A policy whose policy.json declares several state keys and normalisation statistics, served on /v1/policy: the
observation's keys are concatenated as declared, the reply's actions come back in raw units (the action statistics
inverted), the metadata says both, and an observation missing a declared key gets openpi's error frame."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import websockets
from helpers import make_checkpoint
from policy_fixture import POLICY, POLICY_CONFIG, connect, freed, infer, loader
from serving import RunningServer

from streamserve.robot.codec import PolicyCodec
from streamserve.server.adapters.policy import wire

pytestmark = pytest.mark.asyncio

KEYS = ["observation/state", "observation/gripper"]
STATS = {"state": {"q01": [-2.0, -2.0, 0.0], "q99": [2.0, 2.0, 1.0]},
         "actions": {"mean": [10.0, -5.0], "std": [4.0, 0.5]}}


async def test_state_keys_and_norm_stats_through_the_endpoint(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-policy-transforms"
    make_checkpoint(folder, "llama", seed=3)
    (folder / "policy.json").write_text(json.dumps({**POLICY, "state_keys": KEYS, "norm_stats": STATS}))
    codec = PolicyCodec.load(folder)
    assert codec is not None
    srv = await RunningServer.start(POLICY_CONFIG, loader(folder))
    try:
        ws, meta = await connect(srv)
        assert meta["state_keys"] == KEYS and meta["norm_stats"] == STATS
        obs = {"observation/state": np.array([0.4, -1.2], np.float32), "observation/gripper": np.float32(0.3),
               "step": 0}
        out = await infer(ws, obs)
        acts = out["actions"]
        assert acts.shape == (POLICY["action_horizon"], POLICY["action_dims"])
        # raw units: the normalised range [-1, 1] x [-0.5, 0.5] mapped through mean/std
        assert (np.abs(acts[:, 0] - 10.0) <= 4.0 + 1e-3).all() and (np.abs(acts[:, 1] + 5.0) <= 0.25 + 1e-3).all()
        # the session holds the state binned after normalisation, the declared keys concatenated
        [state_ids] = [p for p in codec.state_parts(codec.state_of(obs))]
        sessions = [e.session for e in srv.server.service.registry.all() if not e.session.closed]
        assert len(sessions) == 1 and list(sessions[0].token_ids)[-(len(state_ids) + 8):][:len(state_ids)] == state_ids
        await ws.send(wire.packb({"observation/state": np.array([0.4, -1.2], np.float32)}))  # no gripper
        frame = await ws.recv()
        assert isinstance(frame, str) and frame.startswith("invalid_observation") and "observation/gripper" in frame
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
        await freed(srv)
    finally:
        await srv.stop()
