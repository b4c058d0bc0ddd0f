"""Random tiny Hugging Face checkpoints, built with transformers (the `dev` extra), for tests and benchmarks.

    python -m streamserve.tools.random_checkpoint --arch qwen3_moe --out /tmp/moe64 \\
        --set num_experts=64 --set num_experts_per_tok=8

No download: the weights are random, the tokenizer is a byte-level BPE of the 256 bytes plus
`<|endoftext|>` (id 256), so any vocabulary of at least 257 ids works.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from streamserve.models.tokenizer import byte_level_chars

CONFIG_CLASSES = {"qwen3_moe": "Qwen3MoeConfig", "qwen3": "Qwen3Config", "mixtral": "MixtralConfig",
                  "olmoe": "OlmoeConfig", "llama": "LlamaConfig", "qwen2": "Qwen2Config",
                  "gemma3": "Gemma3TextConfig"}
EOS_ID = 256


def write_byte_tokenizer(folder: Path) -> None:
    """tokenizer.json with the 256 byte tokens (token id = byte value, the same in every checkpoint, so
    test checkpoints can draft for each other) and one special EOS token (id 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_vocab = {ch: i for i, ch in enumerate(byte_level_chars())}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}) + "\n")


def make_random_checkpoint(folder: Path, arch: str, seed: int = 0, **config: Any) -> torch.nn.Module:
    """Build a random `arch` model (float32) from `config` overrides, save it with a tokenizer, return it."""
    import transformers

    cls = getattr(transformers, CONFIG_CLASSES[arch])
    kwargs: dict[str, Any] = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.08,
                                  eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=0)
    kwargs.update(config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kwargs), dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: perturb them so a mis-loaded one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m streamserve.tools.random_checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=sorted(CONFIG_CLASSES), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="a config field, e.g. --set hidden_size=512 --set mlp_only_layers=[0]")
    args = p.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)}
    make_random_checkpoint(args.out, args.arch, args.seed, **overrides)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
