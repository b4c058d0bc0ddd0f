"""Test scaffolding: ``flashinfer.sampling``'s two samplers that SGLang's sampler imports at module load on CUDA
(``sglang.srt.layers.sampler``), as torch: top-k/top-p and min-p filtering, then one draw per row.

SGLang calls them only for non-greedy requests (temperature > 0 with top-k/top-p/min-p set); greedy decoding takes
``torch.argmax``. Same contract as FlashInfer's: probs [B, V] (rows sum to 1) -> token ids [B] int32.
"""

from __future__ import annotations

from typing import Any

import torch
from sgl_kernel import top_k_renorm_prob, top_p_renorm_prob


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs.float(), 1, generator=generator).view(-1).to(torch.int32)


def top_k_top_p_sampling_from_probs(probs: torch.Tensor, top_k: torch.Tensor | int, top_p: torch.Tensor | float,
                                    indices: torch.Tensor | None = None, filter_apply_order: str = "top_k_first",
                                    deterministic: bool = True, generator: torch.Generator | None = None,
                                    check_nan: bool = False, **kwargs: Any) -> torch.Tensor:
    """filter_apply_order "top_k_first": top-k, renormalise, then top-p on that; "joint": a token must be in both
    the top-k and the top-p nucleus of the original row."""
    del deterministic, check_nan, kwargs
    if indices is not None:
        probs = probs[indices]
    if filter_apply_order == "top_k_first":
        return _draw(top_p_renorm_prob(top_k_renorm_prob(probs, top_k), top_p), generator)
    if filter_apply_order != "joint":
        raise ValueError(f"filter_apply_order {filter_apply_order!r}")
    both = (top_k_renorm_prob(probs, top_k) > 0) & (top_p_renorm_prob(probs, top_p) > 0)
    kept = torch.where(both, probs, torch.zeros_like(probs))
    return _draw(kept / kept.sum(-1, keepdim=True), generator)


def min_p_sampling_from_probs(probs: torch.Tensor, min_p: torch.Tensor | float, indices: torch.Tensor | None = None,
                              deterministic: bool = True, generator: torch.Generator | None = None,
                              check_nan: bool = False, **kwargs: Any) -> torch.Tensor:
    """Keep the tokens whose probability is at least min_p times the row's largest, then draw."""
    del deterministic, check_nan, kwargs
    if indices is not None:
        probs = probs[indices]
    rows = probs.shape[0]
    m = min_p.to(probs.device, torch.float32).reshape(-1, 1) if isinstance(min_p, torch.Tensor) else \
        torch.full((rows, 1), float(min_p), device=probs.device)
    kept = torch.where(probs.float() >= m * probs.float().amax(-1, keepdim=True), probs.float(),
                       torch.zeros_like(probs, dtype=torch.float32))
    return _draw(kept / kept.sum(-1, keepdim=True), generator)
