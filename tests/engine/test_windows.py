"""Windowed sessions: absolute positions against transformers with a [sinks | window] mask, rolling
positions (StreamingLLM), pages handed back as the window slides, memory bounded on a long stream."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy, random_ids

from streamserve.kernels.reference import visible


def chunked_logits(session, ids: list[int], chunk: int) -> list[torch.Tensor]:
    out = []
    for i in range(0, len(ids), chunk):
        session.append(token_ids=ids[i:i + chunk])
        out.append(session.core.logits)
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama", "olmoe"])
def test_absolute_window_equals_transformers_with_a_sink_window_mask(arch, checkpoints, engines) -> None:
    _, hf = checkpoints[arch]
    engine = engines[arch]
    ids = random_ids(70, seed=21)
    pos = torch.arange(70)
    mask = torch.zeros(1, 1, 70, 70).masked_fill(~visible(pos, pos, None, 4, 16), float("-inf"))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), attention_mask=mask).logits[0]
    with engine.open_session(window=16, sinks=4, positions="absolute") as s:
        for i, logits in zip(range(0, 70, 9), chunked_logits(s, ids, 9), strict=True):
            last = min(i + 9, 70) - 1
            assert (logits - ref[last]).abs().max().item() <= 1e-4, last
        assert len(s.kv.page_table) <= 1 + (16 + 9) // 16 + 2  # sink page + the window's pages
        engine.check_integrity()


def test_within_the_window_both_modes_equal_the_plain_model(engines) -> None:
    engine = engines["qwen3"]
    ids = random_ids(30, seed=22)
    expected = greedy(engine, ids, 10)
    for mode in ("absolute", "rolling"):
        assert greedy(engine, ids, 10, window=60, sinks=4, positions=mode) == expected, mode


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_rolling_chunking_does_not_change_the_stream(arch, engines) -> None:
    """Past the window, rolling positions give the same result whatever the chunking."""
    engine = engines[arch]
    ids = random_ids(90, seed=23)
    with engine.open_session(window=20, sinks=3) as one:
        one.append(token_ids=ids[:40])
        for i in range(40, 90):
            one.append(token_ids=[ids[i]])
        expected = one.generate(max_tokens=8, stop_token_ids=())
    with engine.open_session(window=20, sinks=3) as many:
        chunked_logits(many, ids, 13)
        assert many.generate(max_tokens=8, stop_token_ids=()) == expected


def test_a_long_rolling_stream_holds_constant_pages(engines) -> None:
    engine = engines["llama"]  # its context is 512 tokens: the stream goes far past it
    with engine.open_session(window=32, sinks=4) as s:
        held = []
        for i in range(0, 1200, 24):
            s.append(token_ids=random_ids(24, seed=i))
            held.append(len(s.kv.page_table))
        assert max(held[5:]) <= 1 + 32 // 16 + 2 and len(s.token_ids) == 1200
        assert int(s.kv.k_pos.max()) == 1199  # absolute bookkeeping, bounded rotations
        assert len(s.generate(max_tokens=5, stop_token_ids=())) == 5
        engine.check_integrity()


def test_absolute_window_still_stops_at_the_context(tmp_path) -> None:
    from helpers import make_checkpoint

    from streamserve import Engine
    from streamserve.errors import ContextLengthError

    make_checkpoint(tmp_path, "qwen3", max_position_embeddings=40)
    engine = Engine.from_pretrained(tmp_path, device="cpu")
    with engine.open_session(window=16, sinks=2, positions="absolute") as s:
        s.append(token_ids=list(range(40)))
        with pytest.raises(ContextLengthError, match="window"):
            s.append(token_ids=[1])
    with engine.open_session(window=16, sinks=2) as s:  # rolling: no limit
        for _ in range(5):
            s.append(token_ids=list(range(40)))
        assert len(s.token_ids) == 200


def test_rolling_sessions_count_the_model_sliding_window_inside_the_cache(checkpoints, tmp_path) -> None:
    """Mixtral's 24-token window never binds when the session's cache holds at most 4 + 16 tokens."""
    import json
    import shutil

    from streamserve import Engine

    src = checkpoints["mixtral"][0]
    shutil.copytree(src, tmp_path / "nowin")
    cfg = json.loads((tmp_path / "nowin" / "config.json").read_text())
    cfg["sliding_window"] = None
    (tmp_path / "nowin" / "config.json").write_text(json.dumps(cfg))
    ids = random_ids(60, seed=24)
    outs = []
    for path in (src, tmp_path / "nowin"):
        engine = Engine.from_pretrained(path, device="cpu", kv_memory="32MiB")
        with engine.open_session(window=16, sinks=4) as s:
            outs.append(torch.stack(chunked_logits(s, ids, 5)))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-4
