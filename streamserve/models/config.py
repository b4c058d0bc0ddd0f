"""One normalised model description, read from a Hugging Face `config.json`.

The supported architectures differ in a few switches (QK-norm kind, MoE routing, which layers are
sparse, sliding windows, Gemma's sandwich norms and per-layer-kind RoPE); everything else is one decoder.
This module turns their configs into one frozen `ModelConfig` so the model code has no per-architecture branches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from streamserve.errors import ModelLoadError, UnsupportedArchitectureError
from streamserve.models.rope import RopeConfig, layer_kind_ropes

QKNorm = Literal["none", "per_head", "full"]
Activation = Literal["silu", "gelu_tanh"]
# hidden_act names of the gated MLP's activation -> the op that computes it (all tanh GELUs are one function)
ACTIVATIONS: dict[str, Activation] = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                                      "gelu_python_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported architectures."""

    qk_norm: QKNorm
    moe: bool
    always_normalize_topk: bool = False  # Mixtral renormalises the top-k weights regardless of config
    qkv_bias: bool = False  # Qwen2: q/k/v projections always carry a bias (o_proj never), whatever attention_bias says
    gemma: bool = False  # Gemma 3: (1 + w) norms, sandwich norms, scaled embeddings, local/global RoPE
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
    "Qwen2ForCausalLM": ArchSpec(qk_norm="none", moe=False, qkv_bias=True, defaults=(
        ("rms_norm_eps", 1e-6), ("max_position_embeddings", 32768), ("rope_theta", 10000.0),
        ("max_window_layers", 28), ("sliding_window", 4096))),
    "Gemma3ForCausalLM": ArchSpec(qk_norm="per_head", moe=False, gemma=True, defaults=(
        ("rms_norm_eps", 1e-6), ("max_position_embeddings", 131072), ("rope_theta", 1e6),
        ("rope_local_base_freq", 10000.0), ("head_dim", 256), ("query_pre_attn_scalar", 256),
        ("sliding_window", 4096), ("sliding_window_pattern", 6), ("tie_word_embeddings", True),
        ("hidden_activation", "gelu_pytorch_tanh"), ("eos_token_id", 1))),
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
    qkv_bias: bool  # biases on q/k/v (Qwen2 always; others when attention_bias)
    o_bias: bool  # a bias on o_proj (attention_bias; never on Qwen2)
    mlp_bias: bool
    qk_norm: QKNorm
    clip_qkv: float | None
    rope: RopeConfig  # the RoPE of full-attention layers (of every layer unless `local_rope` is set)
    moe: MoEConfig | None
    sliding_windows: tuple[int | None, ...]  # per layer: a model-native window, or None for full attention
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's dtype name, e.g. "bfloat16"
    activation: Activation = "silu"  # of the gated MLP: silu(gate) * up, or gelu_tanh(gate) * up (GeGLU)
    attn_scale: float = 1.0  # softmax scale of q.k: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    local_rope: RopeConfig | None = None  # Gemma 3: the RoPE of sliding-window layers, when it differs from `rope`
    sandwich_norms: bool = False  # Gemma 3: norms after attention and around the MLP, on the residual branch
    norm_offset: float = 0.0  # checkpoint norms hold w and scale by (norm_offset + w): folded in at load time
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma 3: sqrt(hidden_size), in the model dtype)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)

    @property
    def ropes(self) -> tuple[RopeConfig, ...]:
        """The distinct RoPE tables of the model: one per layer kind (`rope_kind`)."""
        return (self.rope,) if self.local_rope is None else (self.rope, self.local_rope)

    def rope_kind(self, layer: int) -> int:
        """Index into `ropes` of the table `layer` rotates with: 1 for Gemma's sliding layers, else 0."""
        return int(self.local_rope is not None and self.sliding_windows[layer] is not None)

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
        act_name = cfg.get("hidden_activation" if spec.gemma else "hidden_act", "silu")
        if act_name not in ACTIVATIONS:
            raise ModelLoadError(f"hidden activation {act_name!r} is not supported; supported: "
                                 f"{', '.join(ACTIVATIONS)}")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(cfg["num_hidden_layers"])
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        gemma = _gemma_fields(cfg, head_dim, hidden, layers) if spec.gemma else {}
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
            qkv_bias=spec.qkv_bias or bool(cfg.get("attention_bias", False)),
            o_bias=not spec.qkv_bias and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=spec.qk_norm,
            clip_qkv=cfg.get("clip_qkv"),
            rope=gemma.pop("rope", None) or RopeConfig.from_hf(cfg, head_dim),
            moe=_moe_config(cfg, spec, layers),
            sliding_windows=gemma.pop("sliding_windows", None) or _sliding_windows(cfg, arch, layers),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id"), int(cfg["vocab_size"])),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            activation=ACTIVATIONS[act_name],
            attn_scale=gemma.pop("attn_scale", head_dim ** -0.5),
            **gemma,
        )


def _gemma_fields(cfg: dict[str, Any], head_dim: int, hidden: int, layers: int) -> dict[str, Any]:
    """Gemma 3's switches, read as transformers' Gemma3TextConfig reads them."""
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention (an encoder-style Gemma 3) is not supported: streamserve "
                             "serves causal decoders")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("attn_logit_softcapping is not supported (Gemma 3 checkpoints set it to null; Gemma 2 "
                             "ones need it): use a Gemma 3 checkpoint")
    pattern = int(cfg["sliding_window_pattern"])  # older configs: every pattern-th layer is global
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"layer_types must list {layers} of 'sliding_attention' / 'full_attention', got {types}")
    window = int(cfg["sliding_window"])
    global_rope, local_rope = layer_kind_ropes(cfg, head_dim)
    return dict(
        rope=global_rope,
        local_rope=local_rope,
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types),
        attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
        sandwich_norms=True,
        norm_offset=1.0,
        embed_scale=hidden ** 0.5,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
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
    if arch in ("Qwen3ForCausalLM", "Qwen2ForCausalLM"):
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
