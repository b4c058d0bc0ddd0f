"""The one frozen, documented source of defaults. The Python API and the CLI both read them from here;
the CLI's flags are generated from these fields (name, type, default, help, choices).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(default="default", metadata={
        "help": "'default' (the embedded KJV Qwen3-MoE) or a Hugging Face checkpoint folder "
                "(config.json + safetensors + tokenizer.json)"})
    device: str = field(default="auto", metadata={
        "help": "where the model runs; auto = cuda when available, else cpu", "choices": ("auto", "cpu", "cuda")})
    dtype: str | None = field(default=None, metadata={
        "help": "weight and activation dtype; default: the checkpoint's, but float32 on cpu for 16-bit "
                "checkpoints", "choices": ("float32", "bfloat16", "float16")})


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = field(default=128, metadata={"help": "the most tokens one reply may generate"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; higher = more random"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling: keep the smallest set of tokens "
                                                        "whose probability reaches top_p (0 < top_p <= 1)"})
    seed: int | None = field(default=None, metadata={"help": "seed for reproducible sampling"})


ENGINE_DEFAULTS = EngineConfig()
SAMPLING_DEFAULTS = SamplingConfig()
