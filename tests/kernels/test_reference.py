"""The torch reference ops against naive per-token loops, on random odd-sized inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from streamserve.kernels import reference as ref


def naive_moe(x, weights, ids, w_gate_up, w_down):
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (w_gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w_down[e] @ (F.silu(g) * u)).float()
    return out.to(x.dtype)


MOE_SHAPES = [
    (1, 8, 2, 33, 17), (5, 13, 3, 40, 24), (19, 64, 8, 21, 9),  # odd sizes: the per-expert fallback
    (7, 16, 4, 64, 32), (1, 64, 8, 128, 48),  # 16-byte aligned rows: torch's grouped GEMM
]


@pytest.mark.parametrize(("T", "E", "k", "D", "inter"), MOE_SHAPES)
def test_moe_paths_match_a_naive_loop(T: int, E: int, k: int, D: int, inter: int) -> None:
    g = torch.Generator().manual_seed(T * 100 + E)
    x = torch.randn(T, D, generator=g)
    w_gate_up, w_down = torch.randn(E, 2 * inter, D, generator=g), torch.randn(E, D, inter, generator=g)
    weights, ids = ref.moe_route(torch.randn(T, E, generator=g), k, normalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(T))
    expected = naive_moe(x, weights, ids, w_gate_up, w_down)
    for path in (ref.moe_experts_gather, ref.moe_experts_grouped, ref.moe_experts_topk_loop):
        assert torch.allclose(path(x, weights, ids, w_gate_up, w_down), expected, atol=1e-3, rtol=1e-4), path


def test_moe_route_without_normalisation_keeps_softmax_mass() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    w, i = ref.moe_route(logits, 2, normalize=False)
    p = torch.softmax(logits, -1)[0]
    assert i.tolist() == [[3, 2]] and torch.allclose(w[0], p[[3, 2]])


def naive_attention(q, k, v, q_pos, k_pos, scale, sliding=None, sinks=0, window=None, rope=None):
    """One query and one head at a time. `rope` (inv_freq): StreamingLLM positions inside the cache."""
    T, H, hd = q.shape
    KVH = k.shape[0]
    out = torch.zeros(T, H, hd)
    for t in range(T):
        p = int(q_pos[t])
        keys = [j for j, kp in enumerate(k_pos.tolist())
                if kp <= p and (window is None or kp < sinks or kp > p - window)]
        if sliding is not None:  # distances as the query's cache counts them (StreamingLLM) or absolute
            dist = [len(keys) - 1 - i if rope is not None else p - int(k_pos[j]) for i, j in enumerate(keys)]
            keys = [j for j, d in zip(keys, dist, strict=True) if d < sliding]
        for h in range(H):
            kv = h // (H // KVH)
            qq, kk = q[t, h], k[kv, keys]
            if rope is not None:  # the query's cache: its keys in order, numbered 0.. by their place in it
                c, s = ref.rope_cos_sin(torch.arange(len(keys)), rope, 1.0, torch.float32)
                kk = ref.apply_rope(kk[:, None], c, s)[:, 0]
                qq = ref.apply_rope(qq[None, None], c[-1:], s[-1:])[0, 0]
            out[t, h] = torch.softmax((kk @ qq) * scale, -1) @ v[kv, keys]
    return out.reshape(T, H * hd)


ATTN_SHAPES = [  # T, S, H, KVH, hd, sliding, sinks, window
    (1, 1, 4, 2, 8, None, 0, None), (1, 37, 6, 2, 16, None, 0, None), (7, 29, 4, 4, 8, None, 0, None),
    (5, 23, 8, 2, 16, 6, 0, None), (1, 40, 2, 1, 8, 9, 0, None), (6, 41, 4, 2, 8, None, 3, 10),
    (1, 33, 4, 1, 16, None, 4, 7), (9, 50, 4, 2, 8, 12, 2, 20),
]


@pytest.mark.parametrize(("T", "S", "H", "KVH", "hd", "sliding", "sinks", "window"), ATTN_SHAPES)
def test_attention_matches_explicit_softmax(T, S, H, KVH, hd, sliding, sinks, window) -> None:
    g = torch.Generator().manual_seed(S)
    q = torch.randn(T, H, hd, generator=g)
    k, v = torch.randn(KVH, S, hd, generator=g), torch.randn(KVH, S, hd, generator=g)
    q_pos, k_pos = torch.arange(S - T, S), torch.arange(S)
    out = ref.attention(q, k, v, q_pos, k_pos, hd**-0.5, sliding, sinks, window)
    expected = naive_attention(q, k, v, q_pos, k_pos, hd**-0.5, sliding, sinks, window)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize(("T", "S", "sinks", "window", "sliding"), [
    (1, 12, 2, 20, None), (1, 40, 4, 9, None), (5, 40, 4, 9, None), (7, 61, 3, 16, None), (3, 30, 0, 5, None),
    (6, 61, 3, 16, 12), (1, 40, 4, 20, 8)])
def test_rolling_attention_matches_a_streaming_llm_cache(T, S, sinks, window, sliding) -> None:
    """Each query sees [sinks | last window] numbered by place in its own cache (StreamingLLM)."""
    H, KVH, hd = 4, 2, 16
    g = torch.Generator().manual_seed(S + T)
    q = torch.randn(T, H, hd, generator=g)
    k, v = torch.randn(KVH, S, hd, generator=g), torch.randn(KVH, S, hd, generator=g)
    # the keys a session keeps: sinks and the window of the first query
    q_pos = torch.arange(S - T, S)
    first = max(sinks, S - T - window + 1)
    k_pos = torch.cat([torch.arange(min(sinks, first)), torch.arange(first, S)])
    k, v = k[:, k_pos], v[:, k_pos]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    rope = ref.rolling_rope(q_pos, k_pos, inv, 1.0, sinks, window, torch.float32)
    out = ref.attention_rolling(q, k, v, q_pos, k_pos, rope, hd**-0.5, sinks, window, sliding)
    expected = naive_attention(q, k, v, q_pos, k_pos, hd**-0.5, sliding, sinks, window, rope=inv)
    assert torch.allclose(out, expected, atol=1e-4)
    if sinks + window - 1 <= S - T:  # every cache is full: a million tokens later, the same attention
        far = 10**6 * (k_pos >= sinks)
        rope_far = ref.rolling_rope(q_pos + 10**6, k_pos + far, inv, 1.0, sinks, window, torch.float32)
        out_far = ref.attention_rolling(q, k, v, q_pos + 10**6, k_pos + far, rope_far, hd**-0.5, sinks, window,
                                        sliding)
        assert torch.allclose(out_far, out, atol=1e-4)


def test_rope_is_a_rotation_by_position() -> None:
    hd, pos = 10, torch.tensor([0, 3, 11])
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    cos, sin = ref.rope_cos_sin(pos, inv, 1.0, torch.float32)
    x = torch.randn(3, 2, hd, generator=torch.Generator().manual_seed(0))
    y = ref.apply_rope(x, cos, sin)
    # as complex numbers: (x_i + j x_{i+hd/2}) * exp(j * pos * inv_i)
    turn = torch.polar(torch.ones(3, hd // 2), pos[:, None] * inv)[:, None]
    z = torch.complex(x[..., : hd // 2], x[..., hd // 2:]) * turn
    assert torch.allclose(y, torch.cat([z.real, z.imag], -1), atol=1e-5)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_rms_norm_and_silu_mul() -> None:
    x = torch.randn(3, 7, dtype=torch.float64)
    w = torch.randn(7, dtype=torch.float64)
    expected = w * (x.float() / torch.sqrt((x.float() ** 2).mean(-1, keepdim=True) + 1e-5)).double()
    assert torch.allclose(ref.rms_norm(x, w, 1e-5), expected, atol=1e-6)
    gu = torch.randn(4, 10)
    assert torch.allclose(ref.silu_mul(gu), gu[:, :5] * torch.sigmoid(gu[:, :5]) * gu[:, 5:])
    assert not math.isnan(float(ref.rms_norm(torch.zeros(1, 4), torch.ones(4), 1e-6).sum()))


def test_device_sampling_follows_the_target_distribution() -> None:
    """Empirical frequencies approach softmax(logits / T) restricted to top-k / top-p, renormalised."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 40000
    cases = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8)]
    for temperature, top_k, top_p in cases:
        p = torch.softmax(logits / temperature, -1)
        keep = torch.ones(6, dtype=torch.bool)
        if top_k:
            keep[top_k:] = False
        keep &= (torch.cumsum(p, -1) - p) < top_p  # logits are sorted already
        target = torch.where(keep, p, 0) / p[keep].sum()
        rows = logits.repeat(n, 1)
        toks = ref.sample_tokens(rows, torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.long),
                                 torch.full((n,), top_p), g)
        freq = torch.bincount(toks, minlength=6).float() / n
        assert (freq - target).abs().max() < 0.01, (temperature, top_k, top_p, freq, target)
        assert freq[~keep].sum() == 0
    greedy = ref.sample_tokens(torch.tensor([[0.0, 3.0, 3.0]]), torch.zeros(1), torch.zeros(1, dtype=torch.long),
                               torch.ones(1), g)
    assert greedy.tolist() == [1]


