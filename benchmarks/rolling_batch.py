"""Robots' decode steps with their rolling-window attention batched in one call, against one call per session.

    python benchmarks/rolling_batch.py [--robots 1,8,16] [--tokens 64] [--repeats 3] [--quick]

default-policy in process on the CPU, one rolling session per robot (the policy's window and sinks) holding 90
tokens; each robot asks for a constrained reply of `--tokens` action tokens, all at once, so every engine step
decodes one token per robot. Timed side by side in one run, alternating: the op table as shipped (rolling sessions
of few tokens in one `attention_rolling_batch` call: kernels/rolling_batch.py) and the same table without it (one
`attention_rolling` call per session per layer, as before). `same_tokens`: every robot's tokens are identical.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

import torch


def run(engine: Any, codec: Any, robots: int, tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    """-> ms per engine step (one token per robot), and each robot's session tokens."""
    kw = {"max_tokens": tokens, "temperature": 0.0, "stop_token_ids": (), "allowed_token_ids": codec.action_ids,
          "detokenize": False}
    sessions = [engine.open_session(window=codec.window, sinks=codec.sinks) for _ in range(robots)]
    try:
        for s in sessions:
            s.append(token_ids=[codec.action_ids[0]] * 90)
        for st in [s.stream(**kw) for s in sessions]:  # warm: the window rolls from here on
            st.wait()
        t0 = time.perf_counter()
        for _ in range(repeats):
            for st in [s.stream(**kw) for s in sessions]:
                st.wait()
        seconds = time.perf_counter() - t0
        return seconds / (repeats * tokens) * 1e3, [list(s.token_ids) for s in sessions]
    finally:
        for s in sessions:
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--robots", default=None, help="comma-separated robot counts (default 1,8,16; --quick 4)")
    ap.add_argument("--tokens", type=int, default=None, help="action tokens per reply (default 64; --quick 8)")
    ap.add_argument("--repeats", type=int, default=None, help="replies per robot timed (default 3; --quick 1)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (CI)")
    args = ap.parse_args()
    args.robots = args.robots or ("4" if args.quick else "1,8,16")
    args.tokens = args.tokens or (8 if args.quick else 64)
    args.repeats = args.repeats or (1 if args.quick else 3)
    from streamserve import Engine
    from streamserve.robot.rollout import engine_codec

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    engine = Engine.from_pretrained("default-policy", device="cpu", cpu_compile="off")  # the eager op tables compared
    codec = engine_codec(engine)
    model = engine.model
    tables = {"batched": model.ops, "per_session": dataclasses.replace(model.ops, attention_rolling_batch=None)}
    out: dict[str, Any] = {"benchmark": "rolling_batch", "cpu_count": os.cpu_count(), "model": "default-policy",
                           "tokens": args.tokens, "levels": []}
    for n in (int(x) for x in args.robots.split(",")):
        ms: dict[str, list[float]] = {name: [] for name in tables}
        ids: dict[str, list[list[int]]] = {}
        for _ in range(2):  # alternating, twice: drift on a noisy machine hits both
            for name, ops in tables.items():
                model.ops = ops
                step_ms, ids[name] = run(engine, codec, n, args.tokens, args.repeats)
                ms[name].append(step_ms)
        model.ops = tables["batched"]
        best = {name: min(v) for name, v in ms.items()}
        out["levels"].append({"robots": n, "ms_per_step": {k: round(v, 2) for k, v in best.items()},
                              "speedup": round(best["per_session"] / best["batched"], 2),
                              "same_tokens": ids["batched"] == ids["per_session"]})
    engine.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
