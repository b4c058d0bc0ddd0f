"""Parity with transformers on tiny random checkpoints of every supported architecture."""

from __future__ import annotations

import pytest
import torch
from helpers import ARCH_CONFIGS, random_ids
from transformers import GenerationConfig


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_prefill_logits_match_transformers(arch: str, checkpoints, engines) -> None:
    _, hf = checkpoints[arch]
    engine = engines[arch]
    ids = random_ids(45, seed=1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with engine.open_session() as s:
        ours = engine.forward(s.kv, ids, all_logits=True)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_greedy_tokens_match_transformers(arch: str, checkpoints, engines) -> None:
    _, hf = checkpoints[arch]
    prompt = random_ids(29, seed=2)
    gen_cfg = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), generation_config=gen_cfg)[0, len(prompt):].tolist()
    with engines[arch].open_session() as s:
        s.append(token_ids=prompt)
        ours = s.generate(max_tokens=32, stop_token_ids=())
    assert len(ref) == 32
    assert ours == ref


@pytest.mark.parametrize(("arch", "kw", "windows"), [
    ("qwen3", {"max_window_layers": 1}, (None, 16, 16)),  # Qwen3: layers from max_window_layers on
    ("qwen3_moe", {}, (16, 16, 16)),  # Qwen3-MoE: every layer
    ("qwen2", {"max_window_layers": 2}, (None, None, 16)),  # Qwen2: as Qwen3
    ("qwen2", {"use_sliding_window": False}, (None, None, None)),  # a window that is switched off binds nowhere
])
def test_qwen_sliding_window_layers_match_transformers(tmp_path, arch, kw, windows) -> None:
    from helpers import make_checkpoint

    from streamserve import Engine

    hf = make_checkpoint(tmp_path, arch, **{"use_sliding_window": True, "sliding_window": 16, **kw})
    engine = Engine.from_pretrained(tmp_path, device="cpu")
    assert engine.config.sliding_windows == windows
    ids = random_ids(50, seed=6)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with engine.open_session() as s:
        ours = engine.forward(s.kv, ids, all_logits=True)
    assert (ours - ref).abs().max().item() <= 1e-4
