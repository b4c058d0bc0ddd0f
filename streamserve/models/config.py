"""One normalised model description, read from a Hugging Face `config.json`.

The five supported architectures differ in a few switches (QK-norm kind, MoE routing, which layers
are sparse, sliding windows); everything else is one decoder. This module turns their configs into
one frozen `ModelConfig` so the model code has no per-architecture branches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from streamserve.errors import ModelLoadError, UnsupportedArchitectureError
from streamserve.models.rope import RopeConfig

QKNorm = Literal["none", "per_head", "full"]


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported architectures."""

    qk_norm: QKNorm
    moe: bool
    always_normalize_topk: bool = False  # Mixtral renormalises the top-k weights regardless of config
    defaults: tuple[tuple[str, Any], ...] = ()  # transformers' defaults for keys a config.json may omit


ARCHITECTURES: dict[str, ArchSpec] = {
    "Qwen3MoeForCausalLM": ArchSpec(qk_norm="per_head", moe=True, defaults=(
        ("rms_norm_eps", 1e-6), ("max_position_embeddings", 32768), ("rope_theta", 10000.0))),
    "Qwen3ForCausalLM": ArchSpec(qk_norm="per_head", moe=False, defaults=(
        ("rms_norm_eps", 1e-6), ("max_position_embeddings", 32768), ("rope_theta", 10000.0),
        ("max_window_layers", 28))),
    "MixtralForCausalLM": ArchSpec(qk_norm="none", moe=True, always_normalize_topk=True, defaults=(
        ("rms_norm_eps", 1e-5), ("max_position_embeddings", 4096 * 32), ("rope_theta", 1e6))),
    "OlmoeForCausalLM": ArchSpec(qk_norm="full", moe=True, defaults=(
        ("rms_norm_eps", 1e-5), ("max_position_embeddings", 4096), ("rope_theta", 10000.0))),
    "LlamaForCausalLM": ArchSpec(qk_norm="none", moe=False, defaults=(
        ("rms_norm_eps", 1e-6), ("max_position_embeddings", 2048), ("rope_theta", 10000.0))),
}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_topk: bool
    sparse_layers: tuple[bool, ...]  # per layer: MoE block (True) or dense MLP (False)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense models, and dense layers of MoE models)
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: QKNorm
    clip_qkv: float | None
    rope: RopeConfig
    moe: MoEConfig | None
    sliding_windows: tuple[int | None, ...]  # per layer: a model-native window, or None for full attention
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's dtype name, e.g. "bfloat16"

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path} not found: a checkpoint folder needs config.json") from None
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf(raw)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedArchitectureError(
                f"architecture {', '.join(archs) or '(none given)'} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)}")
        spec = ARCHITECTURES[arch]
        if cfg.get("quantization_config"):
            method = cfg["quantization_config"].get("quant_method", "?")
            raise ModelLoadError(f"quantized checkpoints ({method}) are not supported yet; use a bf16/fp16/fp32 one")
        cfg = {**dict(spec.defaults), **{k: v for k, v in cfg.items() if v is not None}}
        try:
            return cls._parse(cfg, arch, spec)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json of this {arch} checkpoint lacks or mangles {e}") from None

    @classmethod
    def _parse(cls, cfg: dict[str, Any], arch: str, spec: ArchSpec) -> ModelConfig:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(cfg["num_hidden_layers"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=spec.qk_norm,
            clip_qkv=cfg.get("clip_qkv"),
            rope=RopeConfig.from_hf(cfg, head_dim),
            moe=_moe_config(cfg, spec, layers),
            sliding_windows=_sliding_windows(cfg, arch, layers),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id"), int(cfg["vocab_size"])),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )


def _moe_config(cfg: dict[str, Any], spec: ArchSpec, layers: int) -> MoEConfig | None:
    if not spec.moe:
        return None
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts <= 0:
        raise ModelLoadError("an MoE architecture needs num_experts (or num_local_experts) > 0")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return MoEConfig(
        num_experts=experts,
        top_k=int(cfg["num_experts_per_tok"]),
        # Mixtral names the expert width intermediate_size; Qwen3-MoE and OLMoE have moe_intermediate_size
        intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        normalize_topk=spec.always_normalize_topk or bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
    )


def _sliding_windows(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if arch == "Qwen3MoeForCausalLM":  # transformers windows every layer of Qwen3-MoE
        return (int(window) if cfg.get("use_sliding_window") and window else None,) * layers
    if arch == "Qwen3ForCausalLM":
        if not cfg.get("use_sliding_window", False):
            return (None,) * layers
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", layers)) else "full_attention"
            for i in range(layers)]
        return tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    if arch == "MixtralForCausalLM" and window:
        return (int(window),) * layers
    return (None,) * layers


def _eos_ids(eos: Any, vocab: int) -> tuple[int, ...]:
    ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    return tuple(int(i) for i in ids if 0 <= int(i) < vocab)
