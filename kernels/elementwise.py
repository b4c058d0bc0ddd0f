"""Small fused row ops: RMSNorm, residual add + RMSNorm, SiLU·mul and GELU(tanh)·mul, RoPE. One program per row
(per row block for the gated activations); fp32 math.

References: `reference.rms_norm`, `reference.add_rms_norm`, `reference.silu_mul`, `reference.gelu_tanh_mul`,
`reference.apply_rope`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamserve.kernels.checks import check_tensor

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, N, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:  # the residual stream: x + delta, kept in the input dtype like an unfused add
        x = (x + tl.load(delta_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * N + cols, x, mask=ok)
        x = x.to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    y = x * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (y.to(out_ptr.dtype.element_ty).to(tl.float32) * w).to(out_ptr.dtype.element_ty),
             mask=ok)


GELU_TANH_C = 0.7978845608028654  # sqrt(2 / pi)


@triton.jit
def _gated_kernel(gu_ptr, out_ptr, N, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(gu_ptr + row * 2 * N + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * N + N + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(a)) = g * sigmoid(2a), a = sqrt(2/pi) (g + 0.044715 g^3): no tanh needed
        a = GELU_TANH_C * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(a))  # in (0, 1]: never overflows, whatever the gate's size
        act = g * tl.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    else:
        act = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + row * N + cols, (act * u).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, HEADS, HALF: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # token * HEADS + head
    t = row // HEADS
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    x1 = tl.load(x_ptr + row * 2 * HALF + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + row * 2 * HALF + HALF + d, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + t * 2 * HALF + d, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * 2 * HALF + HALF + d, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * 2 * HALF + d, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * 2 * HALF + HALF + d, mask=ok, other=0.0).to(tl.float32)
    out = out_ptr + row * 2 * HALF + d
    tl.store(out, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + HALF, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(name: str, x: torch.Tensor, n: int) -> torch.Tensor:
    check_tensor(name, x, dtypes=FLOATS)
    if x.shape[-1] != n:
        raise ValueError(f"{name} has last dimension {x.shape[-1]}, expected {n}")
    return x.contiguous().view(-1, n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n], weight [n] -> [..., n] in x's dtype."""
    check_tensor("weight", weight, dims=1, dtypes=FLOATS, device=x.device)
    n = weight.shape[0]
    rows = _rows("x", x, n)
    out = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, rows, out, n, eps, ADD=False,
                                       BLOCK=triton.next_power_of_2(n))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., n] -> (x + delta, rms_norm(x + delta)), one pass over the row."""
    check_tensor("weight", weight, dims=1, dtypes=FLOATS, device=x.device)
    n = weight.shape[0]
    rows, drows = _rows("x", x, n), _rows("delta", delta, n)
    if drows.shape != rows.shape:
        raise ValueError(f"delta has shape {list(delta.shape)}, expected {list(x.shape)}")
    total, out = torch.empty_like(rows), torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, drows, weight, total, out, n, eps, ADD=True,
                                       BLOCK=triton.next_power_of_2(n))
    return total.view(x.shape), out.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> silu(gate) * up [..., I]."""
    return _gated(gate_up, gelu=False)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> gelu_tanh(gate) * up [..., I] (GeGLU)."""
    return _gated(gate_up, gelu=True)


def _gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    check_tensor("gate_up", gate_up, dtypes=FLOATS)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up has an odd last dimension {gate_up.shape[-1]}; expected [..., 2*I]")
    n = gate_up.shape[-1] // 2
    rows = gate_up.contiguous().view(-1, 2 * n)
    out = torch.empty(rows.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _gated_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, n, GELU=gelu, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, n_heads, hd], cos/sin [T, hd] -> [T, n_heads, hd] (rotate-half convention)."""
    check_tensor("x", x, dims=3, dtypes=FLOATS)
    t, heads, hd = x.shape
    if hd % 2:
        raise ValueError(f"x has an odd head dim {hd}; RoPE needs an even one")
    check_tensor("cos", cos, shape=(t, hd), device=x.device)
    check_tensor("sin", sin, shape=(t, hd), device=x.device)
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)
    _rope_kernel[(t * heads,)](x, cos, sin, out, heads, HALF=hd // 2, BLOCK=triton.next_power_of_2(hd // 2))
    return out
