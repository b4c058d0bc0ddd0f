"""Pure-torch reference implementations of every op the models use.

These are the ground truth the Triton kernels are tested against, and the CPU path. Shapes are those
of one sequence (batch 1): T new tokens, H query heads, KVH key/value heads, hd head dim, D hidden,
E experts, k experts per token, I expert intermediate size, S cached tokens (prefix + new).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n], weight [n] -> [..., n]. Normalises in fp32, scales in the input dtype (as HF does):
    weight * (x * rsqrt(mean(x^2) + eps)). `F.rms_norm` computes exactly that in one call (equal bit for bit,
    tests/kernels/test_reference.py); a decode step runs two per layer, and each call saved is ~3 us on a CPU."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the next norm: -> (x + delta, rms_norm(x + delta))."""
    h = x + delta
    return h, rms_norm(h, weight, eps)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int, inv_freq [hd/2] fp32 -> cos, sin [T, hd] in `dtype` (computed in fp32)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n_heads, hd], cos/sin [T, hd] -> [T, n_heads, hd]; the rotate-half (NeoX) convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first, then up) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first, then up) -> gelu(gate) * up [..., I], GELU's tanh approximation (GeGLU,
    Gemma's "gelu_pytorch_tanh")."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding: int | None = None, sinks: int = 0,
            window: int | None = None) -> torch.Tensor:
    """Which keys each query may attend to: q_pos [T], k_pos [S] (absolute positions) -> bool [T, S].

    Causal; `sliding`: the model's own sliding window (keys at p - sliding < j <= p); `window`/`sinks`:
    the session's stream policy (keys among the first `sinks` tokens or at p - window < j <= p).
    """
    q, k = q_pos[:, None], k_pos[None, :]
    mask = k <= q
    if sliding is not None:
        mask &= k > q - sliding
    if window is not None:
        mask &= (k < sinks) | (k > q - window)
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              scale: float, sliding: int | None = None, sinks: int = 0, window: int | None = None) -> torch.Tensor:
    """Attention of T new queries over S cached keys (which include the queries' own).

    q [T, H, hd] (RoPE applied); k, v [KVH, S, hd]; q_pos [T], k_pos [S] absolute positions;
    H % KVH == 0 (GQA). Masking as in `visible`. Returns [T, H * hd].
    """
    t, h, hd = q.shape
    kvh = k.shape[0]
    mask = visible(q_pos, k_pos, sliding, sinks, window)  # also hides keys padded past the query (graphs)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                         attn_mask=mask, scale=scale, enable_gqa=kvh != h)
    return out[0].transpose(0, 1).reshape(t, h * hd)


def rolling_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sinks: int, window: int,
                    sliding: int | None = None) -> torch.Tensor:
    """`visible` for rolling positions: the model's own sliding window counts distances inside the query's
    cache, where a sink s sits at c - s from the query (c = min(p, sinks + window - 1))."""
    mask = visible(q_pos, k_pos, None, sinks, window)
    if sliding is not None:
        cq = torch.clamp(q_pos, max=sinks + window - 1)[:, None]
        dist = torch.where(k_pos[None, :] < sinks, cq - k_pos[None, :], q_pos[:, None] - k_pos[None, :])
        mask &= dist < sliding
    return mask


class PagedKeys(NamedTuple):
    """One layer's keys and values as a step sees them: the pool's pages and the slots to read."""

    k_pool: torch.Tensor  # [num_pages * P, KVH, hd] the layer's keys, flattened pages
    v_pool: torch.Tensor
    slots: torch.Tensor  # [S] int64 flat slot of each key the step may read, sinks first
    k_pos: torch.Tensor  # [S] int64 absolute positions of those keys


