"""Model runtime: Hugging Face decoder-only checkpoints (safetensors folders or GGUF files) on one op layer."""

from streamserve.models.config import ARCHITECTURES, ModelConfig
from streamserve.models.loader import CheckpointSource, Pretrained, load_model, open_pretrained
from streamserve.models.model import CausalLM
from streamserve.models.ops import Ops, get_ops
from streamserve.models.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["ARCHITECTURES", "CausalLM", "CheckpointSource", "IncrementalDetokenizer", "ModelConfig", "Ops",
           "Pretrained", "Tokenizer", "get_ops", "load_model", "open_pretrained"]
