"""The `streamserve` command. Its flags are generated from the frozen configs in `streamserve.config`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import typing
from collections.abc import Sequence
from typing import Any

from streamserve import __version__
from streamserve.config import EngineConfig, SamplingConfig, SchedulerConfig, ServerConfig, SessionConfig
from streamserve.errors import StreamserveError

DESCRIPTION = """\
streamserve: a real-time streaming interaction server for large language models.

Sessions are persistent: each chunk you append runs only the new tokens against the KV cache
of everything before it. With no --model, the embedded default model is used: a small
Qwen3-MoE trained on the King James Bible, so it continues text in KJV English.

examples:
  streamserve serve                          # the server on 127.0.0.1:8000 (WebSocket /v1/stream)
  streamserve serve --port 9000 --window 1024 --sinks 4 --api-key-file ./key.txt
  STREAMSERVE_API_KEY=secret streamserve serve   # the key from the environment, not the command line
  streamserve generate --prompt "In the beginning" --max-tokens 40
  streamserve generate                       # interactive: each line continues one session
  streamserve generate --model ./Qwen3-30B-A3B --chat --temperature 0.7
  streamserve info --model ./my-checkpoint   # what a checkpoint is, as JSON
"""


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of a config dataclass: --field-name, with its type, default, help, choices."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)  # Optional[X] -> X
        default = f.default
        helptext = f.metadata.get("help", "")
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=base, default=default,
                            choices=f.metadata.get("choices"),
                            help=f"{helptext} (default: {default})" if default is not None else helptext)


def config_from_args(cls: type, args: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamserve", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"streamserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve the model: WebSocket streaming sessions, health, metrics",
                           description="Serve the model on one port: WS /v1/stream (the native msgpack protocol, "
                                       "docs/protocol.md), GET /healthz, GET /metrics, POST "
                                       "/v1/realtime/client_secrets (short-lived secrets for browsers). "
                                       "--window/--sinks/"
                                       "--positions are the defaults of sessions that do not choose. "
                                       "SIGINT or SIGTERM shuts down gracefully.")
    add_config_args(serve, ServerConfig)
    add_config_args(serve, EngineConfig)
    add_config_args(serve, SessionConfig)
    add_config_args(serve, SchedulerConfig)

    gen = sub.add_parser("generate", help="continue a prompt, or chat interactively, streaming to the terminal",
                         description="Stream the model's continuation of --prompt; without --prompt, read "
                                     "lines from standard input, each appended to one persistent session "
                                     "and answered in turn (Ctrl-C stops a reply, Ctrl-D quits).")
    add_config_args(gen, EngineConfig)
    add_config_args(gen, SessionConfig)
    add_config_args(gen, SamplingConfig)
    gen.add_argument("--prompt", help="text to continue; omit for the interactive mode")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each input as a user turn with the checkpoint's chat template (instruct models)")

    info = sub.add_parser("info", help="print what a checkpoint is (architecture, size, dtype) as JSON")
    add_config_args(info, EngineConfig)
    return parser


def _load(args: argparse.Namespace) -> Any:
    from streamserve.engine import Engine

    cfg: EngineConfig = config_from_args(EngineConfig, args)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(cfg.model, device=cfg.device, dtype=cfg.dtype, kernels=cfg.kernels,
                                    cuda_graphs=cfg.cuda_graphs, drafter=cfg.drafter,
                                    max_draft=cfg.max_draft,
                                    kv_memory=cfg.kv_memory,
                                    page_size=cfg.page_size, idle_ttl=cfg.idle_ttl)
    st = engine.stats()
    print(f"streamserve: {st['model']} ({st['architecture']}, {st['parameters'] / 1e6:.1f}M parameters) "
          f"on {st['device']} as {st['dtype']}, loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return engine


def _reply(session: Any, text: str, sampling: SamplingConfig, chat: bool) -> None:
    engine = session.engine
    if chat:  # the rendered template carries its own special tokens (BOS, turn markers)
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    stream = None
    try:
        session.append(text=text, add_special_tokens=False if chat else None)
        stream = session.stream(sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k)
        for delta in stream:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        if stream is not None:
            stream.cancel()  # what was generated so far stays in the session
            stream.wait()
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    sys.stdout.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _load(args)
    sampling: SamplingConfig = config_from_args(SamplingConfig, args)
    sc: SessionConfig = config_from_args(SessionConfig, args)
    with engine.open_session(window=sc.window, sinks=sc.sinks, positions=sc.positions, seed=sampling.seed,
                             page_cap=sc.page_cap) as session:
        if args.prompt is not None:
            if not args.chat:
                sys.stdout.write(args.prompt)  # a continuation reads best after its prompt
            _reply(session, args.prompt, sampling, args.chat)
            return 0
        interactive = sys.stdin.isatty()
        if interactive:
            print("Type text and press Enter: the model continues it in the same session. "
                  "Ctrl-C stops a reply, Ctrl-D quits.", file=sys.stderr)
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                return 0
            except KeyboardInterrupt:
                print(file=sys.stderr)
                return 0
            if line.strip():
                separator = "" if args.chat or not session.token_ids else "\n"
                _reply(session, separator + line, sampling, args.chat)


def cmd_serve(args: argparse.Namespace) -> int:
    from streamserve.server.app import Server, engine_loader, run

    server_cfg: ServerConfig = config_from_args(ServerConfig, args)
    engine_cfg: EngineConfig = config_from_args(EngineConfig, args)
    scheduler_cfg: SchedulerConfig = config_from_args(SchedulerConfig, args)
    server = Server(server_cfg, engine_loader(engine_cfg, scheduler_cfg), config_from_args(SessionConfig, args))
    run(server, announce=lambda line: print(line, file=sys.stderr, flush=True))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    engine = _load(args)
    cfg = engine.config
    print(json.dumps({**engine.stats(), "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                      "vocab_size": cfg.vocab_size, "max_context": cfg.max_position_embeddings,
                      "experts": cfg.moe.num_experts if cfg.moe else 0,
                      "experts_per_token": cfg.moe.top_k if cfg.moe else 0, "path": str(engine.path)}, indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    commands = {"serve": cmd_serve, "generate": cmd_generate, "info": cmd_info}
    if args.command is None:
        parser.print_help()
        sys.exit(2)
    try:
        sys.exit(commands[args.command](args))
    except StreamserveError as e:
        print(f"streamserve: error: {e}", file=sys.stderr)
        sys.exit(1)
