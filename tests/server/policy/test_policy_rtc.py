"""Real-time chunking through /v1/policy: an observation's `action_prefix` (the rows the robot executes while its
chunk is computed) is appended with the state as forced tokens, the reply's chunk starts with those rows and only
the rest is decoded (fewer forwards); drafted and undrafted replies stay identical with prefixes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from policy_fixture import POLICY, connect, freed, infer, obs, sessions, without_drafts
from serving import RunningServer

from streamserve.robot.codec import PolicyCodec

pytestmark = pytest.mark.asyncio(loop_scope="module")
H, D = POLICY["action_horizon"], POLICY["action_dims"]
# a recorded episode: states, control steps and the prefix's row count k (0 to H - 1) of each observation
EPISODE = [((0.1 + 0.03 * i, -0.2 + 0.02 * i, 0.5 - 0.1 * i), step, k)
           for i, (step, k) in enumerate(((0, 0), (2, 2), (4, 1), (6, 3), (8, 2), (11, 0), (13, 1)))]


async def run(srv: RunningServer) -> list[dict]:
    """The episode, each prefix the rows of the last reply's chunk still ahead at the observation's step (what an
    arm executes meanwhile), padded with that chunk's last row as robot_loop's queue would not: any rows do."""
    ws, _ = await connect(srv)
    out: list[dict] = []
    for state, step, k in EPISODE:
        extra = {}
        if k and out:
            last = out[-1]
            ahead = last["actions"][step - last["valid_from_step"]:]
            extra["action_prefix"] = np.concatenate([ahead, np.repeat(ahead[-1:], H, axis=0)])[:k]
        out.append(await infer(ws, obs(state, step=step, prompt="reach", **extra)))
    await ws.close()
    await freed(srv)
    return out


async def test_a_prefix_starts_the_chunk_and_only_the_rest_is_decoded(policy_server: RunningServer,
                                                                    policy_checkpoint: Path) -> None:
    codec = PolicyCodec.load(policy_checkpoint)
    assert codec is not None
    ws, _ = await connect(policy_server)
    first = await infer(ws, obs(step=0, prompt="reach"))
    [s] = sessions(policy_server)
    length = len(s)
    prefix = np.array([[0.9, -0.45], [-0.33, 0.1]], np.float32)  # k = 2 rows, off the bin centres
    state = (0.2, -0.1, 0.4)
    out = await infer(ws, obs(state, step=3, prompt="reach", action_prefix=prefix))
    ids = codec.prefix_ids(prefix)
    new = s.token_ids[length:]
    # the session holds the state, the forced rows right after <act>, then the H*D - k*D decoded ids
    assert new[:len(codec.state_ids(np.asarray(state))) + len(ids)] == codec.state_ids(np.asarray(state)) + ids
    chunk = new[-H * D:]
    assert len(new) == len(codec.state_ids(np.asarray(state))) + H * D and chunk[:len(ids)] == ids
    assert set(chunk) <= set(codec.action_ids)
    np.testing.assert_array_equal(out["actions"], codec.actions(chunk))  # rows 0, 1: the prefix's bin centres
    width = (np.array(POLICY["action_high"]) - POLICY["action_low"]) / POLICY["action_bins"]
    assert (np.abs(out["actions"][:2] - prefix) <= width / 2 + 1e-6).all(), (out["actions"], prefix)
    assert out["valid_from_step"] == 3 and out["actions"].shape == (H, D) and first["actions"].shape == (H, D)
    timing = out["policy_timing"]
    assert timing["prefix_tokens"] == len(ids) == 2 * D and timing["forwards"] <= H * D - len(ids)
    assert "prefix_tokens" not in first["policy_timing"]
    await ws.close()
    await freed(policy_server)


async def test_drafted_replies_with_prefixes_are_the_undrafted_ones(policy_server: RunningServer,
                                                                    policy_checkpoint: Path) -> None:
    drafted = await run(policy_server)
    plain = await without_drafts(policy_checkpoint, run)
    for d, p, (_, step, k) in zip(drafted, plain, EPISODE, strict=True):
        assert np.array_equal(d["actions"], p["actions"]) and d["valid_from_step"] == p["valid_from_step"] == step
        assert p["policy_timing"]["forwards"] == H * D - k * D  # undrafted: one forward per decoded token
        assert d["policy_timing"].get("prefix_tokens", 0) == k * D
        assert 1 <= d["policy_timing"]["forwards"] <= H * D - k * D
