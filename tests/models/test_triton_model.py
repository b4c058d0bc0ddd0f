"""The whole tiny model through kernels="triton" (the interpreter on a CPU) equals kernels="torch"."""

from __future__ import annotations

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
