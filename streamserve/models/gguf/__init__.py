"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package.

`open_gguf(path)` gives the file; `gguf_config`, `gguf_tokenizer` and `GGUFCheckpoint` turn it into
what a Hugging Face checkpoint folder gives: a `ModelConfig`, a `Tokenizer` and tensors under the
Hugging Face names the loader's recipes consume. `writer.write_gguf` writes a checkpoint folder the way
llama.cpp's converter does (tests, small exports).
"""

from pathlib import Path

from streamserve.models.gguf.config import gguf_config, hf_config_dict
from streamserve.models.gguf.reader import BadGGUFError, GGUFFile, UnsupportedTensorTypeError, is_gguf
from streamserve.models.gguf.tensors import SUPPORTED_TYPES, GGUFCheckpoint
from streamserve.models.gguf.tokenizer import gguf_tokenizer


def open_gguf(path: str | Path) -> GGUFFile:
    return GGUFFile(Path(path))


__all__ = ["SUPPORTED_TYPES", "BadGGUFError", "GGUFCheckpoint", "GGUFFile", "UnsupportedTensorTypeError",
           "gguf_config", "gguf_tokenizer", "hf_config_dict", "is_gguf", "open_gguf"]
