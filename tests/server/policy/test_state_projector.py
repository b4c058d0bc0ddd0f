"""A "projector" policy: the state enters the session as ONE embedding vector (state_projector.safetensors applied to
the state scaled into [-1, 1]) between the <obs> and <act> tokens. Load-time checks of the file (typed errors), the
projection itself, and EnginePolicy's ticks on a tiny random Llama checkpoint through the real engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from policy_fixture import POLICY, policy_checkpoint_at, projector_checkpoint
from safetensors.numpy import save_file

from streamserve import Engine
from streamserve.robot.codec import PolicyCodec, PolicyConfigError
from streamserve.robot.projector import STATE_PROJECTOR_FILE, StateProjector, save_state_projector
from streamserve.robot.rollout import EnginePolicy

H, D = POLICY["action_horizon"], POLICY["action_dims"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return projector_checkpoint(tmp_path_factory.mktemp("proj") / "tiny-projector")


def hidden_of(folder: Path) -> int:
    return int(json.loads((folder / "config.json").read_text())["hidden_size"])


def test_the_projection_scales_the_state_into_the_unit_range_then_maps_it(checkpoint: Path) -> None:
    codec = PolicyCodec.load(checkpoint)
    assert codec is not None and codec.state_encoding == "projector"
    assert codec.metadata()["state_encoding"] == "projector"
    proj = StateProjector.load(checkpoint, codec)
    low, high = np.array(POLICY["state_low"]), np.array(POLICY["state_high"])
    state = np.array([0.5, -2.0, 1.0])  # -2.0 is below its low (-1): clipped to -1
    x = 2 * (np.clip(state, low, high) - low) / (high - low) - 1  # [0.5, -1, 0.5]
    np.testing.assert_allclose(x, [0.5, -1.0, 0.5])
    out = proj.embed(state)
    assert out.shape == (1, hidden_of(checkpoint)) and out.dtype == np.float32
    np.testing.assert_allclose(out[0], proj.weight @ x + proj.bias, rtol=1e-5, atol=1e-6)
    parts = codec.state_parts(state, proj)
    assert parts[0] == [codec.obs_token] and parts[2] == [codec.act_token]
    np.testing.assert_array_equal(parts[1], out)
    with pytest.raises(PolicyConfigError):  # a projector policy with no projector given
        codec.state_parts(state)
    bins = PolicyCodec.from_dict(POLICY)  # the default encoding: the bins, exactly as before
    assert bins.state_encoding == "bins" and bins.state_parts(state) == [bins.state_ids(state)]


def broken(tmp: Path, name: str) -> Path:
    return policy_checkpoint_at(tmp / name, state_encoding="projector")


@pytest.mark.parametrize("case", ["missing", "names", "weight_dims", "bias", "hidden", "nan", "damaged", "ints"])
def test_a_bad_projector_file_is_a_typed_error_at_load(tmp_path: Path, case: str) -> None:
    folder = broken(tmp_path, case)
    hidden = hidden_of(folder)
    w, b = np.zeros((hidden, 3), np.float32), np.zeros(hidden, np.float32)
    path = folder / STATE_PROJECTOR_FILE
    if case == "names":
        save_file({"projection": w}, str(path))
    elif case == "weight_dims":
        save_state_projector(folder, np.zeros((hidden, 4)), b)  # the state has 3 dims
    elif case == "bias":
        save_state_projector(folder, w, np.zeros(hidden + 1))
    elif case == "hidden":
        save_state_projector(folder, np.zeros((hidden + 2, 3)), np.zeros(hidden + 2))
    elif case == "nan":
        save_state_projector(folder, np.full((hidden, 3), np.nan), b)
    elif case == "damaged":
        path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    elif case == "ints":
        save_file({"weight": np.zeros((hidden, 3), np.int32), "bias": np.zeros(hidden, np.int32)}, str(path))
    with pytest.raises(PolicyConfigError) as info:
        PolicyCodec.load(folder)
    assert info.value.code == "invalid_policy_config"
    assert STATE_PROJECTOR_FILE in str(info.value)


def test_an_unknown_state_encoding_is_refused() -> None:
    with pytest.raises(PolicyConfigError, match="state_encoding"):
        PolicyCodec.from_dict({**POLICY, "state_encoding": "fourier"})


def test_engine_policy_appends_obs_one_vector_act_and_decodes_action_tokens(checkpoint: Path) -> None:
    with Engine.from_pretrained(checkpoint, device="cpu", kv_memory="64MiB") as engine:
        codec = PolicyCodec.load(checkpoint)
        assert codec is not None
        proj = StateProjector.load(checkpoint, codec)
        policy = EnginePolicy(engine)
        policy.record = True
        states = [np.array([np.sin(i), np.cos(i), 0.4 * i - 1.5]) for i in range(5)]
        chunks = [policy({POLICY["state_key"]: st}) for st in states]
        s = policy.session
        assert s is not None
        prompt = codec.prompt_ids(engine.tokenizer.encode(codec.default_prompt, add_special_tokens=False))
        tick = 3 + H * D  # <obs>, one vector, <act>, then the reply
        assert policy.growth == [tick] * len(states) and len(s) == len(prompt) + len(states) * tick
        for i, (st, chunk, ids) in enumerate(zip(states, chunks, policy.replies, strict=True)):
            at = len(prompt) + i * tick
            assert s.token_ids[at] == codec.obs_token and s.token_ids[at + 2] == codec.act_token
            assert s.token_ids[at + 1] == engine.placeholder_id  # the vector's position
            vec = s.core.vectors[at + 1]
            torch.testing.assert_close(vec, torch.from_numpy(proj.embed(st)[0]).to(vec.dtype))
            assert s.token_ids[at + 3:at + tick] == ids and set(ids) <= set(codec.action_ids)
            np.testing.assert_array_equal(chunk, codec.actions(ids))
        policy.reset()
        engine.check_integrity()
        assert engine.pool.allocator.used_count == 0


def test_engine_policy_refuses_a_policy_that_reads_images(tmp_path: Path) -> None:
    folder = policy_checkpoint_at(tmp_path / "cam", image_keys=["observation/image"])
    with Engine.from_pretrained(folder, device="cpu", kv_memory="64MiB") as engine, \
            pytest.raises(PolicyConfigError, match="vision path"):
        EnginePolicy(engine)
