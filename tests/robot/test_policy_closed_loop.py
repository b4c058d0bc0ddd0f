"""The shipped default policy (streamserve/assets/default-policy) in closed loop through the real engine.

Each episode runs on its own persistent session with the codec's rolling window, exactly as the server's policy
endpoint drives it: the instruction once, then per query the state's ids and a reply of H*D tokens constrained to
the action vocabulary. The bar of issue #15: >= 90% success on the fixed seeded episodes (the expert's rate beside).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from streamserve import Engine
from streamserve.engine.loading import DEFAULT_POLICY_DIR
from streamserve.robot import arm
from streamserve.robot.codec import PolicyCodec
from streamserve.robot.rollout import EnginePolicy, engine_codec, engine_success_rate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with Engine.from_pretrained("default-policy", device="cpu") as e:
        yield e


def test_the_checkpoint_ships_by_name_and_is_small(engine: Engine) -> None:
    assert engine.path == DEFAULT_POLICY_DIR and engine.name == "default-policy"
    assert engine.config.architecture == "LlamaForCausalLM"
    size = sum(f.stat().st_size for f in DEFAULT_POLICY_DIR.iterdir())
    assert size < 8 * 2**20, f"the shipped policy is {size / 2**20:.1f} MiB"
    codec = engine_codec(engine)
    assert codec == PolicyCodec.load(DEFAULT_POLICY_DIR)
    assert codec.state_key == arm.STATE_KEY and codec.action_dims == 2 and codec.state_dims == 6
    assert codec.window + codec.sinks <= engine.config.max_position_embeddings


def test_closed_loop_success_on_the_seeded_episodes(engine: Engine) -> None:
    codec = engine_codec(engine)
    seeds = list(arm.EVAL_SEEDS)
    expert = arm.success_rate(seeds, lambda: arm.ExpertPolicy(codec.action_horizon), codec.action_horizon)
    failed: list[int] = []
    rate = engine_success_rate(engine, seeds, on_episode=lambda s, r: failed.extend([s] * (not r.success)))
    print(f"\ndefault-policy closed-loop success {rate:.0%} on {len(seeds)} episodes (expert {expert:.0%}); "
          f"failed seeds: {failed}")
    assert expert == 1.0
    assert rate >= 0.9, f"success {rate:.0%} < 90% (failed seeds {failed})"
    engine.check_integrity()
    assert engine.pool.allocator.used_count == 0  # every episode's session gave its pages back


def test_each_tick_grows_the_session_by_the_state_and_a_reply_of_action_tokens_only(engine: Engine) -> None:
    codec = engine_codec(engine)
    allowed = set(codec.action_ids)
    policy = EnginePolicy(engine, codec)
    policy.record = True
    r = arm.run_episode(arm.EVAL_SEEDS[0], policy, codec.action_horizon)
    s = policy.session
    assert s is not None and r.queries == policy.ticks == len(policy.replies)
    tick = len(codec.state_ids(np.zeros(codec.state_dims))) + codec.n_action_tokens
    assert policy.growth == [tick] * r.queries
    assert all(len(ids) == codec.n_action_tokens and set(ids) <= allowed for ids in policy.replies)
    prompt = codec.prompt_ids(engine.tokenizer.encode(codec.default_prompt, add_special_tokens=False))
    assert len(s) == len(prompt) + r.queries * tick
    # the session holds the history obs, act, obs, act, ...: each reply right after its state
    assert s.token_ids[len(prompt)] == codec.obs_token and s.token_ids[len(prompt) + tick - codec.n_action_tokens - 1] \
        == codec.act_token
    policy.reset()
    assert s.closed and policy.session is None


def test_bad_observations_raise_typed_errors_and_leave_the_session_unchanged(engine: Engine) -> None:
    from streamserve.robot.codec import PolicyInputError

    with EnginePolicy(engine) as policy:
        q, target = arm.episode_start(1)
        policy(arm.observation(q, target))
        s = policy.session
        assert s is not None
        n = len(s)
        for bad in ({"prompt": "reach the target"}, {arm.STATE_KEY: np.full(6, np.nan)},
                    {arm.STATE_KEY: np.zeros(5)}, {arm.STATE_KEY: np.zeros(6), "prompt": 5}):
            with pytest.raises(PolicyInputError):
                policy(bad)
        assert len(s) == n
        chunk = policy(arm.observation(q, target))  # the episode goes on after the refusals
        assert chunk.shape == (policy.codec.action_horizon, 2) and len(s) > n
    engine.check_integrity()
