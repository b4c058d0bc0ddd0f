"""Resolving what `Engine.from_pretrained` was asked for: model folder or GGUF file, device, dtype, KV pool size."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch

from streamserve.errors import InvalidInputError, ModelLoadError
from streamserve.models.gguf import is_gguf
from streamserve.models.loader import Checkpoint
from streamserve.models.store import resolve_model

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default"
DEFAULT_POLICY_DIR = DEFAULT_MODEL_DIR.parent / "default-policy"  # the shipped robot policy (streamserve.robot)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model: str | Path, offline: bool = False) -> Path:
    """"default" (or "default-policy"), a catalog name (its cached file, pulled first unless `offline`), a .gguf
    file or a folder."""
    if str(model) == "default":
        return DEFAULT_MODEL_DIR
    if str(model) == "default-policy":
        return DEFAULT_POLICY_DIR
    path = Path(model).expanduser()
    if not path.exists():
        named = resolve_model(str(model), offline=offline)  # None: not a catalog name
        if named is not None:
            return named
    if path.suffix.lower() == ".gguf" or (path.is_file() and is_gguf(path)):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {str(model)!r} not found; pass an existing .gguf file, or a catalog "
                                 "name from `streamserve models list` (only those are downloaded)")
        return path  # a file that is not GGUF inside gets its typed error when it is opened
    if not (path / "config.json").exists():
        raise ModelLoadError(f"model {str(model)!r} not found: pass 'default', a model name from `streamserve "
                             "models list`, a .gguf file or a folder holding config.json, safetensors weights and "
                             "tokenizer.json (only catalog models are downloaded, from the package index)")
    return path


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device 'cuda' was asked for but torch sees no CUDA device; use --device cpu")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in _DTYPES:
            raise InvalidInputError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    chosen = _DTYPES.get(checkpoint_dtype, torch.float32)
    # 16-bit matmuls on a CPU are slow and round differently from the GPU kernels: compute in fp32 there
    return torch.float32 if device.type == "cpu" else chosen


def resolve_eos_ids(path: Path, config_ids: tuple[int, ...] | list[int], tokenizer_ids: list[int] | tuple[int, ...],
                    vocab_size: int) -> tuple[int, ...]:
    """The ids that end a reply: the config's (a GGUF file's come from tokenizer.ggml.eos_token_id), a folder's
    generation_config.json's, the tokenizer's; in order, once each, inside the vocabulary."""
    eos = list(config_ids)
    gen_cfg = path / "generation_config.json"
    if path.is_dir() and gen_cfg.exists():
        g = json.loads(gen_cfg.read_text()).get("eos_token_id")
        eos += g if isinstance(g, list) else [g] if g is not None else []
    eos += list(tokenizer_ids)
    return tuple(dict.fromkeys(i for i in eos if 0 <= i < vocab_size))


DEFAULT_KV_MEMORY_CPU = 1 << 30  # 1 GiB when no budget is given on a CPU
DEFAULT_KV_FRACTION_CUDA = 0.5  # of the memory free after the weights, on a GPU
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20, "g": 1e9, "gb": 1e9,
          "gib": 2**30}


def resolve_kv_bytes(kv_memory: int | float | str | None, device: torch.device) -> int:
    """A KV budget: bytes (int, or "512MiB", "2GB"), or a fraction (0, 1] of the device memory still free."""
    if kv_memory is None:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0] * DEFAULT_KV_FRACTION_CUDA)
        return DEFAULT_KV_MEMORY_CPU
    value: float
    if isinstance(kv_memory, str):
        m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", kv_memory)
        if not m or m.group(2).lower() not in _UNITS:
            raise InvalidInputError(f"kv_memory {kv_memory!r} is neither bytes (e.g. 512MiB, 2GB) nor a fraction")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    elif isinstance(kv_memory, (int, float)) and not isinstance(kv_memory, bool):
        value = float(kv_memory)
    else:
        raise InvalidInputError(f"kv_memory must be bytes or a fraction, got {kv_memory!r}")
    if 0 < value <= 1:  # a fraction of what the device has free
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _host_memory()
        return int(free * value)
    if value < 1:
        raise InvalidInputError(f"kv_memory must be > 0, got {kv_memory!r}")
    return int(value)


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


GGUF_SAMPLES, GGUF_SAMPLE_BYTES, GGUF_HEAD_BYTES = 16, 1 << 16, 1 << 20


def model_fingerprint(path: Path) -> str:
    """Identifies a model whatever dtype it is loaded in: its config.json, the names, shapes and dtypes of
    its tensors and the first rows of its embeddings as stored (two random checkpoints of one config
    differ); for a GGUF file its size, its first MiB and 16 blocks of 64 KiB spread over the rest (without
    parsing it again). Snapshots carry it, so a session is never restored onto another model."""
    if path.is_file():
        return _file_fingerprint(path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    ckpt = Checkpoint(path)
    for name in sorted(ckpt.meta):
        h.update(f"{name}{ckpt.meta[name][1:]}".encode())
    if "model.embed_tokens.weight" in ckpt:
        h.update(ckpt.head("model.embed_tokens.weight", 8).float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _file_fingerprint(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(f"gguf:{size}".encode())
    with path.open("rb") as f:
        h.update(f.read(GGUF_HEAD_BYTES))
        for i in range(GGUF_SAMPLES):
            f.seek(size * i // GGUF_SAMPLES)
            h.update(f.read(GGUF_SAMPLE_BYTES))
    return h.hexdigest()[:16]
