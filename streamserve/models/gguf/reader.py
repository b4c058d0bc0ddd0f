"""Opening a GGUF file with the `gguf` package (the reader maintained with llama.cpp).

`GGUFFile` wraps `gguf.GGUFReader`: metadata as plain Python values, the tensor table in torch order
(GGUF lists dimensions fastest-moving first, torch the other way round), and every failure of a bad
file (wrong magic, truncated, unknown value or tensor type) as a typed `ModelLoadError`, never a raw
numpy/struct exception.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from streamserve.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


class BadGGUFError(ModelLoadError):
    """The file is not a readable GGUF file (wrong magic, truncated, damaged)."""

    code = "bad_gguf_file"


class UnsupportedTensorTypeError(ModelLoadError):
    """A tensor is stored in a ggml type streamserve cannot dequantize."""

    code = "unsupported_tensor_type"


class _Reader(GGUFReader):
    """`GGUFReader` over a plain ndarray view of its memory map instead of the `np.memmap` itself.

    The reader slices its buffer once per value (a 262k-token vocabulary is a million slices), and every
    slice of an `np.memmap` runs numpy's subclass hooks: 3x slower in all (Gemma 3 270M: 13.7 s -> 4.3 s).
    The view still reads the same mapped pages, and keeps the map alive through its `base`.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._buffer

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buffer = np.asarray(value).view(np.ndarray)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: its stored (possibly block-quantized) bytes and what they mean."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: the reverse of the file's dimension list
    nbytes: int
    data: np.ndarray  # the stored values or blocks, a read-only view of the mapped file


def is_gguf(path: str | Path) -> bool:
    """True for a file that starts with the GGUF magic (whatever its name)."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


class GGUFFile:
    """A GGUF file's metadata and tensor table; tensor data stays mapped until read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} not found")
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise BadGGUFError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); pass a "
                               ".gguf file or a Hugging Face checkpoint folder")
        try:
            reader = _Reader(path)
        except ValueError as e:
            if "GGMLQuantizationType" in str(e):  # a type id newer than this `gguf` package knows
                raise UnsupportedTensorTypeError(f"{path} holds a tensor type the installed gguf package does not "
                                                 f"know ({e}); re-quantize it to Q8_0, Q6_K, Q5_K or Q4_K") from None
            raise BadGGUFError(f"{path} is a damaged or truncated GGUF file, or of a GGUF version the gguf package "
                               f"cannot read ({e}); download it again") from None
        except (IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError, MemoryError) as e:
            raise BadGGUFError(f"{path} is a damaged or truncated GGUF file ({type(e).__name__}: {e}); "
                               "download it again") from None
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if not key.startswith("GGUF."):
                self.metadata[key] = _value(path, key, field)
        self.tensors: dict[str, TensorEntry] = {}
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise BadGGUFError(f"{path} is truncated: tensor {t.name} needs bytes up to {end}, the file has "
                                   f"{size}; download it again")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self.tensors[t.name] = TensorEntry(t.name, t.tensor_type, shape, int(t.n_bytes), t.data)
        self.architecture = str(self.metadata.get("general.architecture", ""))
        if not self.architecture:
            raise BadGGUFError(f"{path} has no general.architecture in its metadata")

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value: int/float/bool/str, or a list of them for arrays."""
        return self.metadata.get(key, default)

    def arch_key(self, key: str, default: Any = None) -> Any:
        """`<architecture>.<key>`, e.g. arch_key("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        full = f"{self.architecture}.{key}"
        if full not in self.metadata:
            raise ModelLoadError(f"{self.path} lacks the metadata key {full} that a {self.architecture} model needs")
        return self.metadata[full]


def _value(path: Path, key: str, field: Any) -> Any:
    try:
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.types) == 1:
            return []  # an empty array: no element type is recorded
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise BadGGUFError(f"{path}: metadata key {key} cannot be read ({e}); the file is damaged") from None
