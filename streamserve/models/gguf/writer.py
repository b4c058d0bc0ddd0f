"""Write a Hugging Face checkpoint folder as a GGUF file, laid out as llama.cpp's converter lays it out.

    python -m streamserve.models.gguf.writer CHECKPOINT_DIR OUT.gguf --type Q8_0

For small models and for tests: the tests write their tiny random checkpoints with it and check that
streamserve and transformers read the file alike. What llama.cpp's convert_hf_to_gguf.py does, and
this repeats: `<arch>.*` hyperparameters; names from gguf's own tensor-name map; Llama q/k rows
permuted for llama.cpp's RoPE; Gemma norms stored as 1 + w; Qwen3-MoE experts stacked into 3-D
`ffn_{gate,up,down}_exps`; 1-D tensors and the router kept in F32; a byte-level BPE tokenizer.json as
`tokenizer.ggml.*`. A tensor whose rows do not split into the type's blocks falls back to Q8_0, or F32.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from streamserve.errors import ModelLoadError, UnsupportedArchitectureError
from streamserve.models.config import ModelConfig
from streamserve.models.rope import RopeConfig

GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "Qwen3MoeForCausalLM": "qwen3moe", "Gemma3ForCausalLM": "gemma3"}
UNUSED = 5  # llama.cpp's token type of padding tokens
Quantizer = Callable[[np.ndarray, Q], np.ndarray]  # fp32 values [rows, cols] -> uint8 blocks [rows, bytes]


def write_gguf(folder: Path, out: Path, tensor_type: Q | Callable[[str], Q] = Q.F32,
               quantizer: Quantizer = gguf.quants.quantize, tokenizer: dict[str, Any] | None = None,
               pre: str = "default") -> Path:
    """Write the checkpoint in `folder` to `out`. `tensor_type`: one type, or one per GGUF tensor name (a mix,
    as llama.cpp's Q4_K_M). `quantizer` makes the blocks (gguf's numpy quantizer by default; it has none for
    the K-quants). `tokenizer`: `tokenizer.ggml.*` metadata to write instead of the folder's tokenizer.json
    (keys without the prefix, e.g. {"model": "llama", "tokens": ...})."""
    from safetensors.torch import load_file

    raw = json.loads((folder / "config.json").read_text())
    cfg = ModelConfig.from_hf(raw)
    arch = GGUF_ARCH.get(cfg.architecture)
    if arch is None:
        raise UnsupportedArchitectureError(f"no GGUF layout for {cfg.architecture}; supported: {', '.join(GGUF_ARCH)}")
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(folder.name)
    _hyperparameters(w, arch, cfg, raw)
    _tokenizer(w, folder, raw, tokenizer, pre)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_layers)
    for name, value in _llama_cpp_tensors(arch, cfg, tensors).items():
        stem, _, suffix = name.rpartition(".")
        target = name if name.startswith("blk.") else names.get_name(stem)
        if target is None:
            raise ModelLoadError(f"tensor {name} has no GGUF name for {arch}")
        target = target if name.startswith("blk.") else f"{target}.{suffix}"
        qtype = tensor_type(target) if callable(tensor_type) else tensor_type
        _add_tensor(w, target, value.float().numpy(), qtype, quantizer)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _hyperparameters(w: gguf.GGUFWriter, arch: str, cfg: ModelConfig, raw: dict[str, Any]) -> None:
    k = f"{arch}."
    w.add_uint32(k + "context_length", cfg.max_position_embeddings)
    w.add_uint32(k + "embedding_length", cfg.hidden_size)
    w.add_uint32(k + "block_count", cfg.num_layers)
    w.add_uint32(k + "feed_forward_length", cfg.intermediate_size)
    w.add_uint32(k + "attention.head_count", cfg.num_heads)
    w.add_uint32(k + "attention.head_count_kv", cfg.num_kv_heads)
    w.add_float32(k + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(k + "rope.freq_base", cfg.rope.theta)
    if arch == "llama":
        w.add_uint32(k + "vocab_size", cfg.vocab_size)
        w.add_uint32(k + "rope.dimension_count", cfg.head_dim)
    else:
        w.add_uint32(k + "attention.key_length", cfg.head_dim)
        w.add_uint32(k + "attention.value_length", cfg.head_dim)
    if cfg.rope.rope_type in ("linear", "yarn"):
        w.add_string(k + "rope.scaling.type", cfg.rope.rope_type)
        w.add_float32(k + "rope.scaling.factor", float(cfg.rope.params["factor"]))
    if cfg.rope.rope_type == "yarn":
        w.add_uint32(k + "rope.scaling.original_context_length",
                     int(cfg.rope.params["original_max_position_embeddings"]))
    if cfg.rope.rope_type == "llama3":  # llama.cpp stores Llama 3's per-frequency divisors as a tensor
        base, _ = RopeConfig(theta=cfg.rope.theta, head_dim=cfg.head_dim).inv_freq()
        scaled, _ = cfg.rope.inv_freq()
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    if cfg.moe is not None:
        w.add_uint32(k + "expert_count", cfg.moe.num_experts)
        w.add_uint32(k + "expert_used_count", cfg.moe.top_k)
        w.add_uint32(k + "expert_feed_forward_length", cfg.moe.intermediate_size)
    if arch == "gemma3":
        w.add_uint32(k + "attention.sliding_window", int(raw["sliding_window"]))


def _tokenizer(w: gguf.GGUFWriter, folder: Path, raw: dict[str, Any], given: dict[str, Any] | None, pre: str) -> None:
    meta = dict(given) if given is not None else _byte_level_metadata(folder, pre)
    vocab = int(raw["vocab_size"])
    if len(meta["tokens"]) < vocab:  # as llama.cpp: the embedding's extra rows get [PADi] tokens, type UNUSED
        n = len(meta["tokens"])
        meta["tokens"] = [*meta["tokens"], *(f"[PAD{i}]" for i in range(n, vocab))]
        meta["token_type"] = [*meta.get("token_type", [1] * n), *([UNUSED] * (vocab - n))]
        if "scores" in meta:
            meta["scores"] = [*meta["scores"], *([-1000.0] * (vocab - n))]
    for key, value in meta.items():
        full = f"tokenizer.ggml.{key}" if key != "chat_template" else "tokenizer.chat_template"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        elif key == "scores":
            w.add_array(full, [float(v) for v in value])
        elif key == "token_type":
            w.add_key_value(full, [int(v) for v in value], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
        else:
            w.add_array(full, list(value))
    for key, cfg_key in (("eos_token_id", "eos_token_id"), ("bos_token_id", "bos_token_id"),
                         ("padding_token_id", "pad_token_id")):
        if key not in meta and isinstance(raw.get(cfg_key), int):
            w.add_uint32(f"tokenizer.ggml.{key}", raw[cfg_key])


def _byte_level_metadata(folder: Path, pre: str) -> dict[str, Any]:
    """A byte-level BPE tokenizer.json as llama.cpp's "gpt2" vocabulary: tokens by id, merges, token types."""
    tj = json.loads((folder / "tokenizer.json").read_text())
    model = tj["model"]
    if model.get("type") != "BPE":
        raise ModelLoadError(f"{folder}/tokenizer.json is not a BPE tokenizer; pass its GGUF metadata explicitly")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {a["content"] for a in tj.get("added_tokens", []) if a.get("special")}
    for a in tj.get("added_tokens", []):
        vocab.setdefault(a["content"], a["id"])
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    meta: dict[str, Any] = {"model": "gpt2", "pre": pre, "tokens": tokens,
                            "token_type": [3 if t in special else 1 for t in tokens], "merges": merges}
    tc = folder / "tokenizer_config.json"
    template = json.loads(tc.read_text()).get("chat_template") if tc.exists() else None
    if isinstance(template, str):
        meta["chat_template"] = template
    return meta


