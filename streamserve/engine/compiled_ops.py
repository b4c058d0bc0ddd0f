"""The op table of compiled CPU decode steps (engine/compiled.py): the torch references, with attention written as
matmul + masked softmax + matmul.

Inductor fuses these into its own C++ kernels; the references' `scaled_dot_product_attention` stays an extern call
that costs ~100 us a layer for one query on this CPU (the issue 16 spike: a SmolLM2 step 17.2 ms compiled with
SDPA, 14.8 ms with this form). Rolling attention scores every key both as a sink and as a window key and keeps the
right one (the reference counts the sinks on the host: a data-dependent slice no graph can hold). Same masks,
same GQA grouping, fp32 softmax: the eager references' numbers up to rounding.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from streamserve.kernels import reference as ref
from streamserve.models.ops import TORCH_OPS, Ops


def _grouped(x: torch.Tensor, kvh: int) -> torch.Tensor:
    """q [T, H, hd] -> [KVH, G*T, hd] (rows (g, t)): GQA without copies of K/V."""
    t, h, hd = x.shape
    return x.view(t, kvh, h // kvh, hd).permute(1, 2, 0, 3).reshape(kvh, (h // kvh) * t, hd)


def _softmax_out(scores: torch.Tensor, mask: torch.Tensor, v: torch.Tensor, t: int) -> torch.Tensor:
    """scores [KVH, G*T, S] (scaled), mask [T, S], v [KVH, S, hd] -> [T, H * hd]."""
    kvh, gt, s = scores.shape
    g = gt // t
    scores = scores.float().view(kvh, g, t, s).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(kvh, gt, s)
    out = (probs @ v).view(kvh, g, t, -1).permute(2, 0, 1, 3)  # [T, KVH, G, hd]
    return out.reshape(t, -1)


def paged_attention(q: torch.Tensor, paged: ref.PagedKeys, q_pos: torch.Tensor, scale: float,
                    sliding: int | None = None, sinks: int = 0, window: int | None = None) -> torch.Tensor:
    """`ref.paged_attention`: q [T, H, hd] (RoPE applied) -> [T, H * hd]."""
    k, v = ref.gather(paged)  # [KVH, S, hd]
    mask = ref.visible(q_pos, paged.k_pos, sliding, sinks, window)  # [T, S]
    scores = (_grouped(q, k.shape[0]).float() @ k.float().transpose(1, 2)) * scale  # [KVH, G*T, S]
    return _softmax_out(scores, mask, v, q.shape[0])


def paged_attention_rolling(q: torch.Tensor, paged: ref.PagedKeys, q_pos: torch.Tensor, rope: ref.RollingRope,
                            scale: float, sinks: int, window: int, sliding: int | None = None) -> torch.Tensor:
    """`ref.paged_attention_rolling` (keys cached before RoPE): q [T, H, hd] unrotated -> [T, H * hd]."""
    k, v = ref.gather(paged)
    kvh = k.shape[0]
    k_rot = ref.apply_rope(k.transpose(0, 1), rope.k_cos, rope.k_sin).transpose(0, 1).float()  # [KVH, S, hd]
    scores = _grouped(ref.apply_rope(q, rope.q_cos, rope.q_sin), kvh).float() @ k_rot.transpose(1, 2)
    # against its sinks the query sits at its place in its own cache: every key scored both ways, no host sync
    sink_scores = _grouped(ref.apply_rope(q, rope.qs_cos, rope.qs_sin), kvh).float() @ k_rot.transpose(1, 2)
    scores = torch.where(paged.k_pos < sinks, sink_scores, scores) * scale
    mask = ref.rolling_visible(q_pos, paged.k_pos, sinks, window, sliding)
    return _softmax_out(scores, mask, v, q.shape[0])


def paged_attention_batch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ref.AttentionBatch,
                          scale: float, sliding: int | None = None) -> torch.Tensor:
    """`ref.paged_attention_batch`: q [N, H, hd], pools [num_pages * P, KVH, hd] -> [M, H * hd]."""
    b, tq = batch.q_rows.shape
    h, hd = q.shape[1:]
    kvh, s = k_pool.shape[1], batch.slots.shape[1]
    g = h // kvh
    qb = q.index_select(0, batch.q_rows.reshape(-1)).view(b, tq, kvh, g, hd).permute(0, 2, 3, 1, 4)
    k = k_pool.index_select(0, batch.slots.reshape(-1)).view(b, s, kvh, hd).transpose(1, 2)  # [B, KVH, S, hd]
    v = v_pool.index_select(0, batch.slots.reshape(-1)).view(b, s, kvh, hd).transpose(1, 2)
    qp, kp = batch.q_pos[:, :, None], batch.k_pos[:, None, :]
    mask = (kp <= qp) & ((kp < batch.sinks[:, None, None]) | (kp > qp - batch.window[:, None, None]))  # [B, Tq, S]
    if sliding is not None:
        mask &= kp > qp - sliding
    scores = (qb.reshape(b, kvh, g * tq, hd).float() @ k.float().transpose(-1, -2)) * scale  # [B, KVH, G*Tq, S]
    scores = scores.view(b, kvh, g, tq, s).masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, kvh, g * tq, s)
    out = (probs @ v).view(b, kvh, g, tq, hd).permute(0, 3, 1, 2, 4)  # [B, Tq, KVH, G, hd]
    return out.reshape(b * tq, h * hd).index_select(0, batch.out_rows)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
    """`ref.moe_experts_gather` (no host sync: the eager CPU paths read the ids on the host, which no graph holds)
    written as products and sums, so that Inductor reads each chosen expert's rows where they are, inside its own
    loops, where a bmm would first copy them. x [T, D]; weights [T, k] fp32; ids [T, k]; w_gate_up [E, 2I, D];
    w_down [E, D, I] -> [T, D]."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)  # [T*k, D]
    h = ref.silu_mul((w_gate_up.index_select(0, flat) * xs.unsqueeze(1)).sum(-1))  # [T*k, I]
    y = (w_down.index_select(0, flat) * h.unsqueeze(1)).sum(-1)  # [T*k, D]
    return (y.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)


COMPILED_CPU_OPS: Ops = replace(TORCH_OPS, name="torch-compiled", attention=paged_attention,
                                attention_rolling=paged_attention_rolling, attention_batch=paged_attention_batch,
                                attention_rolling_batch=None,  # compiled steps keep one rolling call per session
                                moe_experts=moe_experts)
