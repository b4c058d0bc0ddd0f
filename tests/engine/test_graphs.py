"""CUDA-graph decode's fixed-shape steps (run eagerly on a CPU) change no result: 1 and 3 tokens, batches 2 to 8."""

from __future__ import annotations

import pytest
from helpers import greedy, random_ids

from streamserve import Engine
from streamserve.engine.graphs import MAX_GRAPH_POLICIES, MAX_GRAPHS, bucket_for, policy_key
from streamserve.sessions import WindowPolicy
from streamserve.tools.batched import replies_together


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("kw", [{}, {"window": 24, "sinks": 4}, {"window": 24, "sinks": 4, "positions": "absolute"}])
def test_fixed_shape_decode_equals_plain_decode(checkpoints, engines, kernels, kw) -> None:
    if kernels == "triton":
        pytest.importorskip("triton")
    path = checkpoints["qwen3_moe"][0]
    graphed = Engine.from_pretrained(path, device="cpu", kernels=kernels, cuda_graphs="on", kv_memory="32MiB")
    assert graphed.graphs is not None and not graphed.graphs.capture
    prompt = random_ids(50, seed=61)
    outs = []
    for engine in (engines["qwen3_moe"], graphed):
        with engine.open_session(**kw) as s:
            s.append(token_ids=prompt)
            out = s.generate(max_tokens=30, stop_token_ids=())
            s.append(token_ids=[3, 4, 5])  # a 3-token step: a verification width
            outs.append(out + s.generate(max_tokens=5, stop_token_ids=()))
    assert outs[0] == outs[1]
    # the steps went through the fixed-shape path, at widths 1 and 4; 50..90 keys (or a 28-key window)
    # fall in at most two buckets: the shapes stay fixed
    widths = {key[1] for key in graphed.graphs.entry_keys()}
    assert widths == {(1,), (4,)} and len(graphed.graphs.entry_keys()) <= 4  # 4: the pending reply token + 3
    graphed.check_integrity()


def test_buckets_and_the_switch(checkpoints) -> None:
    assert [bucket_for(n) for n in (1, 64, 65, 1000, 1024, 1025)] == [64, 64, 128, 1024, 1024, 2048]
    engine = Engine.from_pretrained(checkpoints["llama"][0], device="cpu")
    assert engine.graphs is None  # auto: off without CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"window": 256, "sinks": 4}])
def test_captured_graphs_replay_the_same_tokens_on_cuda(checkpoints, kw) -> None:
    """On a GPU: steps replayed from captured graphs give the eager Triton path's greedy tokens."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    path = checkpoints["qwen3_moe"][0]
    outs = []
    for graphs in ("on", "off"):
        engine = Engine.from_pretrained(path, device="cuda", kernels="triton", cuda_graphs=graphs, kv_memory="256MiB")
        with engine.open_session(**kw) as s:
            s.append(token_ids=random_ids(300, seed=62))
            out = s.generate(max_tokens=40, stop_token_ids=())
            s.append(token_ids=[7, 8])
            outs.append(out + s.generate(max_tokens=8, stop_token_ids=()))
        if graphs == "on":
            assert engine.graphs is not None and engine.graphs.captured >= 2
    assert outs[0] == outs[1]


@pytest.mark.parametrize("batch", [2, 3, 8])
def test_batched_fixed_shape_decode_equals_sessions_alone(checkpoints, engines, batch: int) -> None:
    """Batch decode through the graph path's static buffers (eager on a CPU): one entry per batch shape,
    sessions of different lengths and window policies in one step, the tokens each session gets alone."""
    path = checkpoints["qwen3_moe"][0]
    graphed = Engine.from_pretrained(path, device="cpu", cuda_graphs="on", kv_memory="32MiB")
    kw_cycle = [{}, {"window": 24, "sinks": 4}, {"window": 24, "sinks": 4, "positions": "absolute"}]
    kws = [kw_cycle[i % 3] for i in range(batch)]
    prompts = [random_ids(20 + 7 * i, seed=70 + i) for i in range(batch)]
    alone = [greedy(engines["qwen3_moe"], p, 12, **kw) for p, kw in zip(prompts, kws, strict=True)]
    assert replies_together(graphed, prompts, 12, kws) == alone
    shapes = {key[1] for key in graphed.graphs.entry_keys()}
    assert (1,) * batch in shapes  # the batched decode steps went through the fixed-shape path
    assert graphed.stats()["kv_pages_used"] == 0
    graphed.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [2, 4, 8])
def test_captured_batched_graphs_replay_the_same_tokens_on_cuda(checkpoints, batch: int) -> None:
    """On a GPU: batched decode steps replayed from captured graphs give the eager Triton path's tokens."""
    pytest.importorskip("triton")
    path = checkpoints["qwen3_moe"][0]
    prompts = [random_ids(100 + 37 * i, seed=80 + i) for i in range(batch)]
    kws = [{} if i % 2 else {"window": 64, "sinks": 4} for i in range(batch)]
    outs = []
    for graphs in ("on", "off"):
        engine = Engine.from_pretrained(path, device="cuda", kernels="triton", cuda_graphs=graphs, kv_memory="256MiB")
        outs.append(replies_together(engine, prompts, 24, kws))
        if graphs == "on":
            assert engine.graphs is not None and engine.graphs.captured >= 1
        engine.shutdown()
    assert outs[0] == outs[1]


