"""Test scaffolding: a pure-torch stand-in for the CUDA ``sgl_kernel`` (the ``sglang-kernel`` wheel, several hundred
MB) that SGLang 0.5.15 imports on a CUDA machine, so the prepared GPU check (benchmarks/sglang_gpu_check.sh) can
start SGLang with the carried wheels alone (under 60 MB).

What a plain Qwen3/Llama model with ``--attention-backend triton`` imports from here, read off SGLang's import graph
with CUDA reported present (tests/support/sglang/README-cuda.md says how):

* Ops with a torch implementation below: the RMS norms, the gated activations and the top-k / top-p
  renormalisations of the sampler (``sglang.srt.layers.sampler`` imports those two at module load on CUDA).
  With ``sglang_cuda_shims`` loaded, SGLang's layers run their ``forward_native`` torch paths, so the norms and
  activations here serve only a direct caller; each matches its reference formula (test_cuda_shims.py).
* Importable names that raise when called: quantized GEMMs, MoE routing, speculative decoding (imported by modules
  every server loads, called only by quantized, MoE or speculative models, which the check does not serve).

A name missing here raises ImportError at import, so a code path that needs another kernel fails loudly instead of
running a guess. Nothing here is part of streamserve.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.nn.functional as F


def _not_shimmed(name: str) -> Callable[..., NoReturn]:
    """A kernel SGLang imports at module load but calls only on paths the GPU check does not take: importable, and
    raises if it is ever called."""

    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name} has no stand-in in streamserve's SGLang CUDA test shims")

    kernel.__name__ = name.rsplit(".", 1)[-1]
    return kernel


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, D] * weight [D] / rms(x): computed in float32 (as the CUDA kernel accumulates), returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    """out [T, D] = input / sqrt(mean(input^2) + eps) * weight."""
    del enable_pdl  # programmatic dependent launch: a CUDA launch detail, meaningless here
    y = _rms(input, weight, eps)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None) -> None:
    """In place, as the kernel: residual += input, then input = rmsnorm(residual) (both [T, D])."""
    del enable_pdl
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps))


def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
                  enable_pdl: bool | None = None) -> torch.Tensor:
    """Gemma's RMS norm: the weight is stored as an offset from 1 (input / rms * (1 + weight))."""
    return rmsnorm(input, weight.float() + 1.0, eps, out, enable_pdl)


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                            enable_pdl: bool | None = None) -> None:
    fused_add_rmsnorm(input, residual, weight.float() + 1.0, eps, enable_pdl)


def _gated(act: Callable[[torch.Tensor], torch.Tensor], input: torch.Tensor,
           out: torch.Tensor | None) -> torch.Tensor:
    """input [..., 2d] -> act(input[..., :d]) * input[..., d:]  [..., d] (SGLang's gate/up layout)."""
    d = input.shape[-1] // 2
    y = (act(input[..., :d].float()) * input[..., d:].float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    return _gated(F.silu, input, out)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    return _gated(F.gelu, input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None,
                      enable_pdl: bool | None = None) -> torch.Tensor:
    return _gated(lambda x: F.gelu(x, approximate="tanh"), input, out)


def _per_row(value: torch.Tensor | float | int, rows: int, device: torch.device,
             dtype: torch.dtype) -> torch.Tensor:
    """A scalar or [B] parameter as a [B, 1] column."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(-1, 1).expand(rows, 1)
    return torch.full((rows, 1), value, device=device, dtype=dtype)


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """probs [B, V] -> each row keeps its top_k largest probabilities (ties at the k-th value kept), renormalised.

    A k of 0 or >= V keeps the whole row. Sorting-free on purpose is not needed here: this runs once per step."""
    b, v = probs.shape
    k = _per_row(top_k, b, probs.device, torch.long).clamp(min=0)
    k = torch.where((k <= 0) | (k >= v), torch.full_like(k, v), k)
    ordered = probs.sort(dim=-1, descending=True).values
    kth = ordered.gather(-1, k - 1)  # [B, 1]: the k-th largest probability
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """probs [B, V] -> each row keeps the smallest set of its largest probabilities whose sum reaches top_p (the
    nucleus; at least the largest one), renormalised."""
    b, _ = probs.shape
    p = _per_row(top_p, b, probs.device, torch.float32)
    ordered, index = probs.float().sort(dim=-1, descending=True)
    before = ordered.cumsum(-1) - ordered  # mass strictly above each entry
    keep_sorted = before < p
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, index, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


# Imported at module load by the modules every CUDA server loads (quantization registry, MoE layers, speculative
# decoding), called only by models and modes the GPU check does not use.
build_tree_kernel_efficient = _not_shimmed("build_tree_kernel_efficient")
fast_topk = _not_shimmed("fast_topk")
fp8_blockwise_scaled_mm = _not_shimmed("fp8_blockwise_scaled_mm")
fp8_scaled_mm = _not_shimmed("fp8_scaled_mm")
gptq_gemm = _not_shimmed("gptq_gemm")
gptq_shuffle = _not_shimmed("gptq_shuffle")
int8_scaled_mm = _not_shimmed("int8_scaled_mm")
moe_align_block_size = _not_shimmed("moe_align_block_size")
moe_sum = _not_shimmed("moe_sum")
moe_sum_reduce = _not_shimmed("moe_sum_reduce")
qserve_w4a8_per_chn_gemm = _not_shimmed("qserve_w4a8_per_chn_gemm")
qserve_w4a8_per_group_gemm = _not_shimmed("qserve_w4a8_per_group_gemm")
sgl_per_token_group_quant_8bit = _not_shimmed("sgl_per_token_group_quant_8bit")
sgl_per_token_quant_fp8 = _not_shimmed("sgl_per_token_quant_fp8")
topk_sigmoid = _not_shimmed("topk_sigmoid")
topk_softmax = _not_shimmed("topk_softmax")
tree_speculative_sampling_target_only = _not_shimmed("tree_speculative_sampling_target_only")
