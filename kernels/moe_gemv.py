"""MoE for a few tokens (decode, draft verification): gather + gemv, no sort, no padding, no host sync.

Two kernels:
1. `_gate_up_kernel`, grid (T * k, cdiv(INTER, BLOCK_I)): one program per (token, expert slot) pair and block
   of the intermediate dimension reads its expert id on the device, computes the gate and up rows
   against x[t] and writes silu(gate) * up in fp32 to a scratch `h [T * k, INTER]`.
2. `_down_kernel`, grid (T, cdiv(D, BLOCK_D)): one program per output block loops over the token's k
   experts, applies the routing weight in fp32 and writes the output once.
Weights are read in place (never copied); top-k ids never leave the device, so the step can be captured
in a CUDA graph. int8 weights carry one fp32 scale per output channel (`quantize_int8`).
Reference: `streamserve.kernels.reference.moe_experts_gather`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamserve.kernels.checks import check_tensor
from streamserve.kernels.launch_config import launch_config

MAX_TOKENS = 16
MAX_TOP_K = 8
MAX_EXPERTS = 256


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, scale_ptr, h_ptr, D, INTER, K: tl.constexpr,
                    BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    pair = tl.program_id(0)  # token * K + slot
    ib = tl.program_id(1)
    t = pair // K
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = ib * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] rows of the gate half
    row_ok = rows < INTER
    gate = tl.zeros((BLOCK_I,), dtype=tl.float32)
    up = tl.zeros((BLOCK_I,), dtype=tl.float32)
    w_e = w_ptr + e * (2 * INTER) * D  # w_gate_up[e]: [2I, D], gate rows first
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        xv = tl.load(x_ptr + t * D + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
        m = row_ok[:, None] & col_ok[None, :]
        wg = tl.load(w_e + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(w_e + (rows[:, None] + INTER) * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        gate += tl.sum(wg * xv[None, :], axis=1)
        up += tl.sum(wu * xv[None, :], axis=1)
    if QUANT:  # int8 weights: one fp32 scale per output channel, applied once to the finished sums
        gate *= tl.load(scale_ptr + e * (2 * INTER) + rows, mask=row_ok, other=0.0)
        up *= tl.load(scale_ptr + e * (2 * INTER) + INTER + rows, mask=row_ok, other=0.0)
    h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up, in registers
    tl.store(h_ptr + pair * INTER + rows, h, mask=row_ok)


@triton.jit
def _down_kernel(h_ptr, ids_ptr, rw_ptr, w_ptr, scale_ptr, out_ptr, D, INTER, K: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr, QUANT: tl.constexpr):
    t = tl.program_id(0)
    db = tl.program_id(1)
    rows = db * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] output features
    row_ok = rows < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(K):
        e = tl.load(ids_ptr + t * K + j).to(tl.int64)
        rw = tl.load(rw_ptr + t * K + j)  # routing weight, fp32
        w_e = w_ptr + e * D * INTER  # w_down[e]: [D, INTER]
        part = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for i0 in range(0, INTER, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            col_ok = cols < INTER
            hv = tl.load(h_ptr + (t * K + j) * INTER + cols, mask=col_ok, other=0.0)  # [BLOCK_I] fp32
            w = tl.load(w_e + rows[:, None] * INTER + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            part += tl.sum(w * hv[None, :], axis=1)
        if QUANT:
            part *= tl.load(scale_ptr + e * D + rows, mask=row_ok, other=0.0)
        acc += rw * part
    tl.store(out_ptr + t * D + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


def moe_gemv(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
             w_down: torch.Tensor, block_i: int | None = None, block_d: int | None = None,
             out: torch.Tensor | None = None,
             scale_gate_up: torch.Tensor | None = None, scale_down: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D]; weights [T, k] fp32; ids [T, k] int32/int64; w_gate_up [E, 2I, D]; w_down [E, D, I] -> [T, D].

    T <= 16, k <= 8, E <= 256; D and I of any size (masked tails). Weights in fp32/fp16/bf16, or int8 with
    per-output-channel fp32 scales `scale_gate_up` [E, 2I] and `scale_down` [E, D]; accumulation in fp32,
    output in x's dtype.
    """
    check_tensor("x", x, dims=2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    t, d = x.shape
    check_tensor("w_gate_up", w_gate_up, dims=3, dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.int8),
                 device=x.device, contiguous=True)
    e, two_i, d_w = w_gate_up.shape
    inter = two_i // 2
    if d_w != d or two_i % 2:
        raise ValueError(f"w_gate_up has shape {list(w_gate_up.shape)}; expected [E, 2*I, {d}] for x [T, {d}]")
    check_tensor("w_down", w_down, shape=(e, d, inter), dtypes=(w_gate_up.dtype,), device=x.device, contiguous=True)
    quant = w_gate_up.dtype == torch.int8
    if quant:
        check_tensor("scale_gate_up", scale_gate_up, shape=(e, two_i), dtypes=(torch.float32,), device=x.device,
                     contiguous=True)
        check_tensor("scale_down", scale_down, shape=(e, d), dtypes=(torch.float32,), device=x.device,
                     contiguous=True)
    elif scale_gate_up is not None or scale_down is not None:
        raise ValueError("scale_gate_up / scale_down go with int8 weights only")
    check_tensor("ids", ids, dims=2, dtypes=(torch.int32, torch.int64), device=x.device)
    k = ids.shape[1]
    check_tensor("ids", ids, shape=(t, k))
    check_tensor("weights", weights, shape=(t, k), dtypes=(torch.float32,), device=x.device)
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"moe_gemv takes 1..{MAX_TOKENS} tokens, got {t}; use the grouped path for more")
    if not 1 <= k <= MAX_TOP_K or e > MAX_EXPERTS:
        raise ValueError(f"moe_gemv supports top-k <= {MAX_TOP_K} and E <= {MAX_EXPERTS}, got k={k}, E={e}")
    cfg = launch_config("moe_gemv", x.device, w_gate_up.dtype, f"D{d}_I{inter}")
    block_i, block_d = block_i or cfg["block_i"], block_d or cfg["block_d"]
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    h = torch.empty(t * k, inter, dtype=torch.float32, device=x.device)
    if out is None:
        out = torch.empty_like(x)
    check_tensor("out", out, shape=(t, d), dtypes=(x.dtype,), device=x.device, contiguous=True)
    _gate_up_kernel[(t * k, triton.cdiv(inter, block_i))](x, ids, w_gate_up, scale_gate_up if quant else weights, h,
                                                           d, inter, K=k, BLOCK_I=block_i, BLOCK_D=block_d,
                                                           QUANT=quant)
    _down_kernel[(t, triton.cdiv(d, block_d))](h, ids, weights, w_down, scale_down if quant else weights, out, d,
                                               inter, K=k, BLOCK_D=block_d, BLOCK_I=block_i, QUANT=quant)
    return out


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w [E, N, K] -> (q int8 [E, N, K], scale fp32 [E, N]), w ~ q * scale."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(w.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale
