"""A GGUF file's metadata -> the Hugging Face `config.json` dict of the same model -> `ModelConfig`.

There is one config path: the dict built here goes through `ModelConfig.from_hf` exactly as a
checkpoint folder's config.json does. llama.cpp's keys are `<arch>.<key>`; where the file states
nothing (Gemma 3's layer pattern, its query scale), this follows what llama.cpp itself assumes.
"""

from __future__ import annotations

import math
from typing import Any

from gguf import GGMLQuantizationType as Q

from streamserve.errors import ModelLoadError, UnsupportedArchitectureError
from streamserve.models.config import ModelConfig
from streamserve.models.gguf.reader import GGUFFile
from streamserve.models.gguf.tensors import dequantized

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "qwen3moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM"}
GEMMA3_GLOBAL_EVERY = 6  # llama.cpp and transformers: layers 5, 11, 17, ... attend globally, the rest in a window
GEMMA3_27B_LAYERS = 62  # llama.cpp scales Gemma 3 27B's queries by (hidden / heads), every other size by head_dim
# (low_freq_factor, high_freq_factor) pairs tried when reading Llama 3 RoPE parameters back from rope_freqs
_LLAMA3_FACTORS = [(1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)]


def gguf_config(f: GGUFFile) -> ModelConfig:
    return ModelConfig.from_hf(hf_config_dict(f))


