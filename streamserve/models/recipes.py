"""Which checkpoint tensors fill each parameter of `CausalLM`, per architecture (Hugging Face names).

A GGUF file is read through the same recipes: its tensors are renamed to these names first.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamserve.models.config import ModelConfig


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor that fills a slice of a parameter."""

    name: str
    shape: tuple[int, ...]
    add: float = 0.0  # a constant added to the tensor as it is loaded (Gemma's norms scale by 1 + w: folded in)


def param_recipes(cfg: ModelConfig) -> dict[str, list[list[Piece]]]:
    """For each parameter of `CausalLM`, the checkpoint layouts that can fill it, in order of preference.

    A layout is a list of pieces concatenated along the first axis of the parameter viewed as
    [-1, last_dim] (1-D parameters: along their only axis).
    """
    D, V, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    H, KVH = cfg.num_heads, cfg.num_kv_heads
    off = cfg.norm_offset  # Gemma's norms scale by (1 + w): every norm weight gets the 1 added as it loads

    def norm(name: str, size: int) -> list[list[Piece]]:
        return [[Piece(name, (size,), add=off)]]

    r: dict[str, list[list[Piece]]] = {
        "embed_tokens.weight": [[Piece("model.embed_tokens.weight", (V, D))]],
        "norm": norm("model.norm.weight", D),
    }
    if not cfg.tie_word_embeddings:
        r["lm_head.weight"] = [[Piece("lm_head.weight", (V, D))]]
    qn = {"per_head": (hd, hd), "full": (H * hd, KVH * hd)}.get(cfg.qk_norm)
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        a = src + "self_attn."
        for n in ("input_layernorm", "post_attention_layernorm") + (
                ("pre_feedforward_layernorm", "post_feedforward_layernorm") if cfg.sandwich_norms else ()):
            r[dst + n] = norm(f"{src}{n}.weight", D)
        r[dst + "self_attn.qkv_proj.weight"] = [[Piece(a + "q_proj.weight", (H * hd, D)),
                                                 Piece(a + "k_proj.weight", (KVH * hd, D)),
                                                 Piece(a + "v_proj.weight", (KVH * hd, D))]]
        r[dst + "self_attn.o_proj.weight"] = [[Piece(a + "o_proj.weight", (D, H * hd))]]
        if cfg.qkv_bias:
            r[dst + "self_attn.qkv_proj.bias"] = [[Piece(a + "q_proj.bias", (H * hd,)),
                                                   Piece(a + "k_proj.bias", (KVH * hd,)),
                                                   Piece(a + "v_proj.bias", (KVH * hd,))]]
        if cfg.o_bias:
            r[dst + "self_attn.o_proj.bias"] = [[Piece(a + "o_proj.bias", (D,))]]
        if qn:
            r[dst + "self_attn.q_norm"] = norm(a + "q_norm.weight", qn[0])
            r[dst + "self_attn.k_norm"] = norm(a + "k_norm.weight", qn[1])
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            r.update(_moe_recipes(cfg, src, dst))
        else:
            inter, m = cfg.intermediate_size, src + "mlp."
            r[dst + "mlp.gate_up_proj.weight"] = [[Piece(m + "gate_proj.weight", (inter, D)),
                                                   Piece(m + "up_proj.weight", (inter, D))]]
            r[dst + "mlp.down_proj.weight"] = [[Piece(m + "down_proj.weight", (D, inter))]]
            if cfg.mlp_bias:
                r[dst + "mlp.gate_up_proj.bias"] = [[Piece(m + "gate_proj.bias", (inter,)),
                                                     Piece(m + "up_proj.bias", (inter,))]]
                r[dst + "mlp.down_proj.bias"] = [[Piece(m + "down_proj.bias", (D,))]]
    return r


def _moe_recipes(cfg: ModelConfig, src: str, dst: str) -> dict[str, list[list[Piece]]]:
    assert cfg.moe is not None
    E, inter, D = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size
    m, b = src + "mlp.", src + "block_sparse_moe."  # Qwen3-MoE / OLMoE / transformers 5; Mixtral
    return {
        dst + "mlp.gate.weight": [[Piece(m + "gate.weight", (E, D))], [Piece(b + "gate.weight", (E, D))]],
        dst + "mlp.experts_gate_up": [
            [p for e in range(E) for p in (Piece(f"{m}experts.{e}.gate_proj.weight", (inter, D)),
                                           Piece(f"{m}experts.{e}.up_proj.weight", (inter, D)))],
            [p for e in range(E) for p in (Piece(f"{b}experts.{e}.w1.weight", (inter, D)),
                                           Piece(f"{b}experts.{e}.w3.weight", (inter, D)))],
            [Piece(m + "experts.gate_up_proj", (E, 2 * inter, D))],
        ],
        dst + "mlp.experts_down": [
            [Piece(f"{m}experts.{e}.down_proj.weight", (D, inter)) for e in range(E)],
            [Piece(f"{b}experts.{e}.w2.weight", (D, inter)) for e in range(E)],
            [Piece(m + "experts.down_proj", (E, D, inter))],
        ],
    }
