"""The robot policy's training script end to end (a tiny, seconds-long run), and its crops of the token stream."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from streamserve import Engine
from streamserve.robot.codec import PolicyCodec
from streamserve.robot.dataset import Stream, crop, query_ends, training_crop
from streamserve.tools import train_policy


def test_help_explains_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        train_policy.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "behaviour cloning" in out and "--minutes" in out and "--out" in out and "--seed" in out


def test_a_tiny_training_writes_a_policy_the_engine_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "policy"
    train_policy.main(["--out", str(out), "--steps", "4", "--episodes", "6", "--queries", "12", "--hidden", "32",
                       "--layers", "1", "--heads", "2", "--batch", "4", "--horizon", "4", "--window", "48",
                       "--sinks", "4", "--eval-episodes", "1", "--seed", "3"])
    captured = capsys.readouterr()
    assert "step 1: loss" in captured.err and "closed loop through the engine" in captured.err  # progress output
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["success_rate"] is not None
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "policy.json",
                 "training.json"):
        assert (out / name).is_file(), name
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 4 and report["loss"] > 0 and report["data"]["episodes"] == 6
    assert report["eval"]["episodes"] == 1 and report["eval"]["expert_success_rate"] == 1.0
    codec = PolicyCodec.load(out)
    assert codec is not None and codec.action_horizon == 4 and codec.window == 48 and codec.sinks == 4
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    with Engine.from_pretrained(out, device="cpu") as engine:
        assert engine.config.vocab_size == config["vocab_size"]
        # the tokenizer holds every id the codec uses, under the names the script gave them
        assert engine.tokenizer.token_to_id("<obs>") == codec.obs_token
        assert engine.tokenizer.token_to_id("<s0>") == codec.state_token_offset
        assert engine.tokenizer.token_to_id(f"<a{codec.action_bins - 1}>") == codec.action_ids[-1]
        assert engine.tokenizer.encode("reach the target", add_special_tokens=False) == [6, 7, 8]
        with engine.open_session(window=codec.window, sinks=codec.sinks) as s:
            s.append(token_ids=codec.prompt_ids([6, 7, 8]) + codec.state_ids(np.zeros(6)))
            ids = s.generate(max_tokens=codec.n_action_tokens, temperature=0.0, stop_token_ids=())
            assert len(ids) == codec.n_action_tokens


def _stream(n_queries: int, obs_len: int = 3, n_act: int = 2, prompt: int = 3) -> Stream:
    """A synthetic stream: a prompt of `prompt` tokens, then queries of obs_len state + n_act action tokens; token
    values are their own positions, so a crop shows which positions it kept."""
    query, act = [-1] * prompt, [False] * prompt
    for _ in range(n_queries):
        start = len(query)
        query += [start] * (obs_len + n_act)
        act += [False] * obs_len + [True] * n_act
    return Stream(np.arange(len(query)), np.array(query), np.array(act))


def test_crops_are_the_rolling_window_the_engine_attends_to() -> None:
    st = _stream(10)  # 3 + 10 * 5 = 53 tokens
    ends = query_ends(st)
    assert ends.tolist() == [3 + 5 * (k + 1) for k in range(10)]
    ids, labels = crop(st, 18, sinks=4, window=8)  # the first 4 tokens, then positions 10..17
    assert ids.tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17]
    # loss only where the next token is an action whose observation is in the crop: the query at 13 (actions
    # 16, 17) is whole; the actions 11, 12 of the query at 8 lost their observation to the gap
    assert [i for i, y in zip(ids.tolist(), labels.tolist(), strict=True) if y != -100] == [15, 16]
    assert labels[ids.tolist().index(15)] == 16 and labels[ids.tolist().index(16)] == 17
    ids, labels = crop(st, 13, sinks=4, window=16)  # nothing dropped yet: the whole start of the stream
    assert ids.tolist() == list(range(13))
    assert [int(i) for i, y in zip(ids, labels, strict=True) if y != -100] == [5, 6, 10, 11]


def test_training_crops_swap_earlier_replies_and_score_only_the_last() -> None:
    streams = [_stream(10), _stream(10)]
    streams[1].ids = streams[1].ids + 1000  # the other stream's tokens are recognisable
    st, rng, changed = streams[0], np.random.default_rng(0), 0
    for _ in range(50):
        ids, labels = training_crop(streams, 0, 48, sinks=4, window=24, n_act=2, rng=rng)
        n = len(ids) - 4
        assert 5 <= n <= 24  # a history of random length up to the window, the last query whole
        positions = [0, 1, 2, 3, *range(48 - n, 48)]
        assert [int(y) for y in labels if y != -100] == [46, 47] and labels[-3] == 46 and labels[-2] == 47
        for p, v in zip(positions, ids.tolist(), strict=True):
            if not st.is_action[p] or p >= 46:  # observations, the prompt and the scored reply stay as they are
                assert v == p
            else:  # an earlier reply's token: the same step and dim of some reply, of either stream
                assert st.is_action[v % 1000] and (v % 1000 - p) % 5 == 0
                changed += v != p
    assert changed > 0


def test_prefix_crops_force_the_previous_chunk_moved_on_without_loss_on_it() -> None:
    st = _stream(10, n_act=4)  # H = 2 rows of D = 2; queries of 7 tokens from 3 on, replan 1 step
    end = int(query_ends(st)[-1])  # 73: the last query's obs at 66..68, its actions at 69..72
    rng = np.random.default_rng(0)
    ids, labels = training_crop([st], 0, end, sinks=4, window=24, n_act=4, rng=rng, dims=2, prefix_share=1.0)
    # the first row (1 <= k < H rows) is the previous chunk's (62..65) second row: moved on by one step
    assert ids[-4:].tolist() == [64, 65, 71, 72]
    assert [int(y) for y in labels if y != -100] == [71, 72]  # no loss on the forced row
    ids, labels = training_crop([st], 0, end, sinks=4, window=24, n_act=4, rng=rng, dims=2, prefix_share=0.0)
    assert ids[-4:].tolist() == [69, 70, 71, 72] and [int(y) for y in labels if y != -100] == [69, 70, 71, 72]


def test_noisy_prefixes_stay_action_ids_and_need_their_range() -> None:
    st = _stream(10, n_act=4)
    end, rng = int(query_ends(st)[-1]), np.random.default_rng(1)
    moved = 0
    for _ in range(20):
        ids, labels = training_crop([st], 0, end, sinks=4, window=24, n_act=4, rng=rng, dims=2, prefix_share=1.0,
                                    prefix_noise=3.0, action_id_range=(63, 66))
        assert all(63 <= v <= 66 for v in ids[-4:-2]) and [int(y) for y in labels if y != -100] == [71, 72]
        moved += ids[-4:-2].tolist() != [64, 65]
    assert moved > 0  # the noise moves the forced ids (within the action ids)
    with pytest.raises(ValueError, match="action_id_range"):
        training_crop([st], 0, end, sinks=4, window=24, n_act=4, rng=rng, dims=2, prefix_share=1.0, prefix_noise=1.0)
