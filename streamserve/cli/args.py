"""CLI flags generated from the frozen configs in `streamserve.config`, and the engine they describe."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamserve.config import EngineConfig
from streamserve.errors import InvalidInputError


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of a config dataclass: --field-name, with its type, default, help, choices."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
        default = f.default
        helptext = f.metadata.get("help", "")
        if base is bool:  # a switch: --offline, not --offline True
            parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, action="store_true", help=helptext)
            continue
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=base, default=default,
                            choices=f.metadata.get("choices"),
                            help=f"{helptext} (default: {default})" if default is not None else helptext)


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def resolve_named_model(cfg: EngineConfig) -> EngineConfig:
    """A catalog name (`streamserve models list`) becomes its cached file, pulled first unless --offline; on a
    terminal, a licence that needs accepting (Gemma) is asked for here, before any engine work starts."""
    from streamserve.models.store import resolve_model

    if cfg.model == "default" or Path(cfg.model).expanduser().exists():
        return cfg
    interactive = sys.stdin.isatty() and sys.stderr.isatty()

    def confirm(prompt: str) -> bool:
        return input(prompt).strip().lower() in ("y", "yes")

    path = resolve_model(cfg.model, offline=cfg.offline, confirm=confirm if interactive else None)
    return cfg if path is None else dataclasses.replace(cfg, model=str(path))


def quantized_note(engine: Any) -> str:
    """", weights int4 (quantize auto)" when the weights are held quantized (models/quantize.py)."""
    from streamserve.models.quant import QuantLinear

    bits = sorted({m.bits for m in engine.model.modules() if isinstance(m, QuantLinear)}, reverse=True)
    if not bits:
        return ""
    return f", weights {'/'.join(f'int{b}' for b in bits)} (quantize {engine.quantized})"


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_engine(args: argparse.Namespace, tell: Callable[[str], None] = say, compile_steps: bool = True) -> Any:
    """The engine the flags describe, its load announced on stderr. `tell`: gets a line once the compiled decode
    step serves (--cpu-compile); `compile_steps=False`: a command that steps no model (`info`) compiles nothing."""
    from streamserve.engine import Engine
    from streamserve.engine.compiled import compile_note

    cfg = resolve_named_model(config_from_args(EngineConfig, args))
    if not compile_steps:
        cfg = dataclasses.replace(cfg, cpu_compile="off")
    if cfg.backend != "engine" or cfg.sglang_url or cfg.sglang_launch:
        raise InvalidInputError("--backend sglang (and --sglang-url, --sglang-launch) are for `streamserve serve`; "
                                "this command runs the model in this process")
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(cfg.model, offline=cfg.offline, device=cfg.device, dtype=cfg.dtype,
                                    quantize=cfg.quantize, kernels=cfg.kernels,
                                    cuda_graphs=cfg.cuda_graphs, cpu_compile=cfg.cpu_compile, drafter=cfg.drafter,
                                    max_draft=cfg.max_draft,
                                    kv_memory=cfg.kv_memory,
                                    page_size=cfg.page_size, idle_ttl=cfg.idle_ttl, rewind_reach=cfg.rewind_reach)
    st = engine.stats()
    print(f"streamserve: {st['model']} ({st['architecture']}, {st['parameters'] / 1e6:.1f}M parameters) "
          f"on {st['device']} as {st['dtype']}{quantized_note(engine)}, loaded in {time.perf_counter() - t0:.1f}s"
          f"{compile_note(engine.graphs, tell)}", file=sys.stderr)
    return engine
