"""RoPE inverse frequencies for the rope_scaling kinds the supported checkpoints use.

Follows the Hugging Face definitions so that positions rotate exactly as in transformers:
"default", "linear", "llama3" (Llama 3.1+) and "yarn" (Qwen3 long context). Dynamic NTK and
LongRoPE change frequencies with the sequence length, which a persistent KV cache cannot follow,
so they are refused with a clear error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from streamserve.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    head_dim: int
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # the scaling parameters, as in config.json
    max_position_embeddings: int = 2048

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], head_dim: int) -> RopeConfig:
        """Reads `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (older configs)."""
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"rope type {rope_type!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
            raise ModelLoadError("partial_rotary_factor != 1 is not supported")
        if rope_type in ("llama3", "yarn"):  # as transformers: the pre-scaling context defaults to the context
            params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
        for key in {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(
                rope_type, ()):
            if key not in params:
                raise ModelLoadError(f"rope type {rope_type!r} needs {key!r} in its parameters")
        return cls(theta=float(theta), head_dim=head_dim, rope_type=rope_type, params=params,
                   max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)))

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """-> (inv_freq [head_dim/2] fp32, attention scaling applied to cos and sin)."""
        dim = self.head_dim
        base = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        p = self.params
        if self.rope_type == "default":
            return base, 1.0
        if self.rope_type == "linear":
            return base / float(p["factor"]), 1.0
        if self.rope_type == "llama3":
            return _llama3(base, p), 1.0
        return _yarn(self.theta, dim, p, self.max_position_embeddings)


def layer_kind_ropes(cfg: dict[str, Any], head_dim: int) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's two RoPE tables -> (full-attention layers', sliding-window layers').

    transformers >= 5 writes `rope_parameters` per layer kind ({"full_attention": {...}, "sliding_attention":
    {...}}); older configs give the global layers `rope_theta` + `rope_scaling` and the local layers
    `rope_local_base_freq` with no scaling. A kind's theta defaults as in Gemma3TextConfig (1e6 global, 1e4 local).
    """
    params = cfg.get("rope_parameters") or {}
    per_kind = isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params)
    full = dict(params.get("full_attention") or {}) if per_kind else dict(params or cfg.get("rope_scaling") or {})
    local = dict(params.get("sliding_attention") or {}) if per_kind else {}
    full.setdefault("rope_theta", cfg.get("rope_theta") or 1e6)
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq") or 10000.0)
    return (RopeConfig.from_hf({**cfg, "rope_parameters": full, "rope_scaling": None}, head_dim),
            RopeConfig.from_hf({**cfg, "rope_parameters": local, "rope_scaling": None}, head_dim))


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])  # from_hf fills it in when a config omits it
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, p: dict[str, Any], max_pos: int) -> tuple[torch.Tensor, float]:
    orig = int(p.get("original_max_position_embeddings") or max_pos)
    factor = p.get("factor") or max_pos / orig
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv, float(attention_factor)