def hf_config_dict(f: GGUFFile) -> dict[str, Any]:
    """The transformers config dict of the model a GGUF file holds."""
    arch = f.architecture
    if arch not in HF_ARCHITECTURES:
        raise UnsupportedArchitectureError(f"GGUF architecture {arch!r} ({f.path.name}) is not supported; "
                                           f"supported: {', '.join(HF_ARCHITECTURES)}")
    hidden, layers = int(f.require("embedding_length")), int(f.require("block_count"))
    heads = int(f.require("attention.head_count"))
    kv_heads = _one_per_model(f, "attention.head_count_kv", heads)
    head_dim = int(f.arch_key("attention.key_length") or hidden // heads)
    embed = f.tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{f.path} has no token_embd.weight tensor")
    cfg: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(f.arch_key("feed_forward_length") or _ffn_width(f, layers)),
        "rms_norm_eps": float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(f.arch_key("context_length", 2048)),
        "vocab_size": embed.shape[0],  # the embedding's rows: a tokenizer may list fewer (padded vocabularies)
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "rope_theta": float(f.arch_key("rope.freq_base", 10000.0)),
        # llama.cpp ends generation at eos and at the end-of-turn / end-of-message tokens (Gemma's <end_of_turn>)
        "eos_token_id": [i for i in (f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
                         if isinstance(i, int)],
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "pad_token_id": f.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": _dtype(f),
    }
    rot = f.arch_key("rope.dimension_count")
    if rot and int(rot) != head_dim:  # RopeConfig refuses partial rotary with a clear error
        cfg["partial_rotary_factor"] = int(rot) / head_dim
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_output.bias" in f.tensors
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in f.tensors
    scaling = _rope_scaling(f, cfg)
    if scaling:
        cfg["rope_scaling"] = scaling
    if arch == "qwen3moe":
        cfg.update(_moe(f, layers))
    if arch == "gemma3":
        cfg.update(_gemma3(f, layers, hidden, heads, head_dim))
    return cfg


def _one_per_model(f: GGUFFile, key: str, default: int) -> int:
    """A count llama.cpp may write per layer (an array): streamserve needs it equal in every layer."""
    v = f.arch_key(key, default)
    if isinstance(v, list):
        if len(set(v)) != 1:
            raise ModelLoadError(f"{f.path.name}: {key} differs between layers ({sorted(set(v))}); streamserve "
                                 "needs one value for the whole model")
        v = v[0]
    return int(v)


def _ffn_width(f: GGUFFile, layers: int) -> int:
    """The dense MLP width from a tensor, when the metadata omits it (all-expert MoE files)."""
    for i in range(layers):
        t = f.tensors.get(f"blk.{i}.ffn_gate.weight")
        if t is not None:
            return t.shape[0]
    return 0


def _dtype(f: GGUFFile) -> str:
    """The checkpoint dtype a GPU computes in: the half type of an unquantized file, else bfloat16
    (quantized weights are dequantized at load; bf16 keeps fp32's range, which Gemma's activations need)."""
    types = {t.ggml_type for t in f.tensors.values()}
    if types <= {Q.F32, Q.F16, Q.BF16}:
        return "bfloat16" if Q.BF16 in types else "float16" if Q.F16 in types else "float32"
    return "bfloat16"


def _rope_scaling(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, Any] | None:
    kind = str(f.arch_key("rope.scaling.type", "none"))
    factor = f.arch_key("rope.scaling.factor")
    original = f.arch_key("rope.scaling.original_context_length")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            out["original_max_position_embeddings"] = int(original)
        return out
    if kind not in ("none", "linear", "yarn"):
        raise ModelLoadError(f"{f.path.name}: rope scaling {kind!r} is not supported (linear, yarn, Llama 3's "
                             "rope_freqs)")
    if "rope_freqs.weight" in f.tensors:
        return _llama3_scaling(f, cfg["rope_theta"], cfg["head_dim"])
    return None


def _llama3_scaling(f: GGUFFile, theta: float, head_dim: int) -> dict[str, Any]:
    """Llama 3.x files carry the per-frequency RoPE divisors llama.cpp computed from the config's
    rope_scaling, not the parameters: find the parameters that give exactly those divisors."""
    stored = [float(x) for x in dequantized(f.tensors["rope_freqs.weight"]).reshape(-1)]
    freqs = [theta ** -(2 * i / head_dim) for i in range(head_dim // 2)]
    if len(stored) != len(freqs):
        raise ModelLoadError(f"{f.path.name}: rope_freqs has {len(stored)} values, head_dim {head_dim} needs "
                             f"{len(freqs)}")
    factor = max(stored)
    for low, high in _LLAMA3_FACTORS:
        for ctx in _llama3_contexts(stored, freqs, factor, low, high):
            if all(math.isclose(a, b, rel_tol=1e-3)
                   for a, b in zip(stored, _llama3_divisors(freqs, factor, low, high, ctx), strict=True)):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": ctx}
    raise ModelLoadError(f"{f.path.name}: its rope_freqs tensor matches no Llama 3 RoPE profile streamserve knows; "
                         "use the model's safetensors checkpoint")


def _llama3_divisors(freqs: list[float], factor: float, low: float, high: float, ctx: int) -> list[float]:
    """What llama.cpp's converter stores for these parameters: inv_freq / scaled inv_freq, per frequency."""
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < ctx / high:
            out.append(1.0)
        elif wavelen > ctx / low:
            out.append(factor)
        else:
            smooth = (ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _llama3_contexts(stored: list[float], freqs: list[float], factor: float, low: float, high: float) -> list[int]:
    """Candidate pre-scaling contexts: powers of two, and the one a smoothed divisor implies."""
    found = [2 ** k for k in range(4, 22)]
    for d, freq in zip(stored, freqs, strict=True):
        if 1.0 + 1e-4 < d < factor - 1e-4 and factor > 1:
            smooth = (1 / d - 1 / factor) / (1 - 1 / factor)
            found.insert(0, round(2 * math.pi / freq * (smooth * (high - low) + low)))
            break
    return found


def _moe(f: GGUFFile, layers: int) -> dict[str, Any]:
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in f.tensors]
    return {
        "num_experts": int(f.require("expert_count")),
        "num_experts_per_tok": int(f.require("expert_used_count")),
        "moe_intermediate_size": int(f.require("expert_feed_forward_length")),
        "norm_topk_prob": True,  # llama.cpp always renormalises Qwen3-MoE's top-k weights
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
    }


def _gemma3(f: GGUFFile, layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    pattern = f.arch_key("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == layers:  # newer files: per layer, True = sliding
        types = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        types = ["full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
                 for i in range(layers)]
    return {
        "model_type": "gemma3_text",
        "layer_types": types,
        "sliding_window": int(f.require("attention.sliding_window")),
        "query_pre_attn_scalar": hidden // heads if layers == GEMMA3_27B_LAYERS else head_dim,
        "rope_local_base_freq": 10000.0,  # not in the file: llama.cpp fixes it for every Gemma 3
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": f.arch_key("final_logit_softcapping"),
        "attn_logit_softcapping": None,
    }