def gather(paged: PagedKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """-> keys, values [KVH, S, hd] copied out of their pages (the torch path; kernels read pages in place)."""
    return (paged.k_pool.index_select(0, paged.slots).transpose(0, 1),
            paged.v_pool.index_select(0, paged.slots).transpose(0, 1))


def paged_attention(q: torch.Tensor, paged: PagedKeys, q_pos: torch.Tensor, scale: float, sliding: int | None = None,
                    sinks: int = 0, window: int | None = None) -> torch.Tensor:
    """`attention` over paged keys: q [T, H, hd] -> [T, H * hd]."""
    k, v = gather(paged)
    return attention(q, k, v, q_pos, paged.k_pos, scale, sliding, sinks, window)


def paged_attention_rolling(q: torch.Tensor, paged: PagedKeys, q_pos: torch.Tensor, rope: RollingRope,
                            scale: float, sinks: int, window: int, sliding: int | None = None) -> torch.Tensor:
    """`attention_rolling` over paged keys: q [T, H, hd] unrotated -> [T, H * hd]."""
    k, v = gather(paged)
    return attention_rolling(q, k, v, q_pos, paged.k_pos, rope, scale, sinks, window, sliding)


class AttentionBatch(NamedTuple):
    """A few tokens of each of B sessions (absolute positions) over their paged keys, padded to the most
    queries and the most keys (built once per step). Padding keys sit at slot 0 with a position no query
    reaches, so they are masked as future keys; a padding query repeats its session's last one."""

    q_rows: torch.Tensor  # [B, Tq] int64 row of each query in the step's q [N, H, hd]
    q_pos: torch.Tensor  # [B, Tq] int64 its absolute position
    slots: torch.Tensor  # [B, S] int64 flat slots of the keys each session may read
    k_pos: torch.Tensor  # [B, S] int64 their absolute positions
    sinks: torch.Tensor  # [B] int64 each session's sink count
    window: torch.Tensor  # [B] int64 each session's window (a huge number when it has none)
    out_rows: torch.Tensor  # [M] int64 the real queries' rows in the padded output [B * Tq], session by session


def paged_attention_batch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: AttentionBatch,
                          scale: float, sliding: int | None = None) -> torch.Tensor:
    """Several sessions' queries in one call: q [N, H, hd] (RoPE applied), pools [num_pages * P, KVH, hd]
    -> [M, H * hd] for the M real queries of `batch`, each as `paged_attention` gives it on its own session."""
    b, tq = batch.q_rows.shape
    h, hd = q.shape[1:]
    kvh, s = k_pool.shape[1], batch.slots.shape[1]
    qb = q.index_select(0, batch.q_rows.reshape(-1)).view(b, tq, h, hd).transpose(1, 2)  # [B, H, Tq, hd]
    k = k_pool.index_select(0, batch.slots.reshape(-1)).view(b, s, kvh, hd).transpose(1, 2)  # [B, KVH, S, hd]
    v = v_pool.index_select(0, batch.slots.reshape(-1)).view(b, s, kvh, hd).transpose(1, 2)
    qp, kp = batch.q_pos[:, :, None], batch.k_pos[:, None, :]
    mask = (kp <= qp) & ((kp < batch.sinks[:, None, None]) | (kp > qp - batch.window[:, None, None]))  # [B, Tq, S]
    if sliding is not None:
        mask &= kp > qp - sliding
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask[:, None], scale=scale,
                                         enable_gqa=kvh != h)  # [B, H, Tq, hd]
    return out.transpose(1, 2).reshape(b * tq, h * hd).index_select(0, batch.out_rows)


class RollingRope(NamedTuple):
    """Rotations of one rolling step, shared by all layers (see `attention_rolling`)."""

    k_cos: torch.Tensor  # [S, hd] per key: a sink by its index, a window key by its distance from the oldest
    k_sin: torch.Tensor
    q_cos: torch.Tensor  # [T, hd] per query, against window keys: p - oldest window key
    q_sin: torch.Tensor
    qs_cos: torch.Tensor  # [T, hd] per query, against sinks: its place in its cache, min(p, sinks + window - 1)
    qs_sin: torch.Tensor
    base: torch.Tensor  # [] the oldest window key's position (0 without one)
    inv_freq: torch.Tensor  # [hd/2] fp32, for kernels that rotate keys in registers
    scaling: float


def rolling_rope(q_pos: torch.Tensor, k_pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float, sinks: int,
                 window: int, dtype: torch.dtype) -> RollingRope:
    """q_pos [T], k_pos [S] absolute (the session lists its sink keys first) -> the step's rotations."""
    is_sink = k_pos < sinks
    # the oldest window key, found on the device (no host sync: decode steps stay graph-capturable);
    # padding keys (positions past the query) are never the oldest
    big = torch.iinfo(k_pos.dtype).max
    base = torch.where(is_sink, big, k_pos).min()
    base = torch.where(base == big, 0, base)
    kc, ks = rope_cos_sin(torch.where(is_sink, k_pos, k_pos - base), inv_freq, scaling, dtype)
    qc, qs = rope_cos_sin(q_pos - base, inv_freq, scaling, dtype)
    sc, ss = rope_cos_sin(torch.clamp(q_pos, max=sinks + window - 1), inv_freq, scaling, dtype)
    return RollingRope(kc, ks, qc, qs, sc, ss, base, inv_freq, scaling)


