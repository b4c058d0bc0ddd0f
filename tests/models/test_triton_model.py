"""The whole tiny model through kernels="triton" (the interpreter on a CPU) equals kernels="torch"."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import random_ids

pytest.importorskip("triton")

from streamserve import Engine
from streamserve.errors import InvalidInputError


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("window", [None, 24])
def test_triton_greedy_equals_torch(arch, window, checkpoints, engines) -> None:
    path = checkpoints[arch][0]
    triton_engine = Engine.from_pretrained(path, device="cpu", kernels="triton", kv_memory="64MiB")
    assert triton_engine.model.ops.name == "triton"
    prompt = random_ids(40, seed=51)
    outs = []
    for engine in (engines[arch], triton_engine):
        with engine.open_session(window=window, sinks=4) as s:
            s.append(token_ids=prompt)
            outs.append(s.generate(max_tokens=12, stop_token_ids=()))
    assert outs[0] == outs[1]


def test_unknown_backend_is_typed(checkpoints) -> None:
    with pytest.raises(InvalidInputError, match="unknown kernel backend 'cuda'"):
        Engine.from_pretrained(checkpoints["llama"][0], device="cpu", kernels="cuda")
    assert Engine.from_pretrained(checkpoints["llama"][0], device="cpu").model.ops.name == "torch"  # auto on cpu


def test_one_attention_launch_serves_mixed_sessions(checkpoints, engines, monkeypatch) -> None:
    """kernels="triton": the decode steps of absolute, windowed and rolling sessions (several at once, pages of
    3 tokens) run their attention in one block-table launch a layer (kernels/batch_attention.py), and every
    session gets the tokens the torch engine gives it alone."""
    from streamserve.kernels import triton_backend as tb
    from streamserve.tools.batched import replies_together

    arch = "qwen3_moe"
    engine = Engine.from_pretrained(checkpoints[arch][0], device="cpu", kernels="triton", kv_memory="64MiB",
                                    page_size=3)
    launches: list[int] = []
    real = engine.model.ops.attention_blocks

    def counted(q, k_pool, v_pool, batch, *args, **kwargs):
        launches.append(batch.block_table.shape[0])
        return real(q, k_pool, v_pool, batch, *args, **kwargs)

    monkeypatch.setattr(engine.model, "ops", dataclasses.replace(engine.model.ops, attention_blocks=counted))
    assert real is tb.batch_attention
    kws = [{}, {"window": 12, "sinks": 4}, {"window": 12, "sinks": 2, "positions": "rolling"},
           {"window": 9, "sinks": 0, "positions": "rolling"}]
    prompts = [random_ids(17 + 5 * i, seed=90 + i) for i in range(len(kws))]
    alone = [greedy_alone(engines[arch], p, 10, kw) for p, kw in zip(prompts, kws, strict=True)]
    assert replies_together(engine, prompts, 10, kws) == alone
    layers = engine.config.num_layers
    assert launches and max(launches) == len(kws)  # the four sessions' decode steps: one launch a layer
    assert launches.count(len(kws)) % layers == 0
    engine.shutdown()


def greedy_alone(engine: Engine, prompt: list[int], n: int, kw: dict) -> list[int]:
    with engine.open_session(**kw) as s:
        s.append(token_ids=prompt)
        return s.generate(max_tokens=n, stop_token_ids=())
