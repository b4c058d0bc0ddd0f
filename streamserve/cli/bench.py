"""`streamserve bench`: load a running `streamserve serve` with text, voice and robot-policy sessions at once, in
real time, and print a JSON report (streamserve/tools/bench/).

The load runs on the client SDK, `streamserve-client` (clients/python), a separate distribution that the server
does not depend on: it is imported when the command runs, and its absence is one clear error line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from streamserve.cli.args import add_config_args, config_from_args
from streamserve.errors import StreamserveError
from streamserve.tools.bench.config import BenchConfig

EXAMPLES = """\
examples:
  streamserve bench --text 4 --policy 2 --duration 20 --policy-url ws://127.0.0.1:8001
  streamserve bench --text 8 --voice 1 --duration 60 --report bench.json
  STREAMSERVE_API_KEY=secret streamserve bench --url ws://127.0.0.1:9000 --text 16 --strict

The policy sessions need a server whose model is a robot policy (`streamserve serve --model default-policy`); the
voice sessions need the voice extra and models here and on the server. A kind that cannot run is skipped with the
reason (in the report too). The report is the last thing on stdout; a progress bar goes to stderr.
"""


class MissingClientError(StreamserveError):
    pass


def register(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this sub-command with `add_parser` (argparse's `add_subparsers().add_parser`)."""
    bench = add_parser("bench", help="load a running server with real-time sessions (text, voice, policy); JSON report",
                       description="Drive a running `streamserve serve` (on loopback) with N text, voice and robot "
                                   "policy sessions at once, each paced in real time with its own deadlines; report "
                                   "the sessions held, latency percentiles, missed deadlines, shed chunks, errors by "
                                   "code, and the server's memory and KV pages over time, as JSON on stdout.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(bench, BenchConfig)
    bench.set_defaults(run=cmd_bench)


def require_client() -> None:
    missing = [m for m in ("streamserve_client", "websockets") if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingClientError(f"streamserve bench runs on the Python client SDK ({', '.join(missing)} not "
                                 "installed): pip install streamserve-client (from a checkout: pip install "
                                 "./clients/python)")


def cmd_bench(args: argparse.Namespace) -> int:
    cfg: BenchConfig = config_from_args(BenchConfig, args)
    key = cfg.key or os.environ.get("STREAMSERVE_API_KEY") or None
    require_client()
    from streamserve.tools.bench.run import run_bench  # imports the SDK

    result = asyncio.run(run_bench(cfg, key))
    line = json.dumps(result)
    if cfg.report:
        Path(cfg.report).write_text(json.dumps(result, indent=2) + "\n")
    print(line, flush=True)
    if cfg.strict and not result["all_held"]:
        print("streamserve bench: not every session was held (see the report)", file=sys.stderr)
        return 3
    return 0
