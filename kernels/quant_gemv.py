"""Dense linear layers on weight-only quantized weights for a few rows (decode, draft verification): the weights
stay quantized in memory and each weight byte is read once per call, whatever the number of rows (1..16).

Storage (what `streamserve.models.quant` hands over; `group` divides K, G = K // group):
- int8: `qweight` int8 [N, K], `scale` fp32 [N, G]; w[n, k] = qweight[n, k] * scale[n, k // group]. Per output
  channel is group = K (G = 1).
- int4: `qweight` uint8 [N, K // 2], byte j of row n holds k = 2j in its low nibble and k = 2j + 1 in its high
  nibble (codes 0..15); `scale`, `zero` fp32 [N, G]; w[n, k] = (code - 8) * scale[n, k // group] + zero[...].

Kernel `_quant_gemv_kernel`, grid (cdiv(N, BLOCK_N), SPLIT_K): one program per block of output channels and slice
of K. It streams its [BLOCK_N, BLOCK_K] weight tiles once and multiplies them against all M rows of x (x is tiny
and stays in cache). A K tile never straddles a scale group, so the raw codes (exact in TF32 and fp32) go into
the product and the scale is applied to the tile's fp32 partial sums:
    sum_k x[k] w[k] = scale * sum_k x[k] (code[k] - 8) + zero * sum_k x[k]        (int4; int8 has no zero)
One row (M = 1) is a broadcast multiply + row sum (a plain GEMV); 2..16 rows pad to 16 and use `tl.dot` on fp32
operands with fp32 accumulation: TF32 tensor cores for bf16/fp16 x (exact there: bf16/fp16 values and the codes
fit TF32's 10-bit mantissa), IEEE fp32 for fp32 x. (Not bf16 operands: Triton's interpreter mis-handles bf16
`tl.dot` and int->bf16 casts; this way the CPU tests run the GPU's code, bar the interpreter's fp32 matmul.)
With SPLIT_K > 1 (small N, long K: more programs than output blocks) each program writes fp32 partial sums and
`_split_sum_kernel` adds the slices in a fixed order (deterministic, no atomics), adds the bias and casts. Nothing
syncs with the host: capturable.

Larger batches (prefill) dequantize once with `dequantize` and run a dense matmul; `quant_linear` refuses them.
Reference: `quant_linear_reference` (pure torch, any M).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from streamserve.kernels.checks import check_tensor
from streamserve.kernels.launch_config import launch_config

MAX_ROWS = 16
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# Used while launch.json has no "quant_gemv" entry; an entry there (same keys) overrides these.
DEFAULT_CONFIG = {"block_n": 32, "block_k": 128, "split_k": 0}  # split_k 0: choose from the SM count


@triton.jit
def _quant_gemv_kernel(x_ptr, q_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, G, group, k_per_split,
                       INT4: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                       PARTIAL: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    nb = tl.program_id(0)
    ks = tl.program_id(1)
    rows = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output channels
    row_ok = rows < N
    wrows = rows.to(tl.int64)  # weight row offsets: N * K may pass 2**31 (an int8 lm_head)
    ms = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x (padded to 16 for tl.dot)
    m_ok = ms < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # per-channel int4: sum_k x[m, k], times zero[n] at the end
    k_start = ks * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):  # k_per_split is a multiple of BLOCK_K, BLOCK_K divides group
        if INT4:
            HALF: tl.constexpr = BLOCK_K // 2
            js = k0 // 2 + tl.arange(0, HALF)  # [HALF] byte columns: k = 2j (low nibble), 2j + 1 (high)
            j_ok = js < K // 2
            byte = tl.load(q_ptr + wrows[:, None] * (K // 2) + js[None, :], mask=row_ok[:, None] & j_ok[None, :],
                           other=0).to(tl.int32)  # [BLOCK_N, HALF]
            lo = (byte & 15) - 8  # masked bytes give -8, multiplied by a masked (zero) x
            hi = (byte >> 4) - 8
            xm = m_ok[:, None] & j_ok[None, :]
            xe = tl.load(x_ptr + ms[:, None] * K + 2 * js[None, :], mask=xm, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + ms[:, None] * K + 2 * js[None, :] + 1, mask=xm, other=0.0).to(tl.float32)
            if DOT:  # xe, xo [BLOCK_M, HALF] fp32
                part = tl.dot(xe, tl.trans(lo.to(tl.float32)), input_precision=PRECISION)
                part = tl.dot(xo, tl.trans(hi.to(tl.float32)), part, input_precision=PRECISION)
            else:
                part = tl.sum(lo.to(tl.float32)[None, :, :] * xe[:, None, :] +
                              hi.to(tl.float32)[None, :, :] * xo[:, None, :], axis=2)  # [BLOCK_M, BLOCK_N]
            chunk_xsum = tl.sum(xe + xo, axis=1)  # [BLOCK_M]
        else:
            cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            col_ok = cols < K
            w = tl.load(q_ptr + wrows[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                        other=0)  # [BLOCK_N, BLOCK_K] int8
            xv = tl.load(x_ptr + ms[:, None] * K + cols[None, :], mask=m_ok[:, None] & col_ok[None, :],
                         other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
            if DOT:
                part = tl.dot(xv, tl.trans(w.to(tl.float32)), input_precision=PRECISION)
            else:
                part = tl.sum(w.to(tl.float32)[None, :, :] * xv[:, None, :], axis=2)
            chunk_xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if PER_CHANNEL:  # one scale (and zero) per channel: applied once, after the loop
            acc += part
            xsum += chunk_xsum
        else:
            g = k0 // group
            s = tl.load(scale_ptr + rows * G + g, mask=row_ok, other=0.0)  # [BLOCK_N]
            acc += part * s[None, :]
            if INT4:
                z = tl.load(zero_ptr + rows * G + g, mask=row_ok, other=0.0)
                acc += chunk_xsum[:, None] * z[None, :]
    if PER_CHANNEL:
        acc *= tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[None, :]
        if INT4:
            acc += xsum[:, None] * tl.load(zero_ptr + rows, mask=row_ok, other=0.0)[None, :]
    mask = m_ok[:, None] & row_ok[None, :]
    if PARTIAL:  # fp32 slice ks of the [SPLIT_K, M, N] scratch
        tl.store(out_ptr + ks * M * N + ms[:, None] * N + rows[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + ms[:, None] * N + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_sum_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat (m, n) positions
    ok = idx < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):  # fixed order: the same sum on every call
        acc += tl.load(part_ptr + s * MN + idx, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + idx % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=ok)


def check_quant_weights(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                        group: int) -> tuple[int, int, int]:
    """The storage format above, checked; -> (bits, N, K)."""
    check_tensor("qweight", qweight, dims=2, dtypes=(torch.int8, torch.uint8), contiguous=True)
    bits = 8 if qweight.dtype == torch.int8 else 4
    n, k = qweight.shape[0], qweight.shape[1] * (2 if bits == 4 else 1)
    if n == 0 or k == 0:
        raise ValueError(f"qweight has shape {list(qweight.shape)}; expected at least one row and one column")
    if not isinstance(group, int) or isinstance(group, bool) or group < 1 or k % group:
        raise ValueError(f"group must be a positive int dividing K = {k} (K % group == 0), got {group!r}")
    check_tensor("scale", scale, shape=(n, k // group), dtypes=(torch.float32,), device=qweight.device,
                 contiguous=True)
    if bits == 4:
        if zero is None:
            raise ValueError("int4 weights (uint8 qweight) need a zero tensor [N, K // group]")
        check_tensor("zero", zero, shape=(n, k // group), dtypes=(torch.float32,), device=qweight.device,
                     contiguous=True)
    elif zero is not None:
        raise ValueError("zero goes with int4 weights (uint8 qweight) only; int8 weights are symmetric")
    return bits, n, k


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> torch.Tensor:
    """The stored weights as fp32 [N, K] (pure torch; the path for batches past MAX_ROWS)."""
    bits, n, k = check_quant_weights(qweight, scale, zero, group)
    s = scale.repeat_interleave(group, dim=1)  # [N, K]
    if bits == 8:
        return qweight.float() * s
    codes = torch.stack([qweight & 15, qweight >> 4], dim=2).reshape(n, k)  # [N, K//2, 2] -> low nibble = even k
    return (codes.float() - 8.0) * s + zero.repeat_interleave(group, dim=1)


def quant_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                           group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(...).T + bias -> [M, N] in x's dtype, computed in fp32 (float64 for float64 x)."""
    w = dequantize(qweight, scale, zero, group)  # [N, K] fp32
    ct = torch.promote_types(x.dtype, torch.float32)
    y = x.to(ct) @ w.to(device=x.device, dtype=ct).T
    if bias is not None:
        y = y + bias.to(ct)
    return y.to(x.dtype)


