"""A serving engine's deadlines while its decode step compiles in the background (cpu_compile "auto", the default),
and how long a start takes to serve compiled, cold and from the cache.

    python benchmarks/compile_background.py [--ticks 150] [--quick]

On SmolLM2-135M-Instruct (its pulled GGUF; the embedded default model when it is not pulled), the engine at its
defaults but for the compile setting, on this machine's cores:
- the loop: a real-time client's rhythm, one tick every 200 ms: append an 8-token chunk, then decode 4 greedy tokens
  (a robot's observation and its action chunk, or a voice turn's words); the session is rewound to its first 64
  tokens when it passes 448, so every tick does the same work. A tick's latency is from its append to its last
  token; a tick longer than its 200 ms period misses its deadline (the next tick starts late).
- `baseline`: an engine with cpu_compile "off" runs --ticks ticks.
- `during_cold_compile`: an engine at its defaults (cpu_compile "auto") over an empty Inductor cache directory runs
  the loop from its load until its start-up compile is done (at least --ticks ticks): every tick eager, beside the
  compile worker, a child process at SCHED_IDLE that is stopped while the engine has work
  (engine/compile_worker.py, engine/worker_process.py).
- `during_cold_compile_normal_priority`: the same with the worker at normal priority and never stopped (what the
  two buy); a second empty cache directory.
- `compiled`: the defaults engine's loop once its step is compiled, --ticks ticks.
- `warm_start`: a fresh process loads the defaults engine over the cache `during_cold_compile` filled and runs the
  loop at once: how long after the load it served compiled (`ready_after_s`: the package loads from the cache, no
  worker runs), and the ticks meanwhile, as `streamserve serve` after `streamserve models pull`.
Human lines go to stderr; the last line is one JSON object with p50/p95/max tick ms and deadline misses per phase,
and the ratios of the phases' p95 to the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from streamserve import Engine
from streamserve.engine import compiled as compiled_module
from streamserve.engine import worker_process
from streamserve.engine.inductor_setup import CPU_COMPILE_ENV
from streamserve.engine.loading import resolve_model_path
from streamserve.models import store

SMOLLM2 = "smollm2-135m-instruct"
PERIOD_S = 0.2  # a tick's period: its deadline
CHUNK, DECODE, KEEP, LIMIT = 8, 4, 64, 448  # tokens appended, decoded, kept on a rewind, before a rewind
WAIT = 1800.0  # seconds a cold compile may take


def model_path() -> Path:
    return resolve_model_path(SMOLLM2, offline=True) if store.installed(SMOLLM2) else resolve_model_path("default")


def tick_loop(engine: Engine, ticks: int, until: Any = None) -> list[float]:
    """Run the loop: at least `ticks` ticks, and while `until()` is false -> each tick's ms."""
    ids = engine.tokenizer.encode("The robot arm reaches for the red cup on the table and lifts it. " * 8)
    out: list[float] = []
    with engine.open_session() as s:
        s.append(token_ids=ids[:KEEP])
        next_start = time.perf_counter()
        while len(out) < ticks or (until is not None and not until()):
            now = time.perf_counter()
            if now < next_start:
                time.sleep(next_start - now)
            t0 = time.perf_counter()
            at = len(out) * CHUNK % (len(ids) - CHUNK)
            s.append(token_ids=ids[at:at + CHUNK])
            s.generate(max_tokens=DECODE, stop_token_ids=())
            out.append((time.perf_counter() - t0) * 1e3)
            if len(s) > LIMIT:
                s.rewind(to=KEEP)
            next_start = max(next_start + PERIOD_S, time.perf_counter())  # a late tick: the next one starts late
    return out


def figures(ms: list[float]) -> dict[str, Any]:
    q = statistics.quantiles(ms, n=20)
    return {"ticks": len(ms), "p50_ms": round(statistics.median(ms), 1), "p95_ms": round(q[18], 1),
            "max_ms": round(max(ms), 1), "deadline_misses": sum(m > PERIOD_S * 1e3 for m in ms)}