def _llama_cpp_tensors(arch: str, cfg: ModelConfig, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> llama.cpp's values: the Llama q/k permutation, Gemma's 1 + w, stacked experts
    (named blk.N.ffn_*_exps.weight here; every other tensor keeps its Hugging Face name)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, value in t.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = value
            continue
        if arch == "llama" and re.search(r"self_attn\.[qk]_proj\.", name):
            heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
            value = value.reshape(heads, 2, value.shape[0] // heads // 2, *value.shape[1:]).swapaxes(1, 2)
            value = value.reshape(t[name].shape)
        if arch == "gemma3" and name.endswith("norm.weight"):
            value = value.float() + 1.0
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        out[name] = value
    for (layer, kind), by_expert in sorted(experts.items()):
        out[f"blk.{layer}.ffn_{kind}_exps.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _add_tensor(w: gguf.GGUFWriter, name: str, values: np.ndarray, qtype: Q, quantizer: Quantizer) -> None:
    if values.ndim == 1 or name.endswith("ffn_gate_inp.weight") or qtype == Q.F32:
        w.add_tensor(name, values.astype(np.float32))
        return
    if qtype == Q.F16:
        w.add_tensor(name, values.astype(np.float16))
        return
    cols = values.shape[-1]
    for q in (qtype, Q.Q8_0):
        if cols % gguf.GGML_QUANT_SIZES[q][0] == 0:
            blocks = quantizer(values.reshape(-1, cols), q)
            w.add_tensor(name, blocks.reshape(*values.shape[:-1], -1), raw_dtype=q)
            return
    w.add_tensor(name, values.astype(np.float32))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m streamserve.models.gguf.writer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--type", default="F32", choices=["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
    p.add_argument("--pre", default="default", help="tokenizer.ggml.pre: the pre-tokenizer the vocabulary needs")
    args = p.parse_args(argv)
    print(f"wrote {write_gguf(args.folder, args.out, Q[args.type], pre=args.pre)}")


if __name__ == "__main__":
    main()
