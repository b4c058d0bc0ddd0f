"""Persistent sessions vs stateless re-prefill, and an endless windowed stream, on the default model.

    python benchmarks/session_append.py [--sessions 8] [--turns 150] [--stream 20000] [--quick]

1. SGLang's session-latency workload scaled to the default model: S sessions x T turns, each turn 16
   input tokens then 8 generated (greedy), sessions interleaved turn by turn. Measured three ways in one
   run: persistent sessions without a window, persistent sessions with a window (1024, 4 sinks, rolling), and
   stateless (every turn a fresh prefill of the whole history, as a server without sessions does; timed
   on sampled turns of two sessions, it is slow by design). Reports per-turn latency, the
   last-10/first-10 turn ratio of each persistent variant, last-10 over 10 turns from a third of the
   way in (the window is full by then), and the stateless/persistent ratio at the last turn.
2. A stream of --stream tokens through one session with window 1024, sinks 4, in 64-token chunks: KV
   pages held and the one-token step time at 1k tokens and at the end.
3. Embedding chunks: 64-position chunks appended as token ids and as their `embed_tokens` vectors (the
   same computation; the vectors are checked and copied at the call), interleaved, median ms each; then
   a windowed stream of --stream positions of 64-vector chunks: the vectors a session keeps stay bounded.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from streamserve import Engine
from streamserve.tools.compiled import wait_compiled

TURN_IN, TURN_OUT = 16, 8


def turn_inputs(sessions: int, turns: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [[torch.randint(10, 4000, (TURN_IN,), generator=g).tolist() for _ in range(turns)] for _ in range(sessions)]


def persistent(engine: Engine, inputs: list[list[list[int]]], window: int | None) -> tuple[list[float], list]:
    """-> mean latency per turn (over sessions) and the sessions' token histories."""
    sessions = [engine.open_session(window=window, sinks=4) for _ in inputs]
    turns = len(inputs[0])
    lat = [0.0] * turns
    for t in range(turns):
        for s, ins in zip(sessions, inputs, strict=True):
            t0 = time.perf_counter()
            s.append(token_ids=ins[t])
            s.generate(max_tokens=TURN_OUT, stop_token_ids=())
            lat[t] += (time.perf_counter() - t0) / len(sessions)
    histories = [list(s.token_ids) for s in sessions]
    for s in sessions:
        s.close()
    return lat, histories


def stateless_turn(engine: Engine, history: list[int]) -> float:
    """One turn without a session: prefill everything so far, then generate."""
    t0 = time.perf_counter()
    with engine.open_session() as s:
        s.append(token_ids=history)
        s.generate(max_tokens=TURN_OUT, stop_token_ids=())
    return time.perf_counter() - t0


def stream(engine: Engine, total: int, window: int = 1024, sinks: int = 4) -> dict:
    g = torch.Generator().manual_seed(1)
    out: dict = {"window": window, "sinks": sinks}
    with engine.open_session(window=window, sinks=sinks) as s:

        def measure(label: str) -> None:
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                s.append(token_ids=[int(torch.randint(10, 4000, (1,), generator=g))])
                times.append(time.perf_counter() - t0)
            out[f"pages_held_{label}"] = len(s.kv.page_table)
            out[f"step_ms_{label}"] = round(1e3 * statistics.median(times), 3)

        while len(s.token_ids) < total:
            s.append(token_ids=torch.randint(10, 4000, (64,), generator=g).tolist())
            if "step_ms_1k" not in out and len(s.token_ids) >= 1024:
                measure("1k")
        measure("end")
        out["stream_tokens"] = len(s.token_ids)
    out["step_time_ratio_end_vs_1k"] = round(out["step_ms_end"] / out["step_ms_1k"], 3)
    return out