def run_phase(phase: str, path: Path, ticks: int, cache: Path) -> dict[str, Any]:
    """One phase in this process (each runs in a fresh one: no compile of an earlier phase is in memory)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    if phase == "baseline":
        engine = Engine.from_pretrained(path, cpu_compile="off")
        tick_loop(engine, 5)  # warm-up
        return figures(tick_loop(engine, ticks))
    if phase == "cold_normal_priority":  # the compile worker at normal priority, never paused
        worker_process.WORKER_IDLE = False  # type: ignore[misc]  # read when the worker starts
        worker_process.PAUSE_WORKER = False  # type: ignore[misc]
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(path)  # the defaults
    load_s = time.perf_counter() - t0
    compiled = engine.graphs.compiled if engine.graphs is not None else None
    if compiled is None:
        raise SystemExit("the defaults engine compiles nothing here (no C++ compiler, or STREAMSERVE_CPU_COMPILE=off)")
    res: dict[str, Any] = {"load_s": round(load_s, 1)}
    # the loop while the compile runs (a warm start too: clients come as soon as the server is up)
    res.update(figures(tick_loop(engine, ticks, until=lambda: compiled.idle.is_set())))
    if not compiled.wait_idle(WAIT):
        raise SystemExit("the compile did not finish")
    res.update(compile_s=round(sum(compiled.compile_seconds.values()), 1), failed=list(compiled.failed.values()),
               ready_after_s=compiled.ready_after and round(compiled.ready_after, 2),
               from_cache=len(compiled.from_cache), workers=compiled.builds, worker_pauses=compiled.process.pauses)
    if phase == "cold":  # then the loop compiled
        after = figures(tick_loop(engine, ticks))
        step = engine.stats()["compiled_step"]
        res["compiled"] = {**after, "steps_compiled": step["steps_compiled"], "steps_eager": step["steps_eager"]}
    engine.shutdown()
    return res


PHASES = {"baseline": "baseline", "cold": "during_cold_compile", "warm": "warm_start",
          "cold_normal_priority": "during_cold_compile_normal_priority"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ticks", type=int, default=150, help="ticks timed per phase (at least; default 150)")
    p.add_argument("--no-normal-priority", action="store_true",
                   help="leave out the phase with the compile at normal priority (one cold compile less)")
    p.add_argument("--quick", action="store_true", help="a small run to check the script works: the embedded "
                   "default model, 5 ticks, Inductor's cheapest options, no normal-priority phase")
    p.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)  # one phase, in a child process
    p.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.pop(CPU_COMPILE_ENV, None)  # the defaults as a user has them
    path = resolve_model_path("default") if args.quick else model_path()
    if args.quick:
        args.ticks, args.no_normal_priority = 5, True
        compiled_module.INDUCTOR_OPTIONS = {"freezing": True}  # type: ignore[misc]
    if args.phase:
        print(json.dumps(run_phase(args.phase, path, args.ticks, args.cache)))
        return
    res: dict[str, Any] = {"model": path.name, "torch": torch.__version__, "threads": torch.get_num_threads(),
                           "cpus": os.cpu_count(), "period_ms": PERIOD_S * 1e3, "chunk_tokens": CHUNK,
                           "decode_tokens": DECODE, "load_average": [round(x, 2) for x in os.getloadavg()]}
    phases = ["baseline", "cold", "warm", *([] if args.no_normal_priority else ["cold_normal_priority"])]
    with tempfile.TemporaryDirectory() as tmp:
        for phase in phases:
            cache = Path(tmp) / ("normal" if phase == "cold_normal_priority" else "low")  # warm: cold's cache
            cmd = [sys.executable, __file__, "--phase", phase, "--cache", str(cache), "--ticks", str(args.ticks),
                   *(["--quick"] if args.quick else [])]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=2 * WAIT)
            if done.returncode:
                raise SystemExit(f"phase {phase} failed: {done.stderr[-3000:]}")
            res[PHASES[phase]] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{PHASES[phase]}: {res[PHASES[phase]]}", file=sys.stderr)
    if "during_cold_compile" in res:
        res["compiled"] = res["during_cold_compile"].pop("compiled")
    res["ratios"] = {f"{k}_p95_over_baseline": round(res[k]["p95_ms"] / res["baseline"]["p95_ms"], 3)
                     for k in ("during_cold_compile", "during_cold_compile_normal_priority", "compiled") if k in res}
    res["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