def test_a_flood_of_distinct_windows_cannot_grow_the_graph_cache(checkpoints, engines) -> None:
    """Clients choose windows: graphs serve at most MAX_GRAPH_POLICIES policies at a time, the rest run eagerly
    (same tokens), so cycling windows neither grows the cache nor builds (captures) an entry per step."""
    path = checkpoints["qwen3_moe"][0]
    graphed = Engine.from_pretrained(path, device="cpu", cuda_graphs="on", kv_memory="32MiB")
    prompt = random_ids(12, seed=90)
    for i in range(3 * MAX_GRAPH_POLICIES):
        kw = {"window": 20 + i, "sinks": 4}
        with graphed.open_session(**kw) as s:
            s.append(token_ids=prompt)
            out = s.generate(max_tokens=4, stop_token_ids=())
        if i % 4 == 0 or i == 3 * MAX_GRAPH_POLICIES - 1:
            assert out == greedy(engines["qwen3_moe"], prompt, 4, **kw)
    g = graphed.graphs
    assert len(g.entry_keys()) <= MAX_GRAPHS and len({p for k in g.entry_keys() for p in k[3]}) <= MAX_GRAPH_POLICIES
    assert g.created <= MAX_GRAPH_POLICIES  # one decode shape per admitted policy, built once
    # sinks without a window change no captured computation: such sessions share entries
    assert policy_key(WindowPolicy(sinks=0)) == policy_key(WindowPolicy(sinks=4))
    assert policy_key(WindowPolicy(window=20, sinks=0)) != policy_key(WindowPolicy(window=20, sinks=4))
    graphed.check_integrity()
    graphed.shutdown()


def test_embedding_steps_never_take_the_graph_path(checkpoints, engines) -> None:
    import torch

    path = checkpoints["qwen3_moe"][0]
    graphed = Engine.from_pretrained(path, device="cpu", cuda_graphs="on", kv_memory="32MiB")
    ids = random_ids(10, seed=91)
    with torch.no_grad():
        vec = graphed.model.embed_tokens(torch.tensor(ids[4:])).clone()
    with graphed.open_session() as s:
        s.append(token_ids=ids[:4])
        s.append(embeds=vec, kind="audio")  # 6 vectors: a graph width, run eagerly
        assert not any(k[1] == (6,) for k in graphed.graphs.entry_keys())
        s.rewind(to=8)  # the reply re-runs position 7, a vector: eagerly too
        out = s.generate(max_tokens=5, stop_token_ids=())
    assert out == greedy(engines["qwen3_moe"], ids[:8], 5)
    graphed.shutdown()


def test_policies_of_sessions_long_gone_give_their_places_up(checkpoints, engines, monkeypatch) -> None:
    """Steps refused for their policy age the admitted ones too: once the sessions that filled the places are
    gone, a new policy gets graphs after POLICY_IDLE_RUNS steps (it was refused for ever when only graph
    runs counted, and none ran)."""
    from streamserve.engine import graphs as graphs_module

    monkeypatch.setattr(graphs_module, "POLICY_IDLE_RUNS", 5)
    path = checkpoints["qwen3_moe"][0]
    graphed = Engine.from_pretrained(path, device="cpu", cuda_graphs="on", kv_memory="32MiB")
    prompt = random_ids(12, seed=92)
    for i in range(MAX_GRAPH_POLICIES):  # fill every place, then leave
        with graphed.open_session(window=30 + i, sinks=4) as s:
            s.append(token_ids=prompt)
            s.generate(max_tokens=2, stop_token_ids=())
    kw = {"window": 50, "sinks": 4}
    with graphed.open_session(**kw) as s:
        s.append(token_ids=prompt)
        out = s.generate(max_tokens=12, stop_token_ids=())
    assert out == greedy(engines["qwen3_moe"], prompt, 12, **kw)
    served = {p for k in graphed.graphs.entry_keys() for p in k[3]}
    assert policy_key(WindowPolicy(**kw)) in served and len(served) <= MAX_GRAPH_POLICIES
    graphed.shutdown()