def test_sampling_edges_full_vocab_mixed_rows_and_tiny_temperature() -> None:
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(1, 151936, generator=g) * 3, -1).sort(descending=True).values
    one = torch.ones(1)
    assert ref.keep_mask(probs, torch.zeros(1, dtype=torch.long), one).all()  # top_p = 1 cuts nothing
    assert ref.keep_mask(probs, torch.tensor([10**6]), one).all()  # top_k above V: no limit
    logits = torch.tensor([[0.0, 5.0, -3.0, 1.0]] * 3)
    toks = ref.sample_tokens(logits, torch.tensor([0.0, 1e-39, 50.0]), torch.zeros(3, dtype=torch.long),
                             torch.ones(3), g)
    assert toks[:2].tolist() == [1, 1]  # greedy rows, whatever the others in the batch do


@pytest.mark.parametrize(("H", "KVH", "hd", "sliding"), [(4, 2, 16, None), (6, 1, 24, 7), (3, 3, 8, None)])
def test_batched_attention_equals_one_session_at_a_time(H: int, KVH: int, hd: int, sliding: int | None) -> None:
    """B sessions' queries (1 to 5 each) in one padded call = each session's own `paged_attention`, with
    mixed lengths, windows and sinks; padding keys (slot 0, unreachable position) never leak in."""
    g = torch.Generator().manual_seed(H * 100 + hd)
    pool_slots = 300
    k_pool = torch.randn(pool_slots, KVH, hd, generator=g, dtype=torch.float64)
    v_pool = torch.randn(pool_slots, KVH, hd, generator=g, dtype=torch.float64)
    sessions = [(1, 1, 0, None), (17, 3, 4, 9), (40, 1, 2, 25), (33, 5, 0, None), (5, 2, 1, 3)]  # (len, T, sinks, win)
    perm = torch.randperm(pool_slots - 1, generator=g) + 1  # slot 0 only ever padding
    n_q = sum(t for _, t, _, _ in sessions)
    q = torch.randn(n_q, H, hd, generator=g, dtype=torch.float64)
    tq, longest = max(t for _, t, _, _ in sessions), max(n for n, _, _, _ in sessions)
    b = len(sessions)
    slots, k_pos = torch.zeros(b, longest, dtype=torch.long), torch.full((b, longest), 1 << 62, dtype=torch.long)
    q_rows, q_pos = torch.zeros(b, tq, dtype=torch.long), torch.zeros(b, tq, dtype=torch.long)
    expected, used, row, out_rows = [], 0, 0, []
    for i, (n, t, sinks, window) in enumerate(sessions):
        pos = torch.arange(n)
        sl = perm[used:used + n]
        used += n
        slots[i, :n], k_pos[i, :n] = sl, pos
        for j in range(tq):  # padding queries repeat the last one
            q_rows[i, j], q_pos[i, j] = row + min(j, t - 1), n - t + min(j, t - 1)
        out_rows += [i * tq + j for j in range(t)]
        paged = ref.PagedKeys(k_pool, v_pool, sl, pos)
        expected.append(ref.paged_attention(q[row:row + t], paged, pos[n - t:], 0.3, sliding, sinks, window))
        row += t
    batch = ref.AttentionBatch(q_rows, q_pos, slots, k_pos, torch.tensor([s for _, _, s, _ in sessions]),
                               torch.tensor([1 << 62 if w is None else w for _, _, _, w in sessions]),
                               torch.tensor(out_rows))
    got = ref.paged_attention_batch(q, k_pool, v_pool, batch, 0.3, sliding)
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 37), (5, 576), (3, 7, 65)])
def test_rms_norm_is_the_transformers_formula_bit_for_bit(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The one-call `F.rms_norm` path equals HF's LlamaRMSNorm exactly: fp32 statistics, the scale in x's dtype."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(ref.rms_norm(x, w, 1e-6), expected)


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 49_151), (2, 5, 33)])
def test_argmax_last_is_torch_argmax(shape: tuple[int, ...]) -> None:
    """numpy's argmax on CPU float32 (the greedy path), torch's elsewhere: the same ids, ties to the lowest id,
    NaN winning, strided views, and the scalar shape of a 1-D input."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g).round(decimals=1)  # rounding makes ties
    for t in (x, x.to(torch.bfloat16), x[..., ::2], torch.full_like(x, float("-inf"))):
        got = ref.argmax_last(t)
        assert got.dtype == torch.int64 and got.shape == t.shape[:-1]
        assert torch.equal(got, torch.argmax(t, dim=-1))
    y = x.clone()
    y[..., -1] = float("nan")
    assert torch.equal(ref.argmax_last(y), torch.argmax(y, dim=-1))
