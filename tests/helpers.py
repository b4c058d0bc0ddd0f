"""Test helpers: tiny random Hugging Face checkpoints built with transformers, saved to disk."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch

from streamserve.tools.random_checkpoint import make_random_checkpoint, write_byte_tokenizer

VOCAB = 300  # > the 257 ids of the byte-level test tokenizer

ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[1], intermediate_size=40),
    "qwen3": dict(head_dim=16, intermediate_size=72,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 128}),
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=40,
                    sliding_window=24),
    "olmoe": dict(num_experts=8, num_experts_per_tok=3, intermediate_size=24,
                  clip_qkv=4.0),
    "llama": dict(intermediate_size=72, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    # q/k/v biases without an o_proj bias; windows on the layers from max_window_layers on
    "qwen2": dict(intermediate_size=72, use_sliding_window=True, sliding_window=20, max_window_layers=1),
    # local, local, global, local: 16-token windows, their own RoPE base; a query scale that is not head_dim's
    "gemma3": dict(head_dim=16, intermediate_size=72, num_hidden_layers=4, sliding_window=16,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   query_pre_attn_scalar=24,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
}


def make_checkpoint(folder: Path, arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random tiny `arch` model of the test sizes, saved (float32) with a byte tokenizer; returns it."""
    return make_random_checkpoint(folder, arch, seed, **{**ARCH_CONFIGS[arch], **overrides})


def greedy(engine: Any, ids: list[int], max_tokens: int = 8, **session_kw: Any) -> list[int]:
    """The greedy reply of a fresh session (opened with `session_kw`) fed `ids`: the reference many tests
    compare a chunked, rewound, restored or parked session against."""
    with engine.open_session(**session_kw) as s:
        s.append(token_ids=ids)
        return s.generate(max_tokens=max_tokens, stop_token_ids=())


def vectors(engine: Any, ids: list[int]) -> torch.Tensor:
    """[T, hidden]: the model's own embeddings of ids (what an append of ids feeds the first layer), to append
    as an embedding chunk that must give exactly what the ids give."""
    with torch.no_grad():
        return engine.model.embed_tokens(torch.tensor(ids)).clone()


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= 1e-6


def random_ids(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


__all__ = ["ARCH_CONFIGS", "VOCAB", "assert_same", "greedy", "make_checkpoint", "random_ids", "vectors",
           "write_byte_tokenizer"]


async def json_of_subprocess(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                             timeout: float = 300) -> dict[str, Any]:
    """Run a command; -> the JSON object on the last line of its stdout. It must exit 0 within `timeout` seconds
    (it is killed otherwise); its stderr's tail is the failure message."""
    proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, stderr.decode()[-3000:]
    return json.loads(stdout.decode().strip().splitlines()[-1])
