"""The one op layer: model code calls `ops.<name>(...)` and never a kernel directly.

A backend is a frozen table of callables with the signatures of `streamserve.kernels.reference`:
"torch" (the references) or "triton" (`streamserve.kernels.triton_backend`: kernels where they exist,
the references elsewhere). Swapping the table changes no model code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from streamserve.errors import InvalidInputError
from streamserve.kernels import reference as ref
from streamserve.kernels.rolling_batch import paged_attention_rolling_batch

log = logging.getLogger("streamserve")

# On CUDA, up to this many tokens take the gather path: no host sync, so decode steps can be captured
# in CUDA graphs (the Triton backend's moe_gemv does the same without copying weights). On a CPU one
# token takes the top-k loop and more the grouped path; gathering copies k experts' weights per token
# and never wins there (benchmarks/moe_cpu.py, Qwen3-30B-A3B shapes, T=1: top-k loop 8.0 ms, grouped
# 8.6, transformers 9.0, gather 60.8; docs/benchmarks.md).
MOE_GATHER_MAX_TOKENS_CUDA = 16


def moe_experts_torch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> [T, D]; picks the torch reference path by device and token count."""
    if x.is_cuda:
        if x.shape[0] <= MOE_GATHER_MAX_TOKENS_CUDA:
            return ref.moe_experts_gather(x, weights, ids, w_gate_up, w_down)
        return ref.moe_experts_grouped(x, weights, ids, w_gate_up, w_down)
    if x.shape[0] == 1:
        return ref.moe_experts_topk_loop(x, weights, ids, w_gate_up, w_down)
    return ref.moe_experts_grouped(x, weights, ids, w_gate_up, w_down)


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope_cos_sin: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    apply_rope: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    gelu_tanh_mul: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    rolling_rope: Callable[..., ref.RollingRope]
    attention_rolling: Callable[..., torch.Tensor]
    # a few tokens of each of several sessions in one call (absolute positions); None: one call per session
    attention_batch: Callable[..., torch.Tensor] | None
    # a few tokens of each of several rolling-position sessions in one call; None: one call per session
    attention_rolling_batch: Callable[..., torch.Tensor] | None
    # every session of a step with at most 16 tokens, absolute and rolling, over block tables in one launch
    # (kernels/batch_attention.py); None: `attention_batch` / one call per session
    attention_blocks: Callable[..., torch.Tensor] | None
    moe_route: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    moe_experts: Callable[..., torch.Tensor]


TORCH_OPS = Ops(
    name="torch",
    rms_norm=ref.rms_norm,
    add_rms_norm=ref.add_rms_norm,
    rope_cos_sin=ref.rope_cos_sin,
    apply_rope=ref.apply_rope,
    silu_mul=ref.silu_mul,
    gelu_tanh_mul=ref.gelu_tanh_mul,
    attention=ref.paged_attention,
    rolling_rope=ref.rolling_rope,
    attention_rolling=ref.paged_attention_rolling,
    attention_batch=ref.paged_attention_batch,
    attention_rolling_batch=paged_attention_rolling_batch,
    attention_blocks=None,
    moe_route=ref.moe_route,
    moe_experts=moe_experts_torch,
)

BACKENDS = ("auto", "torch", "triton")


def triton_ops(device: torch.device) -> Ops:
    """The Triton backend; on a CPU its kernels run in Triton's interpreter (slow: for tests)."""
    if device.type == "cpu":
        # must be set before triton compiles the kernels: it decides at decoration time
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from streamserve.kernels import triton_backend as tb
    except ImportError as e:
        raise InvalidInputError(f"kernels='triton' needs the triton package ({e}); pip install triton, "
                                "or use kernels='torch'") from None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidInputError("kernels='triton' on a CPU needs TRITON_INTERPRET=1 (set before triton is imported)")
    return replace(TORCH_OPS, name="triton", rms_norm=tb.rms_norm, add_rms_norm=tb.add_rms_norm,
                   silu_mul=tb.silu_mul, gelu_tanh_mul=tb.gelu_tanh_mul, apply_rope=tb.apply_rope,
                   attention=tb.paged_attention,
                   attention_rolling=tb.paged_attention_rolling,
                   attention_batch=None,  # the block-table kernel below takes these steps
                   attention_rolling_batch=None,
                   attention_blocks=tb.batch_attention,
                   moe_experts=tb.moe_experts)


def get_ops(name: str, device: torch.device | str = "cpu") -> Ops:
    """"torch", "triton", or "auto" (Triton on CUDA, torch elsewhere)."""
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            return TORCH_OPS
        try:
            return triton_ops(device)
        except InvalidInputError as e:  # no triton on this CUDA machine: the references still work
            log.warning("kernels='auto': %s; using the torch references", e)
            return TORCH_OPS
    if name == "torch":
        return TORCH_OPS
    if name == "triton":
        return triton_ops(device)
    raise InvalidInputError(f"unknown kernel backend {name!r}; choose one of {list(BACKENDS)}")