def attention_rolling(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      k_pos: torch.Tensor, rope: RollingRope, scale: float, sinks: int, window: int,
                      sliding: int | None = None) -> torch.Tensor:
    """StreamingLLM attention: keys cached before RoPE, positions counted inside the cache.

    q [T, H, hd] and k [KVH, S, hd] without RoPE; v [KVH, S, hd]; q_pos [T], k_pos [S] absolute.
    Query p sees the first `sinks` tokens and the last `window` tokens up to itself; inside that cache
    a sink s sits at position s and the query at c = min(p, sinks + window - 1), so the sink distance is
    c - s while a window key j keeps its distance p - j. Rotations use positions relative to the oldest
    window key (`rolling_rope`), so they stay bounded however long the stream. Returns [T, H * hd].
    """
    t, h, hd = q.shape
    kvh, n = k.shape[0], k.shape[1]
    group = h // kvh
    k_rot = apply_rope(k.transpose(0, 1), rope.k_cos, rope.k_sin).transpose(0, 1)  # [KVH, S, hd]

    def grouped(x: torch.Tensor) -> torch.Tensor:  # [T, H, hd] -> [KVH, G*T, hd], GQA without copies of K/V
        return x.view(t, kvh, group, hd).permute(1, 2, 0, 3).reshape(kvh, group * t, hd)

    scores = grouped(apply_rope(q, rope.q_cos, rope.q_sin)) @ k_rot.transpose(1, 2)  # [KVH, G*T, S]
    # against its sinks the query sits at its place in its own cache
    if k.is_cuda:  # no host sync (graph capture): score every key both ways, keep the right one
        sink_scores = grouped(apply_rope(q, rope.qs_cos, rope.qs_sin)) @ k_rot.transpose(1, 2)
        scores = torch.where(k_pos < sinks, sink_scores, scores)
    else:  # the session lists its sinks first: score just those again
        n_sink = int((k_pos < sinks).sum())
        if n_sink:
            scores[..., :n_sink] = grouped(apply_rope(q, rope.qs_cos, rope.qs_sin)) @ k_rot[:, :n_sink].transpose(1, 2)
    mask = rolling_visible(q_pos, k_pos, sinks, window, sliding)  # [T, S]
    scores = (scores.float() * scale).view(kvh, group, t, n).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(kvh, group * t, n)
    out = (probs @ v).view(kvh, group, t, hd).permute(2, 0, 1, 3)  # [T, KVH, G, hd]
    return out.reshape(t, h * hd)


MIN_TEMPERATURE = 1e-5  # temperatures below this sample greedily

_M32 = 0xFFFFFFFF  # the hash works on 32-bit words held in int64: no product leaves int64, so every device agrees


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """x int64 in [0, 2^32) -> "lowbias32" (C. Wellons' hash prospector): a bijection of [0, 2^32) in which
    each input bit flips each output bit with probability close to 1/2. Works in place on x."""
    x.bitwise_xor_(x >> 16).mul_(0x7FEB352D).bitwise_and_(_M32)  # products < 2^63: no int64 overflow
    x.bitwise_xor_(x >> 15)
    # times 0x846CA68B mod 2^32: times (it - 2^31), then x * 2^31 mod 2^32, which is (x & 1) << 31, added
    # (adding 2^31 mod 2^32 flips bit 31 only)
    top = (x & 1) << 31
    x.mul_(0x846CA68B - (1 << 31)).bitwise_and_(_M32).bitwise_xor_(top)
    return x.bitwise_xor_(x >> 16)


def race_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """seeds [B] int64 in [0, 2^63), positions [B] int64 >= 0 -> [B] 32-bit keys: the counters absorbed one
    32-bit word at a time (distinct counters share a key with probability about 2^-32)."""
    k = torch.full_like(seeds, 0x6A09E667)
    for word in (seeds & _M32, seeds >> 32, positions & _M32, positions >> 32):
        k = _mix32(k.bitwise_xor_(word))
    return _mix32(k.bitwise_xor_(stream & _M32))