@cache
def _sm_count(index: int) -> int:  # asked on every launch: ask the driver once
    return torch.cuda.get_device_properties(index).multi_processor_count


def _config(device: torch.device, dtype: torch.dtype, shape_key: str) -> dict[str, int]:
    try:
        return launch_config("quant_gemv", device, dtype, shape_key)
    except KeyError:  # no "quant_gemv" entry in configs/launch.json (yet)
        return dict(DEFAULT_CONFIG)


def _pow2(name: str, value: int, least: int) -> int:
    if not isinstance(value, int) or value < least or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {least}, got {value!r}")
    return value


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
                 bias: torch.Tensor | None = None, out: torch.Tensor | None = None, *, block_n: int | None = None,
                 block_k: int | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16, M <= 16) @ W.T + bias -> [M, N] in x's dtype, W stored quantized (module doc).

    Bits come from qweight's dtype (int8: 8, uint8: 4). group is K (per channel) or a multiple of 16 (int8) /
    32 (int4). Accumulation is fp32. block_n / block_k / split_k override the launch config (split_k 0 = auto).
    """
    check_tensor("x", x, dims=2, dtypes=FLOATS)
    bits, n, k = check_quant_weights(qweight, scale, zero, group)
    m = x.shape[0]
    if x.shape[1] != k:
        what = "uint8 [N, K // 2]" if bits == 4 else "int8 [N, K]"
        raise ValueError(f"x has shape {list(x.shape)} but qweight {list(qweight.shape)} ({what}) means K = {k}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"quant_linear takes 1..{MAX_ROWS} rows (MAX_ROWS), got {m}; "
                         "dequantize() the weights once and use a dense matmul for more")
    check_tensor("qweight", qweight, device=x.device)
    if bias is not None:
        check_tensor("bias", bias, shape=(n,), dtypes=FLOATS, device=x.device, contiguous=True)
    per_channel = group == k
    cfg = _config(x.device, x.dtype, f"N{n}_K{k}_b{bits}_g{'K' if per_channel else group}")
    block_n = _pow2("block_n", block_n or cfg["block_n"], 16)
    block_k = _pow2("block_k", block_k or cfg["block_k"], 32)
    if not per_channel:  # a K tile stays inside one scale group
        while group % block_k:
            block_k //= 2
        if block_k < (32 if bits == 4 else 16):
            raise ValueError(f"group {group} must be K (per channel) or a multiple of {32 if bits == 4 else 16} "
                             f"for {bits}-bit weights; dequantize() for other groupings")
    n_blocks, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split_k = cfg["split_k"] if split_k is None else split_k
    if not isinstance(split_k, int) or split_k < 0:
        raise ValueError(f"split_k must be an int >= 0 (0: auto), got {split_k!r}")
    if split_k == 0:  # enough programs to fill the GPU twice over; one slice on a CPU
        sms = _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device()) \
            if x.is_cuda else 0
        split_k = max(1, min(k_tiles, 2 * sms // n_blocks))
    tiles_per_split = triton.cdiv(k_tiles, min(split_k, k_tiles))
    split_k = triton.cdiv(k_tiles, tiles_per_split)  # no empty slices
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    check_tensor("out", out, shape=(m, n), dtypes=(x.dtype,), device=x.device, contiguous=True)
    x = x.contiguous()  # [M, K], tiny
    dot = m > 1
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    _quant_gemv_kernel[(n_blocks, split_k)](
        x, qweight, scale, zero if zero is not None else scale, bias if bias is not None else scale, partial, m, n, k,
        k // group, group, tiles_per_split * block_k, INT4=bits == 4, PER_CHANNEL=per_channel,
        HAS_BIAS=bias is not None, PARTIAL=split_k > 1, DOT=dot,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=16 if dot else 1, BLOCK_N=block_n,
        BLOCK_K=block_k)
    if split_k > 1:
        _split_sum_kernel[(triton.cdiv(m * n, 256),)](partial, bias if bias is not None else partial, out, m * n, n,
                                                      split_k, HAS_BIAS=bias is not None, BLOCK=256)
    return out
