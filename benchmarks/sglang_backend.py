"""The SGLang backend against streamserve's own engine on the same tiny checkpoint, on this CPU, in one run.

    python benchmarks/sglang_backend.py --sglang-python .venv-sglang/bin/python [--sessions 8] [--turns 150]

Both sides run the same Python calls of the session API (`SGLangEngine` and `Engine` open the same sessions):
1. Append latency: 100 chunks of 20 token ids each appended to one session (no reply), p50/p99 ms per chunk.
2. SGLang's session-latency workload (as benchmarks/session_append.py runs it on the engine): S sessions x T turns,
   each turn 16 input tokens then 8 generated greedily, the S sessions at once (one thread each), so each backend
   batches them. Per-turn latency p50/p99 and the last-10/first-10 ratio (persistent sessions: flat), the
   throughput in turns per second, and SGLang's cache reuse (cached tokens over context tokens, summed over the
   last requests of each session).
The checkpoint is a random qwen3 (hidden 64, 2 layers, 4096 positions) in float32; SGLang runs with the CPU recipe
of tests/support/sglang (torch-native attention) on 127.0.0.1. The ratios (SGLang over engine) are what carry over
to other machines; on a GPU both sides are far faster. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from streamserve.engine import Engine
from streamserve.engine.remote import SGLangEngine
from streamserve.engine.remote.launch import LaunchedSGLang
from streamserve.tools.compiled import wait_compiled
from streamserve.tools.random_checkpoint import make_random_checkpoint

CPU_ARGS = ("--device cpu --attention-backend torch_native --disable-overlap-schedule --max-total-tokens 65536 "
            "--dtype float32 --sleep-on-idle")
TURN_IN, TURN_OUT, CHUNK = 16, 8, 20


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def append_latency(engine: Any, chunks: int) -> dict[str, float]:
    s = engine.open_session()
    g = torch.Generator().manual_seed(1)
    times = []
    try:
        for _ in range(chunks):
            ids = torch.randint(10, 250, (CHUNK,), generator=g).tolist()
            t0 = time.perf_counter()
            s.append(token_ids=ids)
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        s.close()
    return {"p50_ms": round(statistics.median(times), 2), "p99_ms": round(pct(times, 0.99), 2)}


def workload(engine: Any, sessions: int, turns: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    inputs = [[torch.randint(10, 250, (TURN_IN,), generator=g).tolist() for _ in range(turns)]
              for _ in range(sessions)]
    lat: list[list[float]] = [[] for _ in range(sessions)]
    opened = [engine.open_session() for _ in range(sessions)]
    outputs: list[list[list[int]]] = [[] for _ in range(sessions)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for ids in inputs[i]:
                t0 = time.perf_counter()
                opened[i].append(token_ids=ids)
                outputs[i].append(opened[i].generate(TURN_OUT, stop_token_ids=()))
                lat[i].append((time.perf_counter() - t0) * 1e3)
        except BaseException as e:  # reported, never hidden
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    cache = [getattr(s, "cache", None) for s in opened]
    for s in opened:
        s.close()
    flat = [x for row in lat for x in row]
    first = statistics.median([x for row in lat for x in row[:10]])
    last = statistics.median([x for row in lat for x in row[-10:]])
    out: dict[str, Any] = {"turn_p50_ms": round(statistics.median(flat), 1), "turn_p99_ms": round(pct(flat, 0.99), 1),
                           "last10_over_first10": round(last / first, 2), "turns_per_s": round(len(flat) / wall, 2),
                           "wall_s": round(wall, 1), "outputs": outputs}
    if all(c is not None for c in cache):
        out["sglang_cached_fraction_last"] = round(sum(c[1] for c in cache) / max(1, sum(c[0] for c in cache)), 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sglang-python", required=True, help="the Python with SGLang (tests/support/sglang/install.sh)")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=150)
    p.add_argument("--chunks", type=int, default=100)
    a = p.parse_args()
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "qwen3"
        make_random_checkpoint(ckpt, "qwen3", 0, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=257,
                               max_position_embeddings=4096)
        print("starting SGLang ...", file=sys.stderr, flush=True)
        child = LaunchedSGLang(ckpt, CPU_ARGS, a.sglang_python)
        child.start(lambda code: print(f"SGLang exited with status {code}", file=sys.stderr))
        try:
            remote = SGLangEngine(ckpt, child.url)
            local = Engine.from_pretrained(ckpt, device="cpu", kv_memory="256MiB")
            wait_compiled(local)  # the compiled decode step a user gets, not its compile
            res: dict[str, Any] = {"bench": "sglang_backend", "sessions": a.sessions, "turns": a.turns,
                                   "load_avg": os.getloadavg()[0]}
            for name, eng in (("engine", local), ("sglang", remote)):
                print(f"{name}: appends, then {a.sessions} x {a.turns} turns ...", file=sys.stderr, flush=True)
                res[f"{name}_append"] = append_latency(eng, a.chunks)
                res[f"{name}_workload"] = workload(eng, a.sessions, a.turns)
            same = res["engine_workload"].pop("outputs") == res["sglang_workload"].pop("outputs")
            res["greedy_outputs_equal"] = same
            res["append_p50_ratio_sglang_over_engine"] = round(
                res["sglang_append"]["p50_ms"] / res["engine_append"]["p50_ms"], 2)
            res["turn_p50_ratio_sglang_over_engine"] = round(
                res["sglang_workload"]["turn_p50_ms"] / res["engine_workload"]["turn_p50_ms"], 2)
            remote.shutdown()
            local.shutdown()
        finally:
            child.stop()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