def race_uniform(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Counter-based uniforms: [B, n] fp32 in (0, 1), a pure function of (seed, position, stream, index) on
    the seeds' device: the same numbers whatever else is in the batch, and no generator state anywhere.
    seeds, positions [B] int64."""
    idx = _mix32(torch.arange(n, device=seeds.device, dtype=torch.int64).add_(0x9E3779B9))  # [n], hashed once
    x = _mix32(idx[None, :] ^ race_keys(seeds, positions, stream)[:, None])  # [B, n] in [0, 2^32)
    return (x >> 8).float().add_(0.5).mul_(2.0 ** -24)  # the top 24 bits, exact in fp32: never 0 or 1


def race_noise(seeds: torch.Tensor, positions: torch.Tensor, stream: int, vocab: int,
               device: torch.device | None = None) -> torch.Tensor:
    """The exponential race's noise for B rows: [B, vocab] fp32, Exp(1) per token id, a pure function of
    (seed_b, position_b, stream, token id), computed on `device` (default: the seeds') in one call.
    seeds, positions [B] int64."""
    if device is not None:
        seeds, positions = seeds.to(device), positions.to(device)
    return race_uniform(seeds, positions, stream, vocab).log_().neg_()


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) (lowest index on ties, NaN wins), through numpy's vectorized argmax for a float32 CPU
    tensor: torch 2.13's CPU argmax runs ~110 us over one 49,152-token row where numpy takes ~8 us (a greedy decode
    step argmaxes one such row per session per token)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() >= 1 and x.shape[-1] > 0:
        return torch.from_numpy(np.asarray(x.detach().numpy().argmax(axis=-1), dtype=np.int64))
    return torch.argmax(x, dim=-1)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (unnormalised is fine, zeros never win unless a row is all zeros), noise [B, V] Exp(1) ->
    [B] int64: argmax probs / noise, a draw from each row's distribution."""
    return argmax_last(probs / noise)


def keep_mask(sorted_p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """sorted_p [B, V] probabilities in descending order -> bool [B, V]: the tokens top-k and top-p keep."""
    rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    # top_p >= 1 keeps everything (an fp32 cumulative sum can overshoot 1 and would cut the tail)
    return keep & (((torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p[:, None]) | (top_p[:, None] >= 1))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one token per row on the device, without a host sync.

    logits [B, V] fp32; temperature [B] (below MIN_TEMPERATURE: greedy, lowest id on ties); top_k [B] int (0: no limit);
    top_p [B] in (0, 1] (keep the smallest head of the sorted distribution whose mass reaches top_p; the
    most likely token always stays). -> [B] int64. Draws use the exponential race (argmax p / E, E ~ Exp(1)),
    which samples exactly from p with one pass and no cumulative search. `noise` [B, V] is E by token id
    (`race_noise`: a row's draw then depends on that row alone); without it E comes from `generator`.
    """
    greedy = argmax_last(logits)
    sampled = temperature >= MIN_TEMPERATURE  # below it, logits / T overflows: such rows are greedy
    temp = torch.where(sampled, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties: lowest id first
    kept = torch.where(keep_mask(sorted_p, top_k, top_p), sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter_(1, order, kept)  # [B, V] by token id again
    if noise is None:
        noise = torch.empty_like(kept).exponential_(generator=generator)
    return torch.where(sampled, race(kept, noise), greedy)


def moe_route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64).

    Softmax over all experts in fp32, then top-k; `normalize` renormalises the k weights to sum to 1
    (Mixtral always; Qwen3-MoE and OLMoE when `norm_topk_prob`).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts_gather(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                       w_down: torch.Tensor) -> torch.Tensor:
    """Few tokens (decode): gather the k chosen experts of each token and run them as batched gemv.

    x [T, D]; weights [T, k] fp32; ids [T, k]; w_gate_up [E, 2I, D]; w_down [E, D, I] -> [T, D].
    No host sync (graph-capturable), at the price of copying the chosen experts' weights.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, D, 1]
    h = silu_mul(torch.bmm(w_gate_up.index_select(0, flat), xs).squeeze(-1))  # [T*k, I]
    y = torch.bmm(w_down.index_select(0, flat), h.unsqueeze(-1)).squeeze(-1)  # [T*k, D]
    return (y.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def moe_experts_topk_loop(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                          w_down: torch.Tensor) -> torch.Tensor:
    """A token or two on a CPU: one matmul pair per chosen (token, expert), weights read in place.

    Same shapes and result as `moe_experts_gather`; one host sync to read the ids.
    """
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t, (row, w) in enumerate(zip(ids.tolist(), weights, strict=True)):
        xt = x[t:t + 1]
        for j, e in enumerate(row):
            out[t] += w[j] * F.linear(silu_mul(F.linear(xt, w_gate_up[e])), w_down[e])[0].float()
    return out.to(x.dtype)


def moe_experts_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                        w_down: torch.Tensor) -> torch.Tensor:
    """Group the (token, slot) pairs by expert and run each hit expert once, reading its weights in place.

    Same shapes and result as `moe_experts_gather`. Uses torch's grouped GEMM (`F.grouped_mm`, one call
    for all experts) where this torch has it and the rows are 16-byte aligned, else one matmul per hit
    expert (a host sync).
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs sorted by expert
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0])
    token_of = order // k  # [T*k] the token of each sorted pair
    xs = x.index_select(0, token_of)  # [T*k, D]
    itemsize = x.element_size()
    if hasattr(F, "grouped_mm") and (x.shape[1] * itemsize) % 16 == 0 and (w_down.shape[2] * itemsize) % 16 == 0:
        offs = torch.cumsum(counts, 0).to(torch.int32)  # [E] end of each expert's rows
        h = silu_mul(F.grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs))  # [T*k, I]
        y = F.grouped_mm(h, w_down.transpose(1, 2), offs=offs)  # [T*k, D]
    else:
        y = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                y[start:start + n] = F.linear(silu_mul(F.linear(xs[start:start + n], w_gate_up[e])), w_down[e])
                start += n
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, y.float() * weights.reshape(-1)[order, None])
    return out.to(x.dtype)
