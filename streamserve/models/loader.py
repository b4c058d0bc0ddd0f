"""Load a checkpoint into `CausalLM`: a Hugging Face safetensors folder or a GGUF file.

Both are checkpoint sources with one small interface (`CheckpointSource`: Hugging Face tensor names,
shapes, byte sizes, values). Safetensors files are memory-mapped (one file, or shards listed in
`model.safetensors.index.json`); a GGUF file is dequantized tensor by tensor (models/gguf). Each model
parameter is filled in place from one or more checkpoint tensors (q|k|v and gate|up are fused here;
per-expert tensors are stacked into [E, ...]), converted to the target dtype on the way. Every tensor
is shape-checked, and errors name the tensor and both shapes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from streamserve.errors import MissingTensorError, ModelLoadError, TensorShapeError
from streamserve.models.config import ModelConfig
from streamserve.models.gguf import GGUFCheckpoint, gguf_config, gguf_tokenizer, is_gguf, open_gguf
from streamserve.models.model import CausalLM
from streamserve.models.ops import TORCH_OPS, Ops
from streamserve.models.quantize import check_mode, quantize_model, sources_from
from streamserve.models.recipes import Piece, param_recipes
from streamserve.models.tokenizer import Tokenizer

log = logging.getLogger("streamserve")

# show a progress bar when the weights take more than this in memory: the loaded size, not the stored one, is
# what the time follows (a Q4 GGUF file is an eighth of its fp32 weights, and every value is dequantized)
PROGRESS_MIN_BYTES = 256 * 2**20
_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",  # buffers some old checkpoints carry
                     "rope_freqs.weight")  # llama.cpp's Llama 3 RoPE divisors: read into the config instead


class CheckpointSource(Protocol):
    """Tensors by Hugging Face name: what `load_model` reads a checkpoint through."""

    label: str  # for messages: the folder's or file's name

    def __contains__(self, name: str) -> bool: ...
    def names(self) -> Iterable[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def nbytes(self, name: str) -> int: ...  # as stored: what the progress bar counts
    def get(self, name: str) -> torch.Tensor: ...
    def head(self, name: str, rows: int) -> torch.Tensor: ...  # the first rows, as stored


class Checkpoint:
    """The tensors of a checkpoint folder, memory-mapped: {name: (file, shape, dtype)}."""

    def __init__(self, folder: Path) -> None:
        self.label = folder.name
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            hint = " (found PyTorch .bin files: convert them to safetensors)" if any(folder.glob("*.bin")) else ""
            raise ModelLoadError(f"no safetensors weights in {folder}{hint}")
        self._handles = {}
        self.meta: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for f in files:
            path = folder / f
            if not path.exists():
                raise ModelLoadError(f"shard {f} named in {index.name} is missing from {folder}")
            try:
                h = self._handles[f] = safe_open(str(path), framework="pt", device="cpu")
                for name in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    sl = h.get_slice(name)
                    self.meta[name] = (f, tuple(sl.get_shape()), sl.get_dtype())
            except Exception as e:  # safetensors raises its own (untyped) errors for a truncated or damaged file
                raise ModelLoadError(f"{path} is not a readable safetensors file ({e}); download it again") from None

    def __contains__(self, name: str) -> bool:
        return name in self.meta

    def names(self) -> Iterable[str]:
        return self.meta.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][1]

    def nbytes(self, name: str) -> int:
        _, shape, dtype = self.meta[name]
        return int(torch.Size(shape).numel()) * _ITEMSIZE.get(dtype, 4)

    def get(self, name: str) -> torch.Tensor:
        return self._handles[self.meta[name][0]].get_tensor(name)

    def head(self, name: str, rows: int) -> torch.Tensor:
        """The first `rows` rows of a tensor, read without loading the rest."""
        return self._handles[self.meta[name][0]].get_slice(name)[:rows]


@dataclass
class Pretrained:
    """A model on disk, opened: its normalised config and its weights (not read yet)."""

    path: Path
    config: ModelConfig
    checkpoint: CheckpointSource

    def tokenizer(self) -> Tokenizer:
        if isinstance(self.checkpoint, GGUFCheckpoint):
            return gguf_tokenizer(self.checkpoint.file)
        return Tokenizer.from_dir(self.path)


def open_pretrained(path: Path) -> Pretrained:
    """A checkpoint folder (config.json, safetensors, tokenizer.json) or a GGUF file."""
    if path.is_file() or path.suffix.lower() == ".gguf":
        if not is_gguf(path) and path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a GGUF file; pass a .gguf file or a checkpoint folder")
        f = open_gguf(path)  # typed errors for a missing, foreign or damaged file
        return Pretrained(path, gguf_config(f), GGUFCheckpoint(f))
    return Pretrained(path, ModelConfig.from_file(path / "config.json"), Checkpoint(path))


def open_checkpoint(path: Path) -> CheckpointSource:
    """The weights of a checkpoint folder or a GGUF file."""
    if path.is_file() or path.suffix.lower() == ".gguf":
        return GGUFCheckpoint(open_gguf(path))
    return Checkpoint(path)


def load_model(checkpoint: Path | CheckpointSource, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               ops: Ops = TORCH_OPS, quantize: str = "none") -> CausalLM:
    """`checkpoint`: a folder or GGUF file path, or a source already opened (`Pretrained.checkpoint`).
    `quantize`: "none", "auto" (a GGUF file keeps its quantized weights), "int8" or "int4" (models/quantize.py)."""
    check_mode(quantize)
    ckpt = open_checkpoint(checkpoint) if isinstance(checkpoint, Path) else checkpoint
    label = ckpt.label
    recipes = param_recipes(cfg)
    with torch.device("meta"):
        model = CausalLM(cfg, ops).to(dtype)  # the dtype first: memory is only taken once, at its final size
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # materialising "meta" parameters unties them
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope(device)  # buffers built on "meta" are recomputed for real

    chosen: dict[str, list[Piece]] = {}
    for name, _ in model.named_parameters():
        options = recipes.get(name)
        if options is None:
            raise ModelLoadError(f"internal: no checkpoint mapping for parameter {name}")
        layout = next((o for o in options if all(p.name in ckpt for p in o)), None)
        if layout is None:
            missing = next(p.name for p in options[0] if p.name not in ckpt)
            raise MissingTensorError(f"tensor {missing} (shape {list(options[0][0].shape)}) is missing from "
                                     f"the checkpoint {label}")
        for p in layout:
            if ckpt.shape(p.name) != p.shape:
                raise TensorShapeError(f"tensor {p.name} has shape {list(ckpt.shape(p.name))}, "
                                       f"the config implies {list(p.shape)}")
        chosen[name] = layout

    total = sum(ckpt.nbytes(p.name) for layout in chosen.values() for p in layout)  # the bar counts stored bytes
    params = dict(model.named_parameters())
    loaded = sum(p.numel() * p.element_size() for p in params.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {label}",
              disable=loaded < PROGRESS_MIN_BYTES) as bar, torch.no_grad():
        for name, layout in chosen.items():
            dst = params[name].data
            flat = dst.view(-1) if dst.dim() == 1 else dst.view(-1, dst.shape[-1])
            offset = 0
            for p in layout:
                t = ckpt.get(p.name)  # a GGUF tensor comes dequantized to fp32 (cast to the dtype by copy_)
                t = t.reshape(-1) if dst.dim() == 1 else t.reshape(-1, dst.shape[-1])
                if p.add:
                    t = t.float() + p.add  # in fp32, as the model would add it, then cast by copy_
                flat[offset: offset + t.shape[0]].copy_(t)
                offset += t.shape[0]
                bar.update(ckpt.nbytes(p.name))
            if offset != flat.shape[0]:
                raise TensorShapeError(f"parameter {name}: the checkpoint filled {offset} of {flat.shape[0]} rows")

    used = {p.name for layout in chosen.values() for p in layout}
    unused = sorted(n for n in ckpt.names() if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if isinstance(ckpt, GGUFCheckpoint):  # and GGUF tensors no Hugging Face name maps to
        unused += [n for n in ckpt.unused() if not n.endswith(_IGNORED_SUFFIXES)]
    if unused:
        log.warning("%d checkpoint tensors are not used by streamserve, e.g. %s", len(unused), unused[:5])
    model = model.eval().requires_grad_(False)
    if quantize != "none":  # from the float weights just loaded (peak memory: the float model, once)
        quantize_model(model, quantize, sources_from(ckpt, chosen))
    return model
