"""Drafted policy replies (each chunk drafted from the last one moved on by the control steps since, verified in the
observation's own forward) are the undrafted replies exactly, on a recorded episode through /v1/policy; the reply's
`policy_timing` counts the forwards (openpi's `infer_ms` beside them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from policy_fixture import POLICY, connect, freed, infer, obs, without_drafts
from serving import RunningServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

H_D = POLICY["action_horizon"] * POLICY["action_dims"]
# a recorded episode: slowly moving states, the client's control steps (gaps of 1 to 5 steps, one repeat)
EPISODE = [((0.1 + 0.02 * i, -0.2 + 0.01 * i, 0.5), step) for i, step in enumerate((0, 1, 3, 4, 4, 9, 10, 12, 13, 17))]


async def run(srv: RunningServer) -> list[dict]:
    ws, _ = await connect(srv)
    out = [await infer(ws, obs(state, step=step, prompt="reach")) for state, step in EPISODE]
    await ws.close()
    await freed(srv)
    return out


async def test_drafted_replies_are_the_undrafted_ones_in_fewer_forwards(policy_server: RunningServer,
                                                                       policy_checkpoint: Path) -> None:
    drafted = await run(policy_server)
    plain = await without_drafts(policy_checkpoint, run)
    for d, p in zip(drafted, plain, strict=True):
        assert np.array_equal(d["actions"], p["actions"]) and d["valid_from_step"] == p["valid_from_step"]
        assert d["stale"] is p["stale"] is False
        assert d["policy_timing"]["infer_ms"] > 0 and p["policy_timing"]["forwards"] == H_D
        assert "draft_tokens" not in p["policy_timing"]
    forwards = [d["policy_timing"]["forwards"] for d in drafted]
    assert forwards[0] == H_D and all(1 <= f <= H_D for f in forwards)  # nothing to draft from on the first tick
    assert min(forwards[1:]) <= 2, forwards  # a chunk that continues the last one: one or two forwards
    assert all(d["policy_timing"]["draft_tokens"] >= d["policy_timing"]["accepted_tokens"] for d in drafted[1:])
