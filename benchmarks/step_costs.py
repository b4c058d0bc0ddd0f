"""What one engine step costs on this machine, side by side: the figures the CPU choices rest on.

    python benchmarks/step_costs.py [--reps 40] [--quick]

Default model, CPU, float32, a session holding 290 tokens; medians of --reps, each pair measured in one run:
1. Verification width: a step of T = 2, 3, 5, 8 tokens (all logits kept, as a draft verification does)
   against a one-token step -> the cost ratio r(T) speculative decoding has to beat.
2. Intra-op threads: prefills of 1 to 256 tokens on 1 thread against the machine's default, fresh sessions, the two
   counts alternated in blocks;
   `threads_pay_from_tokens` is the size from which every larger step ran faster on all threads, what
   `CPU_SMALL_STEP_TOKENS` in streamserve/engine/batch.py is set from (--quick: 3 and 256 tokens only).
3. Batched attention: one decode step of 32 sessions with their attention in one padded call against one
   call per session (the op table's `attention_batch` switched off).
4. The shipped draft model's one-token forward against the target's.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from streamserve import Engine
from streamserve.engine.loading import DEFAULT_MODEL_DIR

ROUNDS = 4  # the thread sweep alternates 1 thread and all of them this many times per step size


def median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def step(engine: Engine, s, n: int, all_rows: bool = False) -> Callable[[], object]:
    length = s.kv.length

    def run() -> None:
        out = engine.run_step([(s, [5] * n)], [all_rows])[0]
        assert not isinstance(out, BaseException), out
        s.kv.truncate(length)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--quick", action="store_true", help="5 reps (CI smoke run)")
    args = ap.parse_args()
    reps = 5 if args.quick else args.reps
    engine = Engine.from_pretrained("default", device="cpu", kv_memory="256MiB", cpu_compile="off")  # eager steps
    s = engine.open_session()
    s.append(token_ids=list(range(10, 300)))
    res: dict = {"benchmark": "step_costs", "model": "default", "device": "cpu", "threads": torch.get_num_threads()}

    one = median_ms(step(engine, s, 1), reps)
    res["verify_ms"] = {"1": round(one, 3)}
    res["verify_ratio"] = {}
    for t in (2, 3, 5, 8):
        ms = median_ms(step(engine, s, t, all_rows=True), reps)
        res["verify_ms"][str(t)] = round(ms, 3)
        res["verify_ratio"][str(t)] = round(ms / one, 2)

    default_threads = torch.get_num_threads()
    sweep = (3, 256) if args.quick else (1, 3, 8, 16, 32, 48, 64, 96, 128, 256)
    for n in sweep:  # prefill n tokens after 10 into a fresh session, the model alone, at a set thread count
        times: dict[int, list[float]] = {1: [], default_threads: []}
        # blocks of reps at one count, then the other (changing it resizes the thread pool), alternated ROUNDS
        # times, so that a slow spell of the machine falls on both counts
        for _ in range(ROUNDS):
            for threads in times:
                torch.set_num_threads(threads)
                for rep in range(-(-reps // ROUNDS) + 2):
                    x = engine.open_session()
                    engine.forward(x.kv, list(range(10, 20)))
                    x.kv.begin(n)
                    t0 = time.perf_counter()
                    engine.model.forward_batch(torch.full((n,), 5), [x.kv], [n - 1])  # the last token's logits
                    if rep >= 2:
                        times[threads].append((time.perf_counter() - t0) * 1e3)
                    x.kv.abort()
                    x.close()
        torch.set_num_threads(default_threads)
        one_thread, many = statistics.median(times[1]), statistics.median(times[default_threads])
        res[f"threads_{n}_tokens_ms"] = {"1": round(one_thread, 3), str(default_threads): round(many, 3),
                                         "many_over_one": round(many / one_thread, 2)}
    # the step size from which every larger one is faster on all threads: what CPU_SMALL_STEP_TOKENS should be
    slower = [n for n in sweep if res[f"threads_{n}_tokens_ms"]["many_over_one"] >= 1.0]
    res["threads_pay_from_tokens"] = next((n for n in sweep if n > max(slower, default=0)), None)

    sessions = [engine.open_session() for _ in range(32)]
    for i, x in enumerate(sessions):
        x.append(token_ids=list(range(10 + i, 60 + i)))
    jobs = [(x, [5]) for x in sessions]

    def decode32() -> None:
        for out, (x, _) in zip(engine.run_step(jobs), jobs, strict=True):
            assert not isinstance(out, BaseException), out
            x.kv.truncate(x.kv.length - 1)
    batched = median_ms(decode32, reps)
    ops = engine.model.ops
    engine.model.ops = replace(ops, attention_batch=None)
    per_session = median_ms(decode32, reps)
    engine.model.ops = ops
    res["decode_32_sessions_ms"] = {"batched_attention": round(batched, 3), "per_session": round(per_session, 3),
                                    "per_session_over_batched": round(per_session / batched, 2)}
    for x in sessions:
        x.close()

    shipped = DEFAULT_MODEL_DIR.parent / "default-draft"
    if (shipped / "config.json").exists():
        # eager, as the target above: the two forwards compared are the same code
        draft = Engine.from_pretrained(shipped, device="cpu", kv_memory="64MiB", cpu_compile="off")
        d = draft.open_session()
        d.append(token_ids=list(range(10, 300)))
        draft_ms = median_ms(step(draft, d, 1), reps)
        res["draft_forward_ms"] = {"draft": round(draft_ms, 3), "target": round(one, 3),
                                   "draft_over_target": round(draft_ms / one, 2)}
        draft.shutdown()
    engine.shutdown()
    for key, val in res.items():
        if isinstance(val, dict):
            print(f"{key}: {val}", file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
