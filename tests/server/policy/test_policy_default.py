"""The packaged default policy (streamserve/assets/default-policy) served on /v1/policy drives the simulated arm in
closed loop exactly as the engine does directly (robot/rollout.py's EnginePolicy): the same episodes, the same
outcomes, tick for tick. Skipped until the checkpoint is in the tree."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from policy_fixture import POLICY_CONFIG, freed, loader
from serving import serve

from streamserve.robot import arm
from streamserve.robot.rollout import EnginePolicy
from streamserve_client import SyncPolicyClient

CHECKPOINT = Path(__file__).resolve().parents[3] / "streamserve" / "assets" / "default-policy"
SEEDS = list(arm.EVAL_SEEDS[:4])
pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not (CHECKPOINT / "policy.json").is_file(), reason="no default-policy checkpoint")]


async def test_default_policy_through_the_endpoint_equals_the_engine_directly() -> None:
    async with serve(POLICY_CONFIG, loader(CHECKPOINT)) as srv:
        def over_the_wire() -> list[arm.EpisodeResult]:
            with SyncPolicyClient(srv.url) as client:
                out = []
                for seed in SEEDS:
                    client.reset()  # a new episode: a fresh session
                    out.append(arm.run_episode(seed, lambda o: client.infer(o)["actions"], replan_every=2))
                return out

        def direct() -> list[arm.EpisodeResult]:
            out = []
            for seed in SEEDS:
                with EnginePolicy(srv.engine) as policy:
                    out.append(arm.run_episode(seed, policy, replan_every=2))
            return out

        served = await asyncio.to_thread(over_the_wire)
        await freed(srv)
        assert served == await asyncio.to_thread(direct)
    assert sum(r.success for r in served) >= len(SEEDS) - 1  # the trained policy reaches (H1's test scores it)
