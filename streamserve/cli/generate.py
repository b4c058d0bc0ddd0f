"""`streamserve generate`: continue a prompt, or each line of standard input, on one persistent session."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from streamserve.cli.args import add_config_args, config_from_args, load_engine
from streamserve.config import EngineConfig, SamplingConfig, SessionConfig


def register(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this sub-command with `add_parser` (argparse's `add_subparsers().add_parser`)."""
    gen = add_parser("generate", help="continue a prompt, or chat interactively, streaming to the terminal",
                         description="Stream the model's continuation of --prompt; without --prompt, read "
                                     "lines from standard input, each appended to one persistent session "
                                     "and answered in turn (Ctrl-C stops a reply, Ctrl-D quits).")
    add_config_args(gen, EngineConfig)
    add_config_args(gen, SessionConfig)
    add_config_args(gen, SamplingConfig)
    gen.add_argument("--prompt", help="text to continue; omit for the interactive mode")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each input as a user turn with the checkpoint's chat template (instruct models)")
    gen.set_defaults(run=cmd_generate)


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
    engine = load_engine(args)
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
