"""CUDA-graph decode's padded fixed-shape steps (run eagerly on a CPU) change no result: 1 and 3 tokens, batches of
3 to 33 sessions padded to the batch ladder, padding that never changes a real session's KV, a bounded cache, the
start-up warm-up's bucket set, and a max_batch below 8."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy, random_ids

from streamserve import Engine
from streamserve.config import SchedulerConfig
from streamserve.engine import graphs as graphs_module
from streamserve.engine.graphs import (
    MAX_GRAPH_POLICIES,
    MAX_GRAPHS,
    MIN_BUCKET,
    DecodeGraphs,
    Part,
    batch_bucket,
    batch_buckets,
    bucket_for,
    policy_key,
)
from streamserve.sessions import WindowPolicy
from streamserve.tools.batched import replies_together

KW_CYCLE = [{}, {"window": 24, "sinks": 4}, {"window": 24, "sinks": 4, "positions": "absolute"}]


def graphed_engine(checkpoints: dict, arch: str = "qwen3_moe", **kw: object) -> Engine:
    engine = Engine.from_pretrained(checkpoints[arch][0], device="cpu", cuda_graphs="on", kv_memory="32MiB", **kw)
    assert engine.graphs is not None and not engine.graphs.capture
    return engine


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("kw", KW_CYCLE)
def test_fixed_shape_decode_equals_plain_decode(checkpoints, engines, kernels, kw) -> None:
    if kernels == "triton":
        pytest.importorskip("triton")
    graphed = graphed_engine(checkpoints, kernels=kernels)
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
    keys = graphed.graphs.entry_keys()
    assert {key[0] for key in keys} == {1, 4} and len(keys) <= 4  # 4: the pending reply token + 3
    assert all(len(key[2]) == 1 and key[2][0].batch == 1 for key in keys)
    graphed.check_integrity()


def test_buckets_and_the_switch(checkpoints) -> None:
    assert [bucket_for(n) for n in (1, 64, 65, 1000, 1024, 1025)] == [64, 64, 128, 1024, 1024, 2048]
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert batch_buckets(2) == (1, 2) and batch_buckets(5) == (1, 2, 4, 5) and batch_buckets(1) == (1,)
    assert [batch_bucket(n, batch_buckets(48)) for n in (1, 3, 8, 9, 33, 48)] == [1, 4, 8, 16, 48, 48]
    engine = Engine.from_pretrained(checkpoints["llama"][0], device="cpu")
    assert engine.graphs is None  # auto: off without CUDA


@pytest.mark.parametrize("batch,mixed", [(3, True), (9, True), (17, False), (33, True), (33, False)])
def test_batched_fixed_shape_decode_equals_sessions_alone(checkpoints, engines, batch: int, mixed: bool) -> None:
    """Batch decode through the graph path's padded static buffers (eager on a CPU): sessions of different
    lengths (and window policies) padded to the batch ladder give the tokens each session gets alone."""
    graphed = graphed_engine(checkpoints)
    kws = [KW_CYCLE[i % 3] if mixed else {} for i in range(batch)]
    prompts = [random_ids(20 + 7 * i, seed=70 + i) for i in range(batch)]
    alone = [greedy(engines["qwen3_moe"], p, 12, **kw) for p, kw in zip(prompts, kws, strict=True)]
    assert replies_together(graphed, prompts, 12, kws) == alone
    ladder = graphed.graphs.ladder
    keys = graphed.graphs.entry_keys()
    assert all(p.batch in ladder for k in keys for p in k[2])
    parts = [p for k in keys if k[0] == 1 for p in k[2]]
    per_policy = -(-batch // 3) if mixed else batch  # sessions of the most common policy
    assert any(p.batch == batch_bucket(per_policy, ladder) for p in parts)  # the whole batch ran in one padded step
    assert graphed.stats()["kv_pages_used"] == 0
    graphed.check_integrity()
    graphed.shutdown()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3"])
def test_padding_never_changes_a_real_sessions_kv(checkpoints, arch: str) -> None:
    """A padded step (3 + 3 sessions of two policies in two 4-slot parts, widths 1 to 3 padded to 3) writes only
    the real sessions' slots of the step, with what the same step writes unpadded and eagerly; its logits match.
    The first session holds page 0, whose slot 0 is where padding keys point."""
    engine = graphed_engine(checkpoints, arch)
    g, pool = engine.graphs, engine.pool
    sessions = [engine.open_session(**({} if i < 3 else {"window": 24, "sinks": 4})) for i in range(6)]
    for i, s in enumerate(sessions):
        s.append(token_ids=random_ids(10 + 9 * i, seed=100 + i))
        s.generate(max_tokens=2, stop_token_ids=())
    assert any(0 in s.core.kv.held_pages for s in sessions)
    ids = [[5], [6, 7, 8], [9, 10], [11], [12, 13, 14], [15]]
    flags = [False, True, False, False, True, False]
    kvs = [s.core.kv for s in sessions]
    with engine.guard:
        for kv, step in zip(kvs, ids, strict=True):
            kv.begin(len(step))
        before = [(k.clone(), v.clone()) for k, v in zip(pool.k, pool.v, strict=True)]
        logits = g.run(kvs, ids, flags)
        after = [(k.clone(), v.clone()) for k, v in zip(pool.k, pool.v, strict=True)]
        for layer, (k, v) in enumerate(before):  # the eager, unpadded step from the same state
            pool.k[layer].copy_(k)
            pool.v[layer].copy_(v)
        flat = torch.tensor([t for step in ids for t in step])
        eager = engine.model.forward_batch(flat, kvs, graphs_module.rows_of([len(s) for s in ids], flags))
        for kv in kvs:
            kv.abort()
    assert logits is not None and torch.allclose(logits, eager, atol=1e-4)
    key = g.entry_keys()[-1]
    assert key[0] == 3 and key[1] and [p.batch for p in key[2]] == [4, 4]
    for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, after, strict=True)):
        flat_k0, flat_v0, flat_k1, flat_v1 = (t.flatten(0, 1) for t in (k0, v0, k1, v1))  # [slots, KVH, hd]
        changed = ((flat_k0 != flat_k1) | (flat_v0 != flat_v1)).flatten(1).any(-1).nonzero().flatten()
        mine = {int(s) for kv in kvs for s in kv.groups[pool.layer_group[layer]].write}
        assert set(changed.tolist()) <= mine, f"layer {layer}: padding wrote outside the step's slots"
        assert (flat_k0 == flat_k1)[0].all() or 0 in mine  # slot 0 (padding reads point there) only if written
        eager_k, eager_v = pool.k[layer].flatten(0, 1), pool.v[layer].flatten(0, 1)
        assert torch.allclose(flat_k1[changed], eager_k[changed], atol=1e-5)
        assert torch.allclose(flat_v1[changed], eager_v[changed], atol=1e-5)
    for s in sessions:
        s.close()
    engine.check_integrity()
    engine.shutdown()


def test_a_flood_of_batch_sizes_cannot_grow_the_graph_cache(checkpoints, monkeypatch) -> None:
    """Steps of every batch size from 1 to 20 make one entry per batch bucket (6), not per size; with a smaller
    MAX_GRAPHS the least recently used entries go and the cache stays at its bound."""
    engine = graphed_engine(checkpoints)
    sessions = [engine.open_session() for _ in range(20)]
    for i, s in enumerate(sessions):
        s.append(token_ids=random_ids(9 + i, seed=200 + i))  # > 8 tokens: appended eagerly
    g = engine.graphs

    def step(g: DecodeGraphs, n: int) -> None:
        kvs = [s.core.kv for s in sessions[:n]]
        with engine.guard:
            for kv in kvs:
                kv.begin(1)
            assert g.run(kvs, [[1]] * n, [False] * n) is not None
            for kv in kvs:
                kv.abort()

    for n in range(1, 21):
        step(g, n)
    assert g.created == 6 and sorted(k[2][0].batch for k in g.entry_keys()) == [1, 2, 4, 8, 16, 32]
    monkeypatch.setattr(graphs_module, "MAX_GRAPHS", 3)
    g = engine.graphs = DecodeGraphs(engine.model, capture=False)
    for n in (20, 1, 3, 20, 5, 2, 9):
        step(g, n)
        assert len(g.entry_keys()) <= 3
    assert [k[2][0].batch for k in g.entry_keys()] == [8, 2, 16]  # least recently used first
    for s in sessions:
        s.close()
    engine.check_integrity()
    engine.shutdown()


def test_warm_up_builds_every_batch_bucket(checkpoints) -> None:
    """At start-up on CUDA `warm_up` captures width-1 decode graphs of the default policy for each batch bucket;
    on a CPU it builds the same entries without running them, and a short decode step of 5 sessions reuses the
    8-slot one."""
    engine = graphed_engine(checkpoints)
    g = DecodeGraphs(engine.model, capture=False, max_batch=48)
    engine.graphs = g
    keys = g.warm_up(engine.pool)
    pk = policy_key(WindowPolicy())
    assert keys == [(1, False, (Part(pk, b, (MIN_BUCKET,)),)) for b in (1, 2, 4, 8, 16, 32, 48)]
    assert g.created == 7 and g.captured == 0 and g.entry_keys() == keys
    prompts = [random_ids(10 + i, seed=300 + i) for i in range(5)]
    replies_together(engine, prompts, 3)
    assert g.created == 7 and g.entry_keys()[-1] == keys[3]  # no new entry: the warm-up's 8-slot one ran
    g2 = DecodeGraphs(engine.model, capture=False, max_batch=5)
    assert [k[2][0].batch for k in g2.warm_up(engine.pool)] == [1, 2, 4, 5]
    engine.shutdown()


def test_a_max_batch_below_8_still_works(checkpoints, engines) -> None:
    graphed = graphed_engine(checkpoints, scheduler=SchedulerConfig(max_batch=3))
    g = graphed.graphs
    assert g.max_batch == 3 and g.ladder == (1, 2, 3)
    prompts = [random_ids(15 + 4 * i, seed=400 + i) for i in range(5)]
    alone = [greedy(engines["qwen3_moe"], p, 8) for p in prompts]
    assert replies_together(graphed, prompts, 8) == alone
    assert all(p.batch <= 3 for k in g.entry_keys() for p in k[2])
    assert any(p.batch == 3 for k in g.entry_keys() for p in k[2])
    sessions = [graphed.open_session() for _ in range(4)]
    for s in sessions:
        s.append(token_ids=[1, 2, 3])
    kvs = [s.core.kv for s in sessions]
    with graphed.guard:
        for kv in kvs:
            kv.begin(1)
        assert g.run(kvs, [[4]] * 4, [False] * 4) is None  # more than max_batch: eagerly
        for kv in kvs:
            kv.abort()
    graphed.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"window": 256, "sinks": 4}])
def test_captured_graphs_replay_the_same_tokens_on_cuda(checkpoints, kw) -> None:
    """On a GPU: steps replayed from captured graphs give the eager Triton path's greedy tokens; the start-up
    warm-up captured every batch bucket."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    path = checkpoints["qwen3_moe"][0]
    outs = []
    for graphs in ("on", "off"):
        engine = Engine.from_pretrained(path, device="cuda", kernels="triton", cuda_graphs=graphs, kv_memory="256MiB")
        if graphs == "on":
            assert engine.graphs is not None and engine.graphs.captured == len(batch_buckets(64))
        with engine.open_session(**kw) as s:
            s.append(token_ids=random_ids(300, seed=62))
            out = s.generate(max_tokens=40, stop_token_ids=())
            s.append(token_ids=[7, 8])
            outs.append(out + s.generate(max_tokens=8, stop_token_ids=()))
        if graphs == "on":
            assert engine.graphs.captured >= 2 + len(batch_buckets(64))
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [2, 4, 9, 33])
def test_captured_batched_graphs_replay_the_same_tokens_on_cuda(checkpoints, batch: int) -> None:
    """On a GPU: batched decode steps replayed from padded captured graphs give the eager Triton path's tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
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
    graphed = graphed_engine(checkpoints)
    prompt = random_ids(12, seed=90)
    for i in range(3 * MAX_GRAPH_POLICIES):
        kw = {"window": 20 + i, "sinks": 4}
        with graphed.open_session(**kw) as s:
            s.append(token_ids=prompt)
            out = s.generate(max_tokens=4, stop_token_ids=())
        if i % 4 == 0 or i == 3 * MAX_GRAPH_POLICIES - 1:
            assert out == greedy(engines["qwen3_moe"], prompt, 4, **kw)
    g = graphed.graphs
    served = {p.policy for k in g.entry_keys() for p in k[2]}
    assert len(g.entry_keys()) <= MAX_GRAPHS and len(served) <= MAX_GRAPH_POLICIES
    assert g.created <= MAX_GRAPH_POLICIES  # one decode shape per admitted policy, built once
    # sinks without a window change no captured computation: such sessions share entries
    assert policy_key(WindowPolicy(sinks=0)) == policy_key(WindowPolicy(sinks=4))
    assert policy_key(WindowPolicy(window=20, sinks=0)) != policy_key(WindowPolicy(window=20, sinks=4))
    graphed.check_integrity()
    graphed.shutdown()


def test_embedding_steps_never_take_the_graph_path(checkpoints, engines) -> None:
    graphed = graphed_engine(checkpoints)
    ids = random_ids(10, seed=91)
    with torch.no_grad():
        vec = graphed.model.embed_tokens(torch.tensor(ids[4:])).clone()
    with graphed.open_session() as s:
        s.append(token_ids=ids[:4])
        s.append(embeds=vec, kind="audio")  # 6 vectors: a graph width, run eagerly
        assert not any(k[0] == 6 for k in graphed.graphs.entry_keys())
        s.rewind(to=8)  # the reply re-runs position 7, a vector: eagerly too
        out = s.generate(max_tokens=5, stop_token_ids=())
    assert out == greedy(engines["qwen3_moe"], ids[:8], 5)
    graphed.shutdown()


def test_policies_of_sessions_long_gone_give_their_places_up(checkpoints, engines, monkeypatch) -> None:
    """Steps refused for their policy age the admitted ones too: once the sessions that filled the places are
    gone, a new policy gets graphs after POLICY_IDLE_RUNS steps (it was refused for ever when only graph
    runs counted, and none ran)."""
    monkeypatch.setattr(graphs_module, "POLICY_IDLE_RUNS", 5)
    graphed = graphed_engine(checkpoints)
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
    served = {p.policy for k in graphed.graphs.entry_keys() for p in k[2]}
    assert policy_key(WindowPolicy(**kw)) in served and len(served) <= MAX_GRAPH_POLICIES
    graphed.shutdown()
