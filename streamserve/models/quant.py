"""Weight-only quantized projections: int8 per output channel, or 4-bit codes per group of 32 input columns.

Batch-1 decode reads every weight once per token, so its speed is bytes per token over memory bandwidth: int8
reads a quarter of float32's bytes, 4-bit an eighth. Activations stay floating point; only weights shrink.

The canonical form of a quantized [N, K] weight (`QuantWeight`, what loading, tests and every device share):

    int8  qweight int8 [N, K]         scale fp32 [N, 1]              w = q * scale            (group = K)
    int4  qweight uint8 [N, K / 2]    scale, zero fp32 [N, K / g]    w = (c - 8) * scale + zero  (group g)
          (byte j of a row: column 2j in its low nibble, 2j + 1 in its high nibble; codes c in 0..15)

`QuantLinear` runs it where it is:
- CPU: torch's packed weight-only kernels, `aten._weight_int8pack_mm` and `aten._weight_int4pack_mm_for_cpu`
  (the int4 form is repacked once into the CPU kernel's tile layout). Their fast paths take bfloat16 activations
  (AVX512-BF16/AMX; in float32 they are several times slower than a float32 matmul), so the input is rounded to
  bfloat16 for the product and the result comes back in the model's dtype: the accuracy this costs is measured
  (benchmarks/cpu_decode.py, tests/models/test_quant.py), not assumed.
- CUDA: the Triton gemv of the same design as the MoE kernel (`kernels/quant_gemv.py`) for up to 16 rows; a
  dequantized matmul beyond (a prefill chunk is compute-bound: the bytes no longer decide).

GGUF files arrive quantized: Q4_0, Q4_1 and Q4_K blocks are groups of 32 with a scale and an offset, exactly the
int4 form above, so their codes are kept bit for bit (`grid`: the file's per-group scale and zero, read by
models/gguf/grids.py, fix the codes); Q8_0 (int8 per block of 32) and Q5/Q6 are re-scaled per output channel
to int8 (the aten kernel's only int8 form; the error is bounded by half a step of the channel's scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("none", "int8", "int4")
GROUP = 32  # int4 columns per scale: the GGUF block size (Q4_0/Q4_1, and Q4_K's sub-blocks)
CUDA_GEMV_ROWS = 16  # the Triton gemv's limit: more rows (a prefill chunk) run dequantized
CPU_INT4_ROWS = 16  # the CPU int4 kernel packs output rows in tiles of 16: other N are padded
INT8_K_MULTIPLE = 16  # `_weight_int8pack_mm` needs the input width to be a multiple of this (see `_pack_cpu`)


@dataclass
class QuantWeight:
    """One [N, K] weight in canonical form (see the module docstring)."""

    bits: int  # 8 or 4
    qweight: torch.Tensor  # int8 [N, K] or uint8 [N, K / 2]
    scale: torch.Tensor  # fp32 [N, K / group]
    zero: torch.Tensor | None  # fp32 [N, K / group] (int4), None (int8)
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        n = self.qweight.shape[0]
        return n, self.qweight.shape[1] * (2 if self.bits == 4 else 1)

    def codes(self) -> torch.Tensor:
        """int4: the codes unpacked, uint8 [N, K] in 0..15."""
        lo, hi = self.qweight & 0xF, self.qweight >> 4
        return torch.stack([lo, hi], dim=-1).reshape(self.qweight.shape[0], -1)

    def dequantize(self) -> torch.Tensor:
        """-> fp32 [N, K]."""
        n, k = self.shape
        if self.bits == 8:
            return (self.qweight.float().view(n, -1, self.group) * self.scale[..., None]).reshape(n, k)
        assert self.zero is not None
        c = self.codes().float().view(n, -1, self.group) - 8.0
        return (c * self.scale[..., None] + self.zero[..., None]).reshape(n, k)


def quantize_int8(w: torch.Tensor) -> QuantWeight:
    """Symmetric per output channel: w [N, K] -> int8 in -127..127 with scale = max|w_row| / 127."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)  # [N, 1]
    q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    return QuantWeight(8, q, scale, None, w.shape[1])


