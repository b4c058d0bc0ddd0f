"""The tensors of a GGUF file under the Hugging Face names `models.recipes` consumes.

llama.cpp's converter renames every tensor (`blk.3.attn_q.weight`), stores dimensions reversed,
block-quantizes most weights, and transforms a few values; `GGUFCheckpoint` undoes all of that per
tensor, at read time, so the loader's shape checks and q|k|v / gate|up fusing run unchanged:

- names: `blk.N.<leaf>` -> `model.layers.N.<module>` (the FFN norm is `post_attention_layernorm` in a
  pre-norm model, `pre_feedforward_layernorm` in Gemma 3's sandwich);
- values: dequantized with `gguf.quants.dequantize` (numpy, fp32);
- Llama: q and k rows were permuted for llama.cpp's RoPE layout (interleaved pairs): un-permuted;
- Gemma 3: norm weights were stored as 1 + w; w is returned (the recipes add the 1 back, once);
- Qwen3-MoE: the 3-D expert tensors become transformers' `experts.gate_up_proj` [E, 2*I, D] (gate
  rows first) and `experts.down_proj` [E, D, I].
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import dequantize

from streamserve.errors import ModelLoadError
from streamserve.models.gguf.grids import grid
from streamserve.models.gguf.reader import GGUFFile, TensorEntry, UnsupportedTensorTypeError

SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K})

_GLOBAL = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
_GEMMA = ("gemma3",)  # architectures whose norms llama.cpp stores as 1 + w


@dataclass(frozen=True)
class Source:
    """How one Hugging Face tensor is made from the file: the GGUF tensors (concatenated on `cat_dim`),
    then one value transform."""

    parts: tuple[str, ...]
    shape: tuple[int, ...]
    cat_dim: int = 0
    transform: str = ""  # "", "unpermute:<heads>" (llama q/k), "minus_one" (Gemma norms)


def hf_sources(f: GGUFFile) -> dict[str, Source]:
    """{Hugging Face name: Source} for every tensor of the file streamserve knows how to name."""
    arch = f.architecture
    heads, kv_heads = int(f.arch_key("attention.head_count", 0) or 0), f.arch_key("attention.head_count_kv", 0)
    if isinstance(kv_heads, list):  # written per layer (the config refuses lists that differ)
        kv_heads = kv_heads[0] if kv_heads else 0
    kv_heads = int(kv_heads) or heads
    out: dict[str, Source] = {}
    for name, t in f.tensors.items():
        hf = _hf_name(name, arch)
        if hf is None:
            continue
        transform = ""
        if arch == "llama" and re.search(r"\.attn_[qk]\.", name):  # llama.cpp's converter permutes these
            transform = f"unpermute:{heads if '.attn_q.' in name else kv_heads}"
        elif arch in _GEMMA and hf.endswith("norm.weight"):
            transform = "minus_one"
        out[hf] = Source((name,), t.shape, transform=transform)
    for name, t in f.tensors.items():  # Qwen3-MoE experts: [E, I, D] gate and up -> [E, 2I, D]
        m = re.fullmatch(r"blk\.(\d+)\.ffn_gate_exps\.weight", name)
        up = f"blk.{m.group(1)}.ffn_up_exps.weight" if m else ""
        if m and up in f.tensors:
            e, i, d = t.shape
            out[f"model.layers.{m.group(1)}.mlp.experts.gate_up_proj"] = Source((name, up), (e, 2 * i, d), cat_dim=1)
    return out


def _hf_name(name: str, arch: str) -> str | None:
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    m = _LAYER_NAME.fullmatch(name)
    if m is None:
        return None
    layer, leaf, suffix = m.groups()
    if leaf == "ffn_down_exps":
        return f"model.layers.{layer}.mlp.experts.down_proj"
    if leaf == "ffn_norm":  # the norm before the MLP: in a sandwich (Gemma 3) it has a name of its own
        module = "pre_feedforward_layernorm" if arch in _GEMMA else "post_attention_layernorm"
    else:
        module = _LAYER.get(leaf, "")
    return f"model.layers.{layer}.{module}.{suffix}" if module else None


def _check_type(t: TensorEntry) -> None:
    if t.ggml_type not in SUPPORTED_TYPES:
        raise UnsupportedTensorTypeError(
            f"tensor {t.name} is stored as {t.ggml_type.name}, which streamserve cannot dequantize; supported: "
            f"{', '.join(sorted(q.name for q in SUPPORTED_TYPES))} (re-quantize the file, e.g. to Q4_K_M)")


def dequantized(t: TensorEntry) -> np.ndarray:
    """The tensor as fp32 values in torch order (quantized rows expand from bytes to values)."""
    _check_type(t)
    if t.ggml_type == Q.Q8_0:
        return _q8_0(t.data).reshape(t.shape)
    return dequantize(t.data, t.ggml_type).reshape(t.shape)


Q8_0_BLOCK = 34  # bytes: an fp16 scale, then 32 int8 values


def _q8_0(data: np.ndarray) -> np.ndarray:
    """Q8_0 blocks -> fp32 scale * value, the same bits as gguf.quants (both factors are exact in fp32, one
    rounding), in torch's threaded kernels: Gemma 3 270M's Q8_0 embedding [262144, 640] takes 1 s, not 8-15 s."""
    blocks = np.asarray(data).reshape(-1, Q8_0_BLOCK)  # [n_blocks, 34] bytes, still the mapped file
    scale = torch.from_numpy(blocks[:, :2].copy().view(np.float16)).float()  # [n_blocks, 1]
    values = torch.from_numpy(blocks[:, 2:].copy().view(np.int8)).float()  # [n_blocks, 32]
    return values.mul_(scale).numpy()


class GGUFCheckpoint:
    """A GGUF file as a checkpoint source: the interface of `loader.Checkpoint`, Hugging Face names."""

    def __init__(self, f: GGUFFile) -> None:
        self.file = f
        self.sources = hf_sources(f)
        self.label = f.path.name
        for src in self.sources.values():  # refuse a type it cannot read now, before a model is allocated
            for part in src.parts:
                _check_type(f.tensors[part])

    def __contains__(self, name: str) -> bool:
        return name in self.sources

    def names(self) -> Iterator[str]:
        return iter(self.sources)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.sources[name].shape

    def nbytes(self, name: str) -> int:
        return sum(self.file.tensors[p].nbytes for p in self.sources[name].parts)

    def unused(self) -> list[str]:
        """GGUF tensors no Hugging Face name maps to (e.g. llama.cpp's precomputed rope_freqs)."""
        used = {p for s in self.sources.values() for p in s.parts}
        return sorted(n for n in self.file.tensors if n not in used)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as transformers would hold it, fp32."""
        src = self.sources[name]
        parts = [dequantized(self.file.tensors[p]) for p in src.parts]
        values = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=src.cat_dim)
        if src.transform.startswith("unpermute:"):
            values = _unpermute(values, int(src.transform.split(":")[1]))
        elif src.transform == "minus_one":
            values = values - np.float32(1.0)
        if not values.flags.writeable:  # an F32 tensor comes back as a view of the read-only map
            values = values.copy()
        return torch.from_numpy(np.ascontiguousarray(values))

    def stored_types(self, name: str) -> list[Q]:
        """How the file stores the tensor's parts (F32, Q8_0, Q4_1...): what `quantize="auto"` keeps."""
        return [self.file.tensors[p].ggml_type for p in self.sources[name].parts]

    def grid(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A Q4_0/Q4_1/Q4_K weight's per-group (scale, zero) fp32 [N, K / 32] under the same row transform as
        `get` (gguf/grids.py), so the loaded values' 4-bit codes can be recovered exactly; None otherwise."""
        src = self.sources[name]
        if len(src.parts) != 1 or src.transform == "minus_one":
            return None
        g = grid(self.file.tensors[src.parts[0]])
        if g is None or not src.transform.startswith("unpermute:"):
            return g
        heads = int(src.transform.split(":")[1])
        scale, zero = (torch.from_numpy(np.ascontiguousarray(_unpermute(t.numpy(), heads))) for t in g)
        return scale, zero

    def head(self, name: str, rows: int) -> torch.Tensor:
        """The first `rows` rows as stored (dequantized, no transform): enough to tell two files apart."""
        t = self.file.tensors[self.sources[name].parts[0]]
        _check_type(t)
        return torch.from_numpy(dequantize(np.array(t.data[:rows]), t.ggml_type).astype(np.float32))


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. Its RoPE rotates adjacent pairs, transformers' rotate_half
    the two halves of a head, so per head the converter reordered rows [h, 2, hd/2] -> [h, hd/2, 2];
    this reads the stored rows as [h, hd/2, 2] and swaps them back to [h, 2, hd/2]."""
    rows = w.shape[0]
    if heads <= 0 or rows % (2 * heads):
        raise ModelLoadError(f"a q/k projection with {rows} rows cannot hold {heads} heads of even size: the file's "
                             "attention.head_count / head_count_kv metadata does not fit its tensors")
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
