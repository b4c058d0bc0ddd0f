"""Shared fixtures: tiny random Hugging Face checkpoints built with transformers, saved to disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

VOCAB = 300  # > the 257 ids of the byte-level test tokenizer

ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(cls="Qwen3MoeConfig", head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1], intermediate_size=40),
    "qwen3": dict(cls="Qwen3Config", head_dim=16, intermediate_size=72,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 128}),
    "mixtral": dict(cls="MixtralConfig", num_local_experts=6, num_experts_per_tok=2, intermediate_size=40,
                    sliding_window=24),
    "olmoe": dict(cls="OlmoeConfig", num_experts=8, num_experts_per_tok=3, intermediate_size=24,
                  clip_qkv=4.0),
    "llama": dict(cls="LlamaConfig", intermediate_size=72, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
}


def write_test_tokenizer(folder: Path) -> None:
    """A byte-level BPE with just the 256 byte tokens and one special EOS token (id 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')


def make_checkpoint(folder: Path, arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Build a random tiny `arch` model with transformers, save it (float32) with a tokenizer; return it."""
    import transformers

    spec = dict(ARCH_CONFIGS[arch])
    cls = getattr(transformers, spec.pop("cls"))
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.08,
                  eos_token_id=256, bos_token_id=256, pad_token_id=0)
    kwargs.update(spec)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kwargs), dtype=torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_test_tokenizer(folder)
    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: (root / arch, make_checkpoint(root / arch, arch)) for arch in ARCH_CONFIGS}
