"""Append attention: a chunk of T new queries against the session's paged `[sinks | window]` keys, which
include the chunk's own (causal inside the chunk).

Grid (KVH, cdiv(T * G, BLOCK_M)): a program takes one KV head and a block of rows, a row being one
(query token, query head of that KV head) pair, and streams the session's key slots through an online
softmax, reading keys and values from their pages in place. Masking and rolling-mode rotations are
those of `decode_attention` (the mask per row, from that row's query position).
Reference: `reference.attention` / `reference.attention_rolling`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamserve.kernels.attention_common import _rotate_keys, _scores, _softmax_step
from streamserve.kernels.checks import check_paged, check_tensor
from streamserve.kernels.launch_config import launch_config


@triton.jit
def _append_attn_kernel(q_ptr, qs_ptr, k_ptr, v_ptr, slots_ptr, kpos_ptr, qpos_ptr, base_ptr, inv_freq_ptr,
                        o_ptr, T, S, scale, rope_scaling, sliding, sinks, window,
                        KVH: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_HALF: tl.constexpr, BLOCK_N: tl.constexpr, ROLLING: tl.constexpr,
                        PRECISION: tl.constexpr):
    kvh = tl.program_id(0)
    mb = tl.program_id(1)
    HD: tl.constexpr = 2 * HALF
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # rows: token * G + head-in-group
    m_ok = m < T * G
    t = m // G
    head = kvh * G + m % G
    dh = tl.arange(0, BLOCK_HALF)
    d_ok = dh < HALF
    qm = m_ok[:, None] & d_ok[None, :]
    q_row = (t * (KVH * G) + head) * HD  # q [T, H, hd]
    q1 = tl.load(q_ptr + q_row[:, None] + dh[None, :], mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + q_row[:, None] + HALF + dh[None, :], mask=qm, other=0.0).to(tl.float32)
    if ROLLING:
        qs1 = tl.load(qs_ptr + q_row[:, None] + dh[None, :], mask=qm, other=0.0).to(tl.float32)
        qs2 = tl.load(qs_ptr + q_row[:, None] + HALF + dh[None, :], mask=qm, other=0.0).to(tl.float32)
        base = tl.load(base_ptr)
        inv_freq = tl.load(inv_freq_ptr + dh, mask=d_ok, other=0.0)
    qpos = tl.load(qpos_ptr + t, mask=m_ok, other=0)  # [BLOCK_M]
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    for n0 in range(0, S, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < S
        slot = tl.load(slots_ptr + n, mask=n_ok, other=0).to(tl.int64)
        kpos = tl.load(kpos_ptr + n, mask=n_ok, other=0)
        row = (slot * KVH + kvh) * HD
        km = n_ok[:, None] & d_ok[None, :]
        k1 = tl.load(k_ptr + row[:, None] + dh[None, :], mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(k_ptr + row[:, None] + HALF + dh[None, :], mask=km, other=0.0).to(tl.float32)
        dist = qpos[:, None] - kpos[None, :]  # [BLOCK_M, BLOCK_N]
        if ROLLING:
            is_sink = kpos < sinks
            k1, k2 = _rotate_keys(k1, k2, kpos, sinks, base, inv_freq, rope_scaling)
            scores = tl.where(is_sink[None, :], _scores(qs1, qs2, k1, k2, PRECISION),
                              _scores(q1, q2, k1, k2, PRECISION))
            cq = tl.minimum(qpos, sinks + window - 1)
            dist = tl.where(is_sink[None, :], cq[:, None] - kpos[None, :], dist)
        else:
            scores = _scores(q1, q2, k1, k2, PRECISION)
        ok = n_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        ok = ok & ((sliding == 0) | (dist < sliding))
        ok = ok & ((window == 0) | (kpos[None, :] < sinks) | (kpos[None, :] > qpos[:, None] - window))
        scores = tl.where(ok, scores * scale, float("-inf"))
        v1 = tl.load(v_ptr + row[:, None] + dh[None, :], mask=km, other=0.0).to(tl.float32)
        v2 = tl.load(v_ptr + row[:, None] + HALF + dh[None, :], mask=km, other=0.0).to(tl.float32)
        m_i, l_i, acc1, acc2 = _softmax_step(scores, m_i, l_i, acc1, acc2, v1, v2, PRECISION)
    inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    out = o_ptr + q_row[:, None] + dh[None, :]
    tl.store(out, (acc1 * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=qm)
    tl.store(out + HALF, (acc2 * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=qm)


def append_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                     k_pos: torch.Tensor, q_pos: torch.Tensor, scale: float, sliding: int | None = None,
                     sinks: int = 0, window: int | None = None, q_sink: torch.Tensor | None = None,
                     base: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                     rope_scaling: float = 1.0, block_m: int | None = None,
                     block_n: int | None = None) -> torch.Tensor:
    """q [T, H, hd] (rotated; rolling: against window keys) at positions q_pos [T]; k_pool, v_pool
    [num_slots, KVH, hd]; slots, k_pos [S] (sinks first, the chunk's own keys included). Rolling mode as
    in `decode_attention` (`q_sink` [T, H, hd], `base` [1], `inv_freq` [hd/2]). Returns [T, H * hd]."""
    check_tensor("q", q, dims=3, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    t, h, hd = q.shape
    kvh = check_paged(q, h, hd, k_pool, v_pool, slots, k_pos, q_pos, t)
    rolling = q_sink is not None
    if rolling:
        check_tensor("q_sink", q_sink, shape=(t, h, hd), dtypes=(q.dtype,), device=q.device)
        check_tensor("base", base, shape=(1,), dtypes=(torch.int32, torch.int64), device=q.device)
        check_tensor("inv_freq", inv_freq, shape=(hd // 2,), dtypes=(torch.float32,), device=q.device)
        if window is None:
            raise ValueError("rolling attention needs a window")
    group = h // kvh
    cfg = launch_config("append_attention", q.device, q.dtype, f"H{h}_KVH{kvh}_hd{hd}")
    block_m, block_n = block_m or cfg["block_m"], block_n or cfg["block_n"]
    q = q.contiguous()
    out = torch.empty_like(q)
    _append_attn_kernel[(kvh, triton.cdiv(t * group, block_m))](
        q, q_sink.contiguous() if rolling else q, k_pool, v_pool, slots.contiguous(), k_pos.contiguous(),
        q_pos.contiguous(), base if rolling else q_pos, inv_freq if rolling else q, out, t, slots.shape[0], scale,
        rope_scaling, sliding or 0, sinks, window or 0, KVH=kvh, G=group, HALF=hd // 2, BLOCK_M=block_m,
        BLOCK_HALF=max(16, triton.next_power_of_2(hd // 2)), BLOCK_N=block_n, ROLLING=rolling,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out.reshape(t, h * hd)
