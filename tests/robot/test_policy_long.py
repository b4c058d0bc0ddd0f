"""A long episode of the default policy: 2,000 ticks with changing targets on one rolling-window session.

The session's history passes its window many times over; the policy keeps reaching targets, and the session's
KV memory stays bounded (pages past the window go back to the pool).
"""

from __future__ import annotations

import pytest

from streamserve import Engine
from streamserve.robot import arm
from streamserve.robot.rollout import EnginePolicy, engine_codec

pytestmark = pytest.mark.slow


class Watched(EnginePolicy):
    """EnginePolicy that records the most KV pages its session held after any tick."""

    most_pages = 0

    def __call__(self, obs: dict) -> object:
        chunk = super().__call__(obs)
        assert self.session is not None
        self.most_pages = max(self.most_pages, self.session.pages_held)
        return chunk


def test_two_thousand_ticks_with_changing_targets_on_the_rolling_window() -> None:
    with Engine.from_pretrained("default-policy", device="cpu") as engine:
        codec = engine_codec(engine)
        with Watched(engine, codec) as policy:
            res = arm.run_long(7, policy, codec.action_horizon, ticks=2000)
            s = policy.session
            assert s is not None
            tokens = len(s)
            print(f"\nlong episode: {res.reached} of {res.reached + res.missed} targets reached in {res.ticks} ticks "
                  f"({res.queries} queries, {tokens} tokens through a window of {codec.window}); "
                  f"most KV pages held {policy.most_pages}")
            assert tokens > 20 * (codec.window + codec.sinks)  # the window rolled over many times
            page = engine.pool.page_size
            bound = 2 * (-(-(codec.window + codec.sinks + codec.n_action_tokens + 16) // page) + 2)
            assert policy.most_pages <= bound  # constant memory however long the episode
        assert res.targets >= 10 and res.success_rate >= 0.9, res
        engine.check_integrity()
        assert engine.pool.allocator.used_count == 0
