"""Model runtime: Hugging Face decoder-only checkpoints (safetensors folders or GGUF files) on one op layer.

The names below are imported lazily, so that `streamserve.models.store` (what `streamserve models list/pull`
runs) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamserve.models.config import ARCHITECTURES, ModelConfig
    from streamserve.models.loader import CheckpointSource, Pretrained, load_model, open_pretrained
    from streamserve.models.model import CausalLM
    from streamserve.models.ops import Ops, get_ops
    from streamserve.models.tokenizer import IncrementalDetokenizer, Tokenizer

_WHERE = {"ARCHITECTURES": "config", "ModelConfig": "config", "CheckpointSource": "loader", "Pretrained": "loader",
          "load_model": "loader", "open_pretrained": "loader", "CausalLM": "model", "Ops": "ops", "get_ops": "ops",
          "IncrementalDetokenizer": "tokenizer", "Tokenizer": "tokenizer"}
__all__ = ["ARCHITECTURES", "CausalLM", "CheckpointSource", "IncrementalDetokenizer", "ModelConfig", "Ops",
           "Pretrained", "Tokenizer", "get_ops", "load_model", "open_pretrained"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"streamserve.models.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'streamserve.models' has no attribute {name!r}")