def quantize_int4(w: torch.Tensor, group: int = GROUP, grid: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> QuantWeight:
    """Asymmetric per group of `group` columns: w [N, K] -> codes 0..15 with w ~ (c - 8) * scale + zero.

    `grid` (scale, zero [N, K / group]): a GGUF file's own grid, on which the values already lie exactly (its
    codes are recovered, not re-rounded); else each group's min..max is spread over the 16 codes."""
    w = w.float()
    n, k = w.shape
    if k % group or k % 2:
        raise ValueError(f"int4 needs input columns divisible by the group ({group}); got {k}")
    groups = w.view(n, k // group, group)
    if grid is None:
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/g]
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        zero = lo + 8 * scale  # code 0 is the group's min, code 15 its max
    else:
        scale, zero = grid[0].float(), grid[1].float()
    # a zero scale (an all-equal group): codes 8. (A file's scale may be negative: Q4_0 stores max / -8.)
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - zero[..., None]) / safe[..., None] + 8).clamp(0, 15).to(torch.uint8)
    codes = codes.reshape(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [N, K/2]: even columns low, odd high
    return QuantWeight(4, packed.contiguous(), scale.contiguous(), zero.contiguous(), group)


class QuantLinear(nn.Module):
    """A drop-in for `nn.Linear` (x [..., K] -> [..., N]) over a `QuantWeight`, packed for the device it is on."""

    def __init__(self, q: QuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.bits, self.group = q.bits, q.group
        self.register_buffer("qweight", q.qweight)
        self.register_buffer("scale", q.scale)
        self.register_buffer("zero", q.zero)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # the CPU kernel's (weight, scales) form, packed on the first CPU call: non-persistent buffers (not in a
        # state dict) so that a compiled step (engine/compiled.py, Inductor's freezing) sees them as the module's
        # constant weights and may repack them for its own GEMM template
        self.register_buffer("cpu_weight", None, persistent=False)
        self.register_buffer("cpu_scales", None, persistent=False)

    @classmethod
    def from_linear(cls, lin: nn.Linear, bits: int, grid: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> QuantLinear:
        w = lin.weight.detach()
        q = quantize_int8(w) if bits == 8 else quantize_int4(w, GROUP, grid)
        return cls(q, lin.bias)

    @property
    def weight_bytes(self) -> int:
        """Bytes read per token: codes and scales in canonical form (what decode speed follows; the CPU kernel's
        bf16 scales are a little smaller)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.zero) if t is not None)

    def canonical(self) -> QuantWeight:
        return QuantWeight(self.bits, self.qweight, self.scale, self.zero, self.group)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group}"

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        self.cpu_weight = self.cpu_scales = None  # moved or cast: repack on the next call
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x2.device.type == "cpu":
            y = self._cpu_forward(x2)
        elif x2.device.type == "cuda" and x2.shape[0] <= CUDA_GEMV_ROWS:
            from streamserve.kernels.quant_gemv import quant_linear

            y = quant_linear(x2, self.qweight, self.scale, self.zero, self.group)
        else:
            y = F.linear(x2, self.canonical().dequantize().to(x2.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y if x.dim() == 2 else y.reshape(*shape[:-1], self.out_features)

    def _cpu_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] through torch's packed kernels, activations in bfloat16 (their fast path)."""
        if self.cpu_weight is None or self.cpu_scales is None:
            self.cpu_weight, self.cpu_scales = self._pack_cpu()
        w, s = self.cpu_weight, self.cpu_scales
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if self.bits == 8:
            if w.shape[1] != self.in_features:  # the weight's K padded with zero columns: the input's too
                xb = F.pad(xb, (0, w.shape[1] - self.in_features))
            y = torch.ops.aten._weight_int8pack_mm(xb, w, s)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w, self.group, s)
            if y.shape[1] != self.out_features:  # rows padded to the kernel's tile
                y = y[:, :self.out_features]
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _pack_cpu(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bits == 8:  # [N, K] int8; one bf16 scale per row
            # torch 2.13's kernel reads past a row whose K is not a multiple of 16 (NaNs at one row, a segfault at
            # several): K is padded with zero columns, which add nothing
            pad = -self.in_features % INT8_K_MULTIPLE
            w = F.pad(self.qweight, (0, pad)) if pad else self.qweight  # unpadded: the canonical codes, no copy
            return w.contiguous(), self.scale[:, 0].to(torch.bfloat16).contiguous()
        assert self.zero is not None
        n = self.out_features
        pad = -n % CPU_INT4_ROWS
        codes = self.canonical().codes().to(torch.int32)  # [N, K]
        scale, zero = self.scale, self.zero
        if pad:  # rows of code 8, scale 0, zero 0: they compute 0 and are cut off
            codes = torch.cat([codes, codes.new_full((pad, codes.shape[1]), 8)])
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        return packed, scales_zeros.to(torch.bfloat16)


EXACT_TOP = 64  # the head's top candidates per row whose logits are computed again in float32 (`exact_top`)


def exact_top(head: nn.Module, h: torch.Tensor, logits: torch.Tensor, k: int = EXACT_TOP) -> torch.Tensor:
    """Logits [R, V] of `head` at h [R, K] with their top-k computed again in float32 from the head's own weights:
    a quantized head's CPU kernels and a bfloat16 head give logits rounded to bfloat16 (8 significant bits: at 26,
    steps of 0.125), which ties close candidates; re-computed, the candidates greedy, sampling and verification
    choose between are exact, and only the far tail keeps its rounding. -> float32 [R, V]."""
    out = logits.float()
    if (isinstance(head, QuantLinear) and h.device.type == "cpu") or out.dtype != logits.dtype:
        top = out.topk(min(k, out.shape[-1]), dim=-1).indices  # [R, k]
        out = out.scatter(-1, top, head_rows(head, h, top))
    return out


def head_rows(head: nn.Module, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """h [R, K] times the head's weight rows `rows` [R, k], in float32 -> [R, k]."""
    flat = rows.reshape(-1)
    if isinstance(head, QuantLinear):
        w = head.canonical()
        sub = QuantWeight(w.bits, w.qweight.index_select(0, flat), w.scale.index_select(0, flat),
                          None if w.zero is None else w.zero.index_select(0, flat), w.group).dequantize()
    else:
        sub = head.weight.index_select(0, flat).float()  # type: ignore[union-attr]
    y = torch.einsum("rkd,rd->rk", sub.view(*rows.shape, -1), h.float())
    bias = getattr(head, "bias", None)
    return y if bias is None else y + bias.float().index_select(0, flat).view(rows.shape)


def can_int4(lin: nn.Linear) -> bool:
    return lin.in_features % GROUP == 0


def quantize_linear(lin: nn.Linear, bits: int, grid: tuple[torch.Tensor, torch.Tensor] | None = None) -> QuantLinear:
    """int4 where the input width splits into groups, int8 otherwise (named in `quantize_model`'s summary)."""
    return QuantLinear.from_linear(lin, 4 if bits == 4 and can_int4(lin) else 8, grid if bits == 4 else None)
