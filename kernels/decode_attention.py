"""Decode attention (one new query token) over a session's paged `[sinks | window]` KV.

Split-KV: grid (KVH, splits). A program takes one KV head (all its G = H / KVH query heads at once: GQA)
and one contiguous share of the session's key slots, gathers the keys and values from their pages, runs
an online softmax and writes its partial output and log-sum-exp; `decode_attention` merges the splits
by log-sum-exp (and folds in optional learned per-head sink logits). Masking is `reference.visible`
(causal, model sliding window, session sinks + window; `rolling_visible` with rolling positions). In
rolling mode the keys are cached without RoPE and rotated in registers: a sink by its position, a
window key by its distance from the oldest window key; the caller passes the query rotated both ways
(`rolling_rope`). Head dims are handled in two halves (the rotate-half RoPE convention), so 64, 80,
128, 256 all work (masked to a power of two).
Reference: `reference.attention` / `reference.attention_rolling` with T = 1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from streamserve.kernels.attention_common import _rotate_keys, _scores, _softmax_step, _split_result
from streamserve.kernels.checks import check_paged, check_tensor
from streamserve.kernels.launch_config import launch_config


@triton.jit
def _decode_attn_kernel(q_ptr, qs_ptr, k_ptr, v_ptr, slots_ptr, kpos_ptr, qpos_ptr, base_ptr, inv_freq_ptr,
                        o_ptr, lse_ptr, S, keys_per_split, scale, rope_scaling, sliding, sinks, window,
                        KVH: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_HALF: tl.constexpr, BLOCK_N: tl.constexpr, ROLLING: tl.constexpr,
                        SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    HD: tl.constexpr = 2 * HALF
    g = tl.arange(0, BLOCK_G)
    dh = tl.arange(0, BLOCK_HALF)
    g_ok = g < G
    d_ok = dh < HALF
    qm = g_ok[:, None] & d_ok[None, :]
    head = kvh * G + g  # [BLOCK_G] query heads of this KV head
    q1 = tl.load(q_ptr + head[:, None] * HD + dh[None, :], mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + head[:, None] * HD + HALF + dh[None, :], mask=qm, other=0.0).to(tl.float32)
    if ROLLING:  # the same query rotated as it sits against its sinks
        qs1 = tl.load(qs_ptr + head[:, None] * HD + dh[None, :], mask=qm, other=0.0).to(tl.float32)
        qs2 = tl.load(qs_ptr + head[:, None] * HD + HALF + dh[None, :], mask=qm, other=0.0).to(tl.float32)
        base = tl.load(base_ptr)
        inv_freq = tl.load(inv_freq_ptr + dh, mask=d_ok, other=0.0)
    qpos = tl.load(qpos_ptr)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_G, BLOCK_HALF), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_G, BLOCK_HALF), dtype=tl.float32)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, S)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        slot = tl.load(slots_ptr + n, mask=n_ok, other=0).to(tl.int64)
        kpos = tl.load(kpos_ptr + n, mask=n_ok, other=0)
        row = (slot * KVH + kvh) * HD  # [BLOCK_N] start of this key's head in the flat pool
        km = n_ok[:, None] & d_ok[None, :]
        k1 = tl.load(k_ptr + row[:, None] + dh[None, :], mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(k_ptr + row[:, None] + HALF + dh[None, :], mask=km, other=0.0).to(tl.float32)
        if ROLLING:
            is_sink = kpos < sinks
            k1, k2 = _rotate_keys(k1, k2, kpos, sinks, base, inv_freq, rope_scaling)
            s_win = _scores(q1, q2, k1, k2, PRECISION)
            s_sink = _scores(qs1, qs2, k1, k2, PRECISION)
            scores = tl.where(is_sink[None, :], s_sink, s_win)
        else:
            scores = _scores(q1, q2, k1, k2, PRECISION)  # [BLOCK_G, BLOCK_N]
        ok = n_ok & (kpos <= qpos)
        dist = qpos - kpos
        if ROLLING:  # against a sink the query sits at its place in its own cache
            dist = tl.where(kpos < sinks, tl.minimum(qpos, sinks + window - 1) - kpos, dist)
        ok = ok & ((sliding == 0) | (dist < sliding))
        ok = ok & ((window == 0) | (kpos < sinks) | (kpos > qpos - window))
        scores = tl.where(ok[None, :], scores * scale, float("-inf"))
        v1 = tl.load(v_ptr + row[:, None] + dh[None, :], mask=km, other=0.0).to(tl.float32)
        v2 = tl.load(v_ptr + row[:, None] + HALF + dh[None, :], mask=km, other=0.0).to(tl.float32)
        m_i, l_i, acc1, acc2 = _softmax_step(scores, m_i, l_i, acc1, acc2, v1, v2, PRECISION)
    inv_l, lse = _split_result(m_i, l_i)
    out_row = (kvh * SPLITS + split) * BLOCK_G + g  # partials: [KVH, SPLITS, BLOCK_G, HD]
    tl.store(o_ptr + out_row[:, None] * HD + dh[None, :], acc1 * inv_l[:, None], mask=qm)
    tl.store(o_ptr + out_row[:, None] * HD + HALF + dh[None, :], acc2 * inv_l[:, None], mask=qm)
    tl.store(lse_ptr + out_row, lse, mask=g_ok)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                     k_pos: torch.Tensor, q_pos: torch.Tensor, scale: float, sliding: int | None = None,
                     sinks: int = 0, window: int | None = None, q_sink: torch.Tensor | None = None,
                     base: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                     rope_scaling: float = 1.0, sink_logits: torch.Tensor | None = None,
                     block_n: int | None = None) -> torch.Tensor:
    """One query token against S paged keys.

    q [H, hd] (rotated; in rolling mode: against window keys); k_pool, v_pool [num_slots, KVH, hd] (a layer's
    pages flattened); slots [S] int (flat slot of each key, sinks first); k_pos [S] int absolute positions;
    q_pos [1] int. Rolling mode (`q_sink` given): keys are unrotated, `q_sink` [H, hd] is the query rotated
    against its sinks, `base` [1] the oldest window key's position, `inv_freq` [hd/2] fp32. `sink_logits`
    [H]: learned per-head attention sinks. Returns [H * hd] in q's dtype.
    """
    check_tensor("q", q, dims=2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    h, hd = q.shape
    kvh = check_paged(q, h, hd, k_pool, v_pool, slots, k_pos, q_pos, 1)
    n = slots.shape[0]
    rolling = q_sink is not None
    if rolling:
        check_tensor("q_sink", q_sink, shape=(h, hd), dtypes=(q.dtype,), device=q.device)
        check_tensor("base", base, shape=(1,), dtypes=(torch.int32, torch.int64), device=q.device)
        check_tensor("inv_freq", inv_freq, shape=(hd // 2,), dtypes=(torch.float32,), device=q.device)
        if window is None:
            raise ValueError("rolling attention needs a window")
    if sink_logits is not None:
        check_tensor("sink_logits", sink_logits, shape=(h,), device=q.device)
    if n == 0:
        raise ValueError("slots is empty: a decode step attends at least to its own key")
    group = h // kvh
    cfg = launch_config("decode_attention", q.device, q.dtype, f"H{h}_KVH{kvh}_hd{hd}")
    block_n = block_n or cfg["block_n"]
    splits = max(1, min(64, math.ceil(n / cfg["keys_per_split"])))  # a split takes at least keys_per_split
    per_split = math.ceil(math.ceil(n / splits) / block_n) * block_n
    splits = math.ceil(n / per_split)
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot wants >= 16 rows
    block_half = max(16, triton.next_power_of_2(hd // 2))
    o = torch.empty(kvh, splits, block_g, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(kvh, splits, block_g, dtype=torch.float32, device=q.device)
    q = q.contiguous()
    dummy = q_pos
    _decode_attn_kernel[(kvh, splits)](
        q, q_sink.contiguous() if rolling else q, k_pool, v_pool, slots.contiguous(), k_pos.contiguous(), q_pos,
        base if rolling else dummy, inv_freq if rolling else q, o, lse, n, per_split, scale, rope_scaling,
        sliding or 0, sinks, window or 0, KVH=kvh, G=group, HALF=hd // 2, BLOCK_G=block_g,
        BLOCK_HALF=block_half, BLOCK_N=block_n, ROLLING=rolling, SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")  # fp32 stays exact; 16-bit uses tensor cores
    # merge the splits by log-sum-exp (no host sync): [KVH, splits, G] -> [H]
    lse, o = lse[:, :, :group], o[:, :, :group]
    lse = lse.permute(0, 2, 1).reshape(h, splits)  # [H, splits]
    o = o.permute(0, 2, 1, 3).reshape(h, splits, hd)
    if sink_logits is not None:  # a learned sink: one more term in the softmax denominator, no value
        lse = torch.cat([lse, sink_logits.float()[:, None]], dim=1)
        o = torch.cat([o, o.new_zeros(h, 1, hd)], dim=1)
    w = torch.softmax(lse, dim=1)  # [H, splits(+1)]
    return (w[:, :, None] * o).sum(1).to(q.dtype).reshape(h * hd)
