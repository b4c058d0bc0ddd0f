"""The Triton implementations of the op table's entries, with the torch reference where no kernel pays yet.

Importing this module imports triton; on a CPU, set TRITON_INTERPRET=1 before (the op layer does).
"""

from __future__ import annotations

import torch

from streamserve.kernels import reference as ref
from streamserve.kernels.append_attention import append_attention
from streamserve.kernels.batch_attention import batch_attention
from streamserve.kernels.decode_attention import decode_attention
from streamserve.kernels.elementwise import add_rms_norm, apply_rope, gelu_tanh_mul, rms_norm, silu_mul
from streamserve.kernels.launch_config import launch_config
from streamserve.kernels.moe_gemv import MAX_EXPERTS, MAX_TOKENS, MAX_TOP_K, moe_gemv

__all__ = ["add_rms_norm", "apply_rope", "batch_attention", "gelu_tanh_mul", "moe_experts", "paged_attention",
           "paged_attention_rolling",
           "rms_norm", "silu_mul"]


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> [T, D]: gather + gemv up to the measured crossover (launch.json "moe_dispatch", at most
    16 tokens; benchmarks/gpu_check.py --write-configs measures it), the grouped path beyond."""
    t, k = ids.shape
    fits = t <= MAX_TOKENS and k <= MAX_TOP_K and w_gate_up.shape[0] <= MAX_EXPERTS
    crossover = launch_config("moe_dispatch", x.device, w_gate_up.dtype, "any")["gemv_max_tokens"]
    # inside a CUDA-graph capture only sync-free paths may run: moe_gemv, else the gather reference
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if fits and (t <= crossover or capturing):
        return moe_gemv(x, weights, ids.to(torch.int32), w_gate_up, w_down)
    if capturing:
        return ref.moe_experts_gather(x, weights, ids, w_gate_up, w_down)
    return ref.moe_experts_grouped(x, weights, ids, w_gate_up, w_down)


def paged_attention(q: torch.Tensor, paged: ref.PagedKeys, q_pos: torch.Tensor, scale: float,
                    sliding: int | None = None, sinks: int = 0, window: int | None = None) -> torch.Tensor:
    """q [T, H, hd] -> [T, H * hd]: split-KV decode for one token, append attention for a chunk."""
    if q.shape[0] == 1:
        return decode_attention(q[0], paged.k_pool, paged.v_pool, paged.slots, paged.k_pos, q_pos, scale, sliding,
                                sinks, window)[None]
    return append_attention(q, paged.k_pool, paged.v_pool, paged.slots, paged.k_pos, q_pos, scale, sliding, sinks,
                            window)


def paged_attention_rolling(q: torch.Tensor, paged: ref.PagedKeys, q_pos: torch.Tensor, rope: ref.RollingRope,
                            scale: float, sinks: int, window: int, sliding: int | None = None) -> torch.Tensor:
    """Rolling positions: the query rotated both ways here, the keys in the kernel's registers."""
    q_win = ref.apply_rope(q, rope.q_cos, rope.q_sin)
    q_sink = ref.apply_rope(q, rope.qs_cos, rope.qs_sin)
    base = rope.base.reshape(1)
    if q.shape[0] == 1:
        return decode_attention(q_win[0], paged.k_pool, paged.v_pool, paged.slots, paged.k_pos, q_pos, scale,
                                sliding, sinks, window, q_sink=q_sink[0], base=base, inv_freq=rope.inv_freq,
                                rope_scaling=rope.scaling)[None]
    return append_attention(q_win, paged.k_pool, paged.v_pool, paged.slots, paged.k_pos, q_pos, scale, sliding,
                            sinks, window, q_sink=q_sink, base=base, inv_freq=rope.inv_freq,
                            rope_scaling=rope.scaling)
