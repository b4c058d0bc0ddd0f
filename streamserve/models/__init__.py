"""Model runtime: Hugging Face decoder-only checkpoints on one op layer."""

from streamserve.models.config import ARCHITECTURES, ModelConfig
from streamserve.models.loader import load_model
from streamserve.models.model import CausalLM
from streamserve.models.ops import Ops, get_ops
from streamserve.models.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["ARCHITECTURES", "CausalLM", "IncrementalDetokenizer", "ModelConfig", "Ops", "Tokenizer",
           "get_ops", "load_model"]