def embedding_chunks(engine: Engine, total: int, rounds: int = 30) -> dict:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(10, 4000, (64,), generator=g).tolist()
    with torch.no_grad():
        vectors = engine.model.embed_tokens(torch.tensor(ids)).clone()  # [64, hidden]
    times: dict[str, list[float]] = {"ids": [], "vectors": []}
    for _ in range(rounds):  # interleaved: both see the same machine load
        for kind in times:
            with engine.open_session() as s:
                s.append(token_ids=ids[:8])
                t0 = time.perf_counter()
                if kind == "ids":
                    s.append(token_ids=ids)
                else:
                    s.append(embeds=vectors, kind="audio")
                times[kind].append(time.perf_counter() - t0)
    out = {f"append_64_{k}_ms": round(1e3 * statistics.median(v), 3) for k, v in times.items()}
    out["vectors_over_ids"] = round(out["append_64_vectors_ms"] / out["append_64_ids_ms"], 3)
    kept = 0
    with engine.open_session(window=1024, sinks=4) as s:
        while len(s.token_ids) < total:
            s.append(embeds=vectors, kind="audio")
            kept = max(kept, len(s.core.vectors))
        out["stream_positions"] = len(s.token_ids)
    out["stream_vectors_kept_max"] = kept  # bounded by sinks + window + a page + a chunk
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=150)
    p.add_argument("--stream", type=int, default=20000)
    p.add_argument("--quick", action="store_true", help="a small run to check the script works")
    args = p.parse_args()
    if args.quick:
        args.sessions, args.turns, args.stream = 2, 12, 2048
    engine = Engine.from_pretrained("default", device="cpu")
    wait_compiled(engine)  # the compiled decode step a user gets (cpu_compile auto), not its compile
    inputs = turn_inputs(args.sessions, args.turns)
    persistent(engine, [ins[:3] for ins in inputs], None)  # warm-up: first-touch of the pool, allocator, caches
    res: dict = {"model": "default", "torch": torch.__version__, "threads": torch.get_num_threads(),
                 "sessions": args.sessions, "turns": args.turns, "turn_input": TURN_IN, "turn_output": TURN_OUT}
    for name, window in (("no_window", None), ("window_1024", 1024)):
        lat, histories = persistent(engine, inputs, window)
        ratio = statistics.mean(lat[-10:]) / statistics.mean(lat[:10])
        mid = lat[args.turns // 3: args.turns // 3 + 10]  # with a 1024 window: full from turn ~43 on
        res[name] = {"turn_ms_first10": round(1e3 * statistics.mean(lat[:10]), 2),
                     "turn_ms_mid10": round(1e3 * statistics.mean(mid), 2),
                     "turn_ms_last10": round(1e3 * statistics.mean(lat[-10:]), 2),
                     "last10_over_first10": round(ratio, 3),
                     "last10_over_mid10": round(statistics.mean(lat[-10:]) / statistics.mean(mid), 3)}
        print(f"persistent {name}: {res[name]}", file=sys.stderr)
        if window is None:
            last = [statistics.mean(lat[-1:])]
            sampled = sorted({1, args.turns // 2, args.turns})
            # the history before turn t's reply: all earlier turns' input and output, plus turn t's input
            stateless = {t: statistics.mean(stateless_turn(engine, h[: t * (TURN_IN + TURN_OUT) - TURN_OUT])
                                            for h in histories[:2]) for t in sampled}
            res["stateless_turn_ms"] = {str(t): round(1e3 * v, 2) for t, v in stateless.items()}
            res["persistent_turn_ms_last"] = round(1e3 * last[0], 2)
            res["stateless_over_persistent_at_last_turn"] = round(stateless[args.turns] / last[0], 2)
            print(f"stateless: {res['stateless_turn_ms']}", file=sys.stderr)
    res["stream"] = stream(engine, args.stream)
    print(f"stream: {res['stream']}", file=sys.stderr)
    res["embedding_chunks"] = embedding_chunks(engine, args.stream, 8 if args.quick else 30)
    print(f"embedding chunks: {res['embedding_chunks']}", file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
