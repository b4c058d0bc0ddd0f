"""`streamserve info`: what a checkpoint is, as JSON."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from streamserve.cli.args import add_config_args, load_engine
from streamserve.config import EngineConfig


def register(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this sub-command with `add_parser` (argparse's `add_subparsers().add_parser`)."""
    info = add_parser("info", help="print what a checkpoint is (architecture, size, dtype) as JSON")
    add_config_args(info, EngineConfig)
    info.set_defaults(run=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    engine = load_engine(args, compile_steps=False)
    cfg = engine.config
    print(json.dumps({**engine.stats(), "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                      "vocab_size": cfg.vocab_size, "max_context": cfg.max_position_embeddings,
                      "experts": cfg.moe.num_experts if cfg.moe else 0,
                      "experts_per_token": cfg.moe.top_k if cfg.moe else 0, "path": str(engine.path)}, indent=2))
    return 0
