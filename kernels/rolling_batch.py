"""Several rolling-position sessions' attention in one call (the torch reference): what `paged_attention_rolling`
gives each session alone, for a step of a few tokens per session (robots: a state chunk, a drafted chunk, a decode).

One session at a time, a step of B robots cost B rounds of small ops per layer, and a host sync each (the count of
sink keys). Here the B sessions' queries and keys are padded to the most of each (`RollingBatch`, built once per
step and shared by every layer of a layer group and RoPE kind), their rotations made in one go from positions
(`rolling_batch_rope`), and every key is scored both ways (against window keys, and against sinks from the query's
place in its own cache), keeping the right one: no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from streamserve.kernels.reference import rope_cos_sin


class RollingBatch(NamedTuple):
    """B rolling sessions' queries and keys, padded. Padding keys have position `no_position` (past every query:
    masked as future keys, never a sink); a padding query repeats its session's last one."""

    q_rows: torch.Tensor  # [B, Tq] int64 row of each query in the step's q [N, H, hd]
    q_pos: torch.Tensor  # [B, Tq] int64 its absolute position
    slots: torch.Tensor  # [B, S] int64 flat slots of the keys each session may read, sinks first
    k_pos: torch.Tensor  # [B, S] int64 their absolute positions
    sinks: torch.Tensor  # [B] int64 each session's sink count
    window: torch.Tensor  # [B] int64 each session's window
    out_rows: torch.Tensor  # [M] int64 the real queries' rows in the padded output [B * Tq], session by session
    k_cos: torch.Tensor  # [B, S, hd] per key: a sink by its index, a window key by its distance from the oldest
    k_sin: torch.Tensor
    q_cos: torch.Tensor  # [B, Tq, hd] per query against window keys: p - the oldest window key
    q_sin: torch.Tensor
    qs_cos: torch.Tensor  # [B, Tq, hd] per query against sinks: its place in its cache, min(p, sinks + window - 1)
    qs_sin: torch.Tensor


def rolling_batch_rope(q_pos: torch.Tensor, k_pos: torch.Tensor, sinks: torch.Tensor, window: torch.Tensor,
                       inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype, no_position: int
                       ) -> tuple[torch.Tensor, ...]:
    """q_pos [B, Tq], k_pos [B, S] absolute (padding keys at `no_position`), sinks, window [B] -> the rotations of
    `RollingBatch` (k_cos, k_sin, q_cos, q_sin, qs_cos, qs_sin), each session's as `reference.rolling_rope`."""
    b, s = k_pos.shape
    tq = q_pos.shape[1]
    is_sink = k_pos < sinks[:, None]
    pad = k_pos >= no_position
    big = torch.iinfo(k_pos.dtype).max
    base = torch.where(is_sink | pad, big, k_pos).min(dim=1).values  # [B] the oldest window key
    base = torch.where(base == big, 0, base)
    kp = torch.where(pad, 0, torch.where(is_sink, k_pos, k_pos - base[:, None]))
    kc, ks = rope_cos_sin(kp.reshape(-1), inv_freq, scaling, dtype)
    qc, qs = rope_cos_sin((q_pos - base[:, None]).reshape(-1), inv_freq, scaling, dtype)
    cache_end = (sinks + window - 1)[:, None]
    sc, ss = rope_cos_sin(torch.minimum(q_pos, cache_end).reshape(-1), inv_freq, scaling, dtype)
    hd = kc.shape[-1]
    return (kc.view(b, s, hd), ks.view(b, s, hd), qc.view(b, tq, hd), qs.view(b, tq, hd), sc.view(b, tq, hd),
            ss.view(b, tq, hd))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, n_heads, hd], cos/sin [B, T, hd] -> rotated (rotate-half, as reference.apply_rope)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def paged_attention_rolling_batch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: RollingBatch,
                                  scale: float, sliding: int | None = None) -> torch.Tensor:
    """Several rolling sessions' queries in one call: q [N, H, hd] unrotated, pools [num_pages * P, KVH, hd] (keys
    cached before RoPE) -> [M, H * hd] for the M real queries, each as `paged_attention_rolling` gives it alone."""
    b, tq = batch.q_rows.shape
    h, hd = q.shape[1:]
    kvh, s = k_pool.shape[1], batch.slots.shape[1]
    g = h // kvh
    qb = q.index_select(0, batch.q_rows.reshape(-1)).view(b, tq, h, hd)
    k = k_pool.index_select(0, batch.slots.reshape(-1)).view(b, s, kvh, hd)
    v = v_pool.index_select(0, batch.slots.reshape(-1)).view(b, s, kvh, hd).transpose(1, 2)  # [B, KVH, S, hd]
    kt = _rope(k, batch.k_cos, batch.k_sin).permute(0, 2, 3, 1).float()  # [B, KVH, hd, S]

    def grouped(x: torch.Tensor) -> torch.Tensor:  # [B, Tq, H, hd] -> [B, KVH, G*Tq, hd]
        return x.view(b, tq, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * tq, hd).float()

    window_scores = grouped(_rope(qb, batch.q_cos, batch.q_sin)) @ kt  # [B, KVH, G*Tq, S]
    sink_scores = grouped(_rope(qb, batch.qs_cos, batch.qs_sin)) @ kt
    qp, kp = batch.q_pos[:, :, None], batch.k_pos[:, None, :]  # [B, Tq, 1], [B, 1, S]
    sinks, window = batch.sinks[:, None, None], batch.window[:, None, None]
    is_sink = kp < sinks  # [B, 1, S]
    scores = torch.where(is_sink[:, None], sink_scores, window_scores) * scale  # [B, KVH, G*Tq, S]
    mask = (kp <= qp) & (is_sink | (kp > qp - window))  # [B, Tq, S]
    if sliding is not None:  # the model's own window counts distances inside the query's cache
        cq = torch.minimum(qp, sinks + window - 1)
        mask &= torch.where(is_sink, cq - kp, qp - kp) < sliding
    scores = scores.view(b, kvh, g, tq, s).masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, kvh, g * tq, s)
    out = (probs @ v).view(b, kvh, g, tq, hd).permute(0, 3, 1, 2, 4)  # [B, Tq, KVH, G, hd]
    return out.reshape(b * tq, h * hd).index_select(0, batch.out_rows)
