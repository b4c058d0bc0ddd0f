"""The compiled CPU decode step's Inductor options side by side: what each option `INDUCTOR_OPTIONS` ships buys.

    python benchmarks/cpu_compile_options.py [--model NAME] [--quantize int4] [--new 96] [--reps 6]
                                             [--variants shipped,default_chunk,no_autotune]
                                             [--quick]

Each variant is an engine with cpu_compile="on" whose decode step was compiled (by the compile worker, into an
AOTInductor package) under `engine/inductor_setup.py`'s `INDUCTOR_OPTIONS` with that variant's changes:
- `shipped`: the options as shipped;
- `default_chunk`: `cpp.min_chunk_size` at Inductor's default (512 elements a thread: small kernels fork);
- `no_autotune`: `max_autotune` off (aten's packed kernels for every matmul, no CPP GEMM template).
All are loaded in one process (compiled one after another, each waited for; a variant whose package is in the cache
loads it), then each decodes --new greedy tokens after a 32-token English prompt,
reps interleaved variant by variant, so all see the same load. Per variant: the median tok/s (first streamed token
to last), the median forward milliseconds per decoded token from the engine's own counters (`decode_seconds /
decode_tokens`: the compiled code plus the host work of loading its buffers; sampling and bookkeeping not
included), the steps served compiled and eagerly during the timed reps (a timed step must run compiled), and
whether its greedy tokens equal `shipped`'s. The model: --model (a catalog name or a path; default SmolLM2-135M
when pulled, else the embedded default model), --quantize its weight format.
Human lines go to stderr; the last line printed is one JSON object with the figures and, per variant, the ratio of
its forward time to `shipped`'s (above 1: the shipped options are faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from streamserve import Engine
from streamserve.engine import compiled
from streamserve.engine.loading import resolve_model_path
from streamserve.models import store

SMOLLM2 = "smollm2-135m-instruct"
PROMPT_TOKENS = 32
COMPILE_TIMEOUT = 900.0
VARIANTS: dict[str, dict[str, Any]] = {  # changes to the shipped INDUCTOR_OPTIONS
    "shipped": {},
    "default_chunk": {"cpp.min_chunk_size": 512},
    "no_autotune": {"max_autotune": False},
}


def load_variant(path: Path, quantize: str, changes: dict[str, Any]) -> tuple[Engine, float]:
    """An engine whose start-up step shape compiles under the shipped options with `changes` -> (engine, seconds
    its compile took). The options are read by the compile thread when it asks the worker: they are restored once
    that compile is done."""
    shipped = dict(compiled.INDUCTOR_OPTIONS)
    compiled.INDUCTOR_OPTIONS.update(changes)
    try:
        engine = Engine.from_pretrained(path, device="cpu", dtype="float32", quantize=quantize, kv_memory="256MiB",
                                        cpu_compile="on")
        steps = engine.graphs.compiled if engine.graphs is not None else None
        if steps is None:
            raise SystemExit("cpu_compile had no effect on this engine (a CPU with torch kernels is needed)")
        t0 = time.perf_counter()
        if not steps.wait_idle(COMPILE_TIMEOUT):
            raise SystemExit(f"still compiling after {COMPILE_TIMEOUT:.0f}s")
        if steps.failed:
            raise SystemExit(f"the compile failed: {list(steps.failed.values())}")
        return engine, sum(steps.compile_seconds.values()) or time.perf_counter() - t0
    finally:
        compiled.INDUCTOR_OPTIONS.clear()
        compiled.INDUCTOR_OPTIONS.update(shipped)


def rep(engine: Engine, prompt: list[int], new: int) -> tuple[float, float, list[int]]:
    """One reply of `new` greedy tokens -> (tok/s, forward ms per decoded token, the tokens)."""
    c = engine.counters
    with engine.open_session() as s:
        s.append(token_ids=prompt)
        it = s.iter_generate(max_tokens=new + 1, stop_token_ids=())
        tokens = [next(it)]  # sampled from the prompt's logits
        tokens_before, seconds_before = c.decode_tokens, c.decode_seconds
        t0 = time.perf_counter()
        tokens += list(it)
        dt = time.perf_counter() - t0
    forward_ms = (c.decode_seconds - seconds_before) / max(1, c.decode_tokens - tokens_before) * 1e3
    return new / dt, forward_ms, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help=f"default: {SMOLLM2} when pulled, else the embedded default")
    p.add_argument("--quantize", default="int4", choices=["none", "int8", "int4", "auto"])
    p.add_argument("--new", type=int, default=96, help="greedy tokens timed per rep (default 96)")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--variants", default="shipped,default_chunk,no_autotune",
                   help=f"comma-separated, from {', '.join(VARIANTS)} (shipped is always run, first)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--quick", action="store_true",
                   help="a small run to check the script works (the default model in float32, two variants, no "
                        "autotuning)")
    args = p.parse_args()
    names = ["shipped", *[v for v in args.variants.split(",") if v and v != "shipped"]]
    if unknown := [v for v in names if v not in VARIANTS]:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    common: dict[str, Any] = {}  # changes every variant gets
    # quick: no autotuning (it times every matmul shape for seconds), and the point is the script: no_autotune then
    # names the same package as shipped, which the cache serves (one compile of the two)
    if args.quick:
        args.model, args.quantize, args.new, args.reps, names = "default", "none", 8, 1, ["shipped", "no_autotune"]
        common = {"max_autotune": False}
    model = args.model or (SMOLLM2 if store.installed(SMOLLM2) is not None else "default")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    path = resolve_model_path(model, offline=True)
    res: dict[str, Any] = {"model": model, "quantize": args.quantize, "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "new_tokens": args.new, "reps": args.reps,
                           "shipped_options": dict(compiled.INDUCTOR_OPTIONS), "cpus": os.cpu_count(),
                           "load_average": [round(x, 2) for x in os.getloadavg()]}
    engines: dict[str, Engine] = {}
    try:
        for name in names:
            engines[name], seconds = load_variant(path, args.quantize, {**common, **VARIANTS[name]})
            res[name] = {"changes": {**common, **VARIANTS[name]}, "compile_s": round(seconds, 1)}
            print(f"{name}: compiled in {seconds:.1f} s", file=sys.stderr)
        prompt = engines["shipped"].tokenizer.encode(real_models_text())[:PROMPT_TOKENS]
        tokens: dict[str, list[int]] = {}
        for name, engine in engines.items():  # warm-up: pools, packed weights, the caches
            tokens[name] = rep(engine, prompt, args.new)[2]
        before = {n: (e.graphs.compiled.steps, e.graphs.compiled.eager_steps) for n, e in engines.items()}  # type: ignore[union-attr]
        tok_s: dict[str, list[float]] = {n: [] for n in engines}
        forward_ms: dict[str, list[float]] = {n: [] for n in engines}
        for _ in range(args.reps):
            for name, engine in engines.items():
                t, f, _ = rep(engine, prompt, args.new)
                tok_s[name].append(t)
                forward_ms[name].append(f)
        for name, engine in engines.items():
            steps = engine.graphs.compiled  # type: ignore[union-attr]
            res[name].update(tok_s=round(statistics.median(tok_s[name]), 1),
                             tok_s_reps=[round(t, 1) for t in tok_s[name]],
                             forward_ms_per_token=round(statistics.median(forward_ms[name]), 3),
                             forward_ms_reps=[round(f, 3) for f in forward_ms[name]],
                             timed_steps_compiled=steps.steps - before[name][0],
                             timed_steps_eager=steps.eager_steps - before[name][1],
                             same_tokens_as_shipped=tokens[name] == tokens["shipped"])
            print(f"{name}: {res[name]['tok_s']} tok/s, forward {res[name]['forward_ms_per_token']} ms a token "
                  f"({res[name]['timed_steps_eager']} timed steps eager)", file=sys.stderr)
    finally:
        for engine in engines.values():
            engine.shutdown()
    shipped_ms = res["shipped"]["forward_ms_per_token"]
    res["forward_ms_over_shipped"] = {n: round(res[n]["forward_ms_per_token"] / shipped_ms, 3) for n in names
                                      if n != "shipped"}
    res["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"forward time over shipped's: {res['forward_ms_over_shipped']}", file=sys.stderr)
    print(json.dumps(res))


def real_models_text() -> str:
    """The English prompt text of benchmarks/real_models.py (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("real_models", Path(__file__).with_name("real_models.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return str(mod.TEXT)


if __name__ == "__main__":
    main()
