"""The codec's input transforms (robot/codec.py, robot/normalize.py): several observation keys concatenated into the
state as policy.json declares them, and openpi's normalisation statistics (mean/std or quantiles) applied to the
state on the way in and inverted on the actions on the way out; bad declarations and observations get typed errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from streamserve.robot.codec import PolicyCodec, PolicyConfigError, PolicyInputError

STATE_STATS = {"mean": [0.5, -1.0, 2.0], "std": [2.0, 0.5, 0.0]}  # a constant dimension: std 0
ACTION_STATS = {"q01": [-3.0, 0.0], "q99": [1.0, 0.2]}


def make(**over: Any) -> PolicyCodec:
    kw: dict[str, Any] = dict(
        state_key="observation/joints", state_low=(-1.0, -1.0, -1.0), state_high=(1.0, 1.0, 1.0), state_bins=16,
        state_token_offset=10, action_dims=2, action_horizon=3, action_low=(-1.0, -1.0), action_high=(1.0, 1.0),
        action_bins=9, action_token_offset=26, obs_token=3, act_token=4, task_token=5)
    kw.update(over)
    return PolicyCodec(**kw)


def test_several_state_keys_are_concatenated_in_order() -> None:
    c = make(state_keys=("observation/joints", "observation/gripper"))
    obs = {"observation/joints": np.array([0.1, -0.2], np.float32), "observation/gripper": 0.7}
    assert np.allclose(c.state_of(obs), [0.1, -0.2, 0.7])
    assert c.metadata()["state_keys"] == ["observation/joints", "observation/gripper"]
    assert make().metadata()["state_keys"] == ["observation/joints"]
    with pytest.raises(PolicyInputError, match="'observation/gripper'"):
        c.state_of({"observation/joints": [0.1, 0.2]})
    with pytest.raises(PolicyInputError, match="'observation/joints' 3, 'observation/gripper' 1"):
        c.state_of({"observation/joints": [0.1, 0.2, 0.3], "observation/gripper": [1.0]})
    with pytest.raises(PolicyInputError, match="NaN"):
        c.state_of({"observation/joints": [0.1, np.nan], "observation/gripper": [1.0]})
    for keys in (("observation/gripper", "observation/joints"), ("observation/joints", "observation/joints"),
                 ("observation/joints", "")):
        with pytest.raises(PolicyConfigError, match="state_keys"):
            make(state_keys=keys)
    again = PolicyCodec.from_dict(c.to_dict())  # policy.json round trip
    assert again.state_keys == c.state_keys


def test_the_state_is_normalised_before_binning_and_the_actions_inverted_after() -> None:
    plain, c = make(), make(norm_stats={"state": STATE_STATS, "actions": ACTION_STATS})
    raw = np.array([1.5, -1.25, 2.0])
    normalised = (raw - np.array([0.5, -1.0, 2.0])) / (np.array([2.0, 0.5, 0.0]) + 1e-6)  # 0.5, -0.5, 0
    assert c.state_ids(raw) == plain.state_ids(normalised)
    ids = plain.action_tokens(np.array([[-1.0, 1.0], [0.0, 0.5], [0.9, -0.9]]))
    centres = plain.actions(ids)  # in [-1, 1]: what the model's bins mean
    want = (centres + 1.0) / 2.0 * (np.array([1.0, 0.2]) - np.array([-3.0, 0.0]) + 1e-6) + np.array([-3.0, 0.0])
    assert np.allclose(c.actions(ids), want, atol=1e-5)
    assert c.action_tokens(c.actions(ids)) == ids  # raw actions back to the same bins
    assert PolicyCodec.from_dict(c.to_dict()).actions(ids).tolist() == c.actions(ids).tolist()
    only_state = make(norm_stats={"state": STATE_STATS})
    assert np.allclose(only_state.actions(ids), centres)  # no action stats: the bins' values as they are


@pytest.mark.parametrize(("stats", "match"), [
    ({"state": {"mean": [0.0, 0.0], "std": [1.0, 1.0]}}, "3 finite numbers"),
    ({"state": {"mean": [0.0] * 3, "std": [1.0, -1.0, 1.0]}}, "negative"),
    ({"actions": {"q01": [1.0, 0.0], "q99": [0.0, 1.0]}}, "below q01"),
    ({"actions": {"mean": [0.0, 0.0], "q99": [1.0, 1.0]}}, "either mean and std"),
    ({"velocity": {"mean": [0.0], "std": [1.0]}}, "norm_stats must be"),
    ({"state": {"mean": [0.0, 0.0, float("nan")], "std": [1.0] * 3}}, "finite"),
])
def test_bad_norm_stats_are_refused(stats: dict, match: str) -> None:
    with pytest.raises(PolicyConfigError, match=match):
        make(norm_stats=stats)
