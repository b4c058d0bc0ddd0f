"""The simulated two-link arm (streamserve/robot/arm.py): kinematics, limits, the scripted expert, the runners."""

from __future__ import annotations

import numpy as np
import pytest

from streamserve.robot import arm


def test_forward_kinematics_and_jacobian() -> None:
    assert np.allclose(arm.hand(np.array([0.0, 0.0])), [arm.L1 + arm.L2, 0.0])
    assert np.allclose(arm.hand(np.array([np.pi / 2, np.pi / 2])), [-arm.L2, arm.L1])
    rng = np.random.default_rng(1)
    for _ in range(20):  # the Jacobian is the derivative of the hand position (central differences)
        q, eps = rng.uniform([-3, 0.2], [3, 2.9]), 1e-6
        num = np.stack([(arm.hand(q + d) - arm.hand(q - d)) / (2 * eps) for d in np.eye(2) * eps], axis=1)
        assert np.allclose(arm.jacobian(q), num, atol=1e-6)


def test_step_clips_velocities_limits_the_elbow_wraps_the_shoulder_and_ignores_nan() -> None:
    q = np.array([0.0, 1.0])
    assert np.allclose(arm.step(q, [100.0, -100.0]), [arm.QD_MAX * arm.DT, 1.0 - arm.QD_MAX * arm.DT])
    assert arm.step(np.array([0.0, arm.Q2_MIN + 0.01]), [0.0, -2.0])[1] == arm.Q2_MIN
    assert arm.step(np.array([0.0, arm.Q2_MAX - 0.01]), [0.0, 2.0])[1] == arm.Q2_MAX
    assert np.isclose(arm.step(np.array([np.pi - 0.01, 1.0]), [2.0, 0.0])[0], -np.pi + 0.03)
    assert np.allclose(arm.step(q, [np.nan, np.inf]), q)  # a broken command holds still


def test_observation_layout() -> None:
    q, target = np.array([0.3, 1.2]), np.array([0.2, -0.4])
    obs = arm.observation(q, target)
    s = obs[arm.STATE_KEY]
    assert s.dtype == np.float32 and s.shape == (6,) and obs[arm.PROMPT_KEY] == arm.PROMPT
    assert np.allclose(s[:4], [0.3, 1.2, 0.2, -0.4]) and np.allclose(s[4:], target - arm.hand(q), atol=1e-6)
    # joint angles and the target lie inside the declared ranges (a far offset is clipped by the codec's bins)
    assert np.all(s[:4] >= np.array(arm.STATE_LOW)[:4]) and np.all(s[:4] <= np.array(arm.STATE_HIGH)[:4])


def test_seeded_episodes_are_reproducible_reachable_and_not_trivial() -> None:
    for seed in range(50):
        q, target = arm.episode_start(seed)
        assert np.allclose(q, arm.episode_start(seed)[0]) and np.allclose(target, arm.episode_start(seed)[1])
        assert arm.TARGET_R[0] - 1e-9 <= np.linalg.norm(target) <= arm.TARGET_R[1] + 1e-9
        assert np.linalg.norm(arm.hand(q) - target) > 4 * arm.TOLERANCE
        assert arm.Q2_MIN <= q[1] <= arm.Q2_MAX


def test_expert_chunk_is_its_control_law_rolled_out() -> None:
    q, target = arm.episode_start(3)
    chunk = arm.expert_chunk(q, target, 5)
    assert chunk.shape == (5, 2) and chunk.dtype == np.float32 and np.all(np.abs(chunk) <= arm.QD_MAX + 1e-6)
    for h in range(5):
        assert np.allclose(chunk[h], arm.expert_velocity(q, target), atol=1e-6)
        q = arm.step(q, chunk[h])
    # the expert only reads the observation
    q0, t0 = arm.episode_start(3)
    assert np.allclose(arm.ExpertPolicy(5)(arm.observation(q0, t0)), arm.expert_chunk(q0, t0, 5), atol=1e-6)


@pytest.mark.parametrize("replan", [1, 8])
def test_the_expert_succeeds_on_the_seeded_episodes(replan: int) -> None:
    seeds = list(range(100_000, 100_100))
    results = [arm.run_episode(s, arm.ExpertPolicy(8), replan) for s in seeds]
    rate = np.mean([r.success for r in results])
    print(f"expert success (replan every {replan}): {rate:.0%}, mean ticks {np.mean([r.ticks for r in results]):.0f}")
    assert rate == 1.0
    assert all(r.final_distance <= arm.TOLERANCE and r.ticks < arm.TIME_LIMIT for r in results)


def test_a_policy_that_does_nothing_fails_and_a_wrong_chunk_is_refused() -> None:
    r = arm.run_episode(7, lambda obs: np.zeros((4, 2)), 4)
    assert not r.success and r.ticks == arm.TIME_LIMIT and r.queries == -(-arm.TIME_LIMIT // 4)
    with pytest.raises(ValueError):
        arm.run_episode(7, lambda obs: np.zeros(4), 4)
    with pytest.raises(ValueError):
        arm.run_episode(7, lambda obs: np.zeros((4, 2)), 0)


def test_long_episode_with_changing_targets() -> None:
    res = arm.run_long(5, arm.ExpertPolicy(8), 8, ticks=2000)
    assert res.ticks == 2000 and res.queries == 250
    assert res.targets > 10 and res.missed == 0 and res.reached >= res.targets - 1 and res.success_rate == 1.0
