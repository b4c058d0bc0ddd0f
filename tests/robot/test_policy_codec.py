"""The policy codec (streamserve/robot/codec.py): binning round trips, the tick layout, typed errors, policy.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from streamserve.errors import InvalidInputError, ModelLoadError
from streamserve.robot.codec import PolicyCodec, PolicyConfigError, PolicyInputError


def make(**over: Any) -> PolicyCodec:
    kw: dict[str, Any] = dict(
        state_key="observation/state", state_low=(-1.0, 0.0, -2.0), state_high=(1.0, 10.0, 2.0), state_bins=16,
        state_token_offset=10, action_dims=2, action_horizon=3, action_low=(-1.0, -0.5), action_high=(1.0, 0.5),
        action_bins=9, action_token_offset=26, obs_token=3, act_token=4, task_token=5, default_prompt="go")
    kw.update(over)
    return PolicyCodec(**kw)


def test_state_ids_lay_out_one_tick_and_clip_into_the_ranges() -> None:
    c = make()
    ids = c.state_ids(np.array([-1.0, 10.0, 0.1], dtype=np.float32))
    # [<obs>, s_1..s_3, <act>]: -1 is bin 0, the top of the range the last bin, 0.1 in [-2, 2] bin 8 of 16
    assert ids == [3, 10 + 0, 10 + 15, 10 + 8, 4]
    assert c.state_ids([-5.0, 99.0, -7.0]) == [3, 10, 25, 10, 4]  # outside: clipped to the edge bins
    assert c.state_ids(np.array([0, 5, 0], dtype=np.int32))[1:-1] == [18, 18, 18]
    assert c.prompt_ids([7, 8]) == [5, 7, 8] and c.prompt_ids([]) == [5]


def test_actions_round_trip_through_bin_centres() -> None:
    c = make()
    rng = np.random.default_rng(0)
    chunk = rng.uniform([-1, -0.5], [1, 0.5], size=(3, 2))
    ids = c.action_tokens(chunk)
    assert len(ids) == c.n_action_tokens == 6 and set(ids) <= set(c.action_ids)
    back = c.actions(ids)
    assert back.shape == (3, 2) and back.dtype == np.float32
    width = (np.array(c.action_high) - np.array(c.action_low)) / c.action_bins
    assert np.all(np.abs(back - chunk) <= width / 2 + 1e-6)  # within half a bin of the value
    assert c.action_tokens(back) == ids  # a centre maps to its own bin
    # step-major: step 0's two dims come first
    assert c.actions(ids[:2] + ids[2:])[0].tolist() == back[0].tolist()
    assert c.action_ids == list(range(26, 35))
    assert c.actions([26 + 4] * 6).tolist() == [[0.0, 0.0]] * 3  # an odd bin count has 0 as a centre


@pytest.mark.parametrize("state", [[0.0, 1.0], [[0.0, 1.0, 2.0]], np.zeros((3, 1)), [0.0, float("nan"), 1.0],
                                   [0.0, np.inf, 1.0], ["a", "b", "c"], [True, False, True], None, {"x": 1}])
def test_bad_states_raise_typed_errors(state: Any) -> None:
    with pytest.raises(PolicyInputError) as e:
        make().state_ids(state)
    assert isinstance(e.value, InvalidInputError) and e.value.code == "invalid_observation"


def test_observation_dicts() -> None:
    c = make()
    obs = {"observation/state": np.array([0.5, 1, 1], dtype=np.float32), "prompt": "reach"}
    assert c.state_of(obs).tolist() == [0.5, 1.0, 1.0] and c.prompt_of(obs) == "reach"
    assert c.prompt_of({"observation/state": [0, 0, 0]}) == "go"  # the default instruction
    for bad in ({"state": [0, 0, 0]}, {}, [1, 2, 3], {"observation/state": [0, 0]}):
        with pytest.raises(PolicyInputError):
            c.state_of(bad)  # type: ignore[arg-type]
    with pytest.raises(PolicyInputError):
        c.prompt_of({"prompt": 3})


@pytest.mark.parametrize("ids", [[26] * 5, [26] * 7, [25] + [26] * 5, [35] * 6, [26.0] * 6, [[26] * 6]])
def test_bad_action_replies_raise(ids: Any) -> None:
    with pytest.raises(PolicyInputError):
        make().actions(ids)


def test_bad_action_chunks_raise() -> None:
    c = make()
    for bad in (np.zeros((2, 2)), np.zeros(6), np.full((3, 2), np.nan)):
        with pytest.raises(PolicyInputError):
            c.action_tokens(bad)


def test_policy_json_round_trip_and_metadata(tmp_path: Path) -> None:
    c = make(image_keys=("observation/image",), window=64, sinks=4, control_hz=20.0)
    c.save(tmp_path)
    assert PolicyCodec.load(tmp_path) == c
    meta = c.metadata()
    assert json.loads(json.dumps(meta)) == meta
    assert meta["action_horizon"] == 3 and meta["action_dims"] == 2 and meta["state_dims"] == 3
    assert meta["image_keys"] == ["observation/image"] and meta["control_hz"] == 20.0
    assert PolicyCodec.load(tmp_path / "nowhere") is None
    (tmp_path / "policy.json").unlink()
    assert PolicyCodec.load(tmp_path) is None  # not a policy checkpoint


def _broken(d: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    d = dict(d)
    if value is KeyError:
        del d[key]
    else:
        d[key] = value
    return d


@pytest.mark.parametrize("key,value", [
    ("format", 2), ("state_bins", KeyError), ("action_horizon", 0), ("action_bins", "9"), ("state_low", [0.0]),
    ("state_high", [-1.0, 0.0, 2.0]), ("action_low", [-1.0, float("nan")]), ("obs_token", 12),
    ("action_token_offset", 20), ("window", 2), ("control_hz", 0), ("image_keys", "cam"), ("surprise", 1),
    ("state_key", 7), ("sinks", -1), ("act_token", True)])
def test_malformed_policy_json_raises_a_typed_error(tmp_path: Path, key: str, value: Any) -> None:
    good = make(window=8, sinks=4).to_dict()
    (tmp_path / "policy.json").write_text(json.dumps(_broken(good, key, value)))
    with pytest.raises(PolicyConfigError) as e:
        PolicyCodec.load(tmp_path)
    assert isinstance(e.value, ModelLoadError) and e.value.code == "invalid_policy_config"


def test_unreadable_policy_json_and_ids_past_the_vocabulary(tmp_path: Path) -> None:
    (tmp_path / "policy.json").write_text("{not json")
    with pytest.raises(PolicyConfigError):
        PolicyCodec.load(tmp_path)
    (tmp_path / "policy.json").write_text("[1, 2]")
    with pytest.raises(PolicyConfigError):
        PolicyCodec.load(tmp_path)
    make().save(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 30}))  # the action ids run to 34
    with pytest.raises(PolicyConfigError, match="vocabulary"):
        PolicyCodec.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 35}))
    assert PolicyCodec.load(tmp_path) == make()


def test_codec_and_arm_import_without_torch() -> None:
    code = ("import sys; import streamserve.robot.codec, streamserve.robot.arm, streamserve.robot.dataset; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('streamserve.engine', "
            "'streamserve.server', 'streamserve.models'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_action_prefix_ids_are_the_chunks_first_rows() -> None:
    c = make()
    chunk = np.array([[0.9, -0.4], [-0.3, 0.2], [0.0, 0.1]])
    ids = c.action_tokens(chunk)
    assert c.prefix_ids(chunk[:2]) == ids[:4] and c.prefix_ids(chunk[:1]) == ids[:2]
    assert c.prefix_ids([]) == [] and c.prefix_ids(np.zeros((0, 2))) == []  # k = 0: nothing forced


@pytest.mark.parametrize("rows", [np.zeros((3, 2)), np.zeros((1, 3)), np.zeros(2), [[0.0, np.nan]], [["a", "b"]],
                                  np.zeros((1, 2), dtype=bool)])
def test_bad_action_prefixes_raise_naming_it(rows: Any) -> None:
    with pytest.raises(PolicyInputError, match="action_prefix"):
        make().prefix_ids(rows)  # k = H (nothing left to decode), a wrong D, a vector, NaN, text, bools
