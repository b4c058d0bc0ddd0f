"""The robot policy endpoint under simulated robots: observation -> action latency, control rate and success.

    python benchmarks/robot_loop.py [--robots 1,8,16,32] [--hz 50,10] [--seconds 20] [--rtc K] [--quick]

1. `streamserve serve --model default-policy` runs as a subprocess on a free loopback port. N simulated two-link
   arms (examples/robot_loop.py's real-time loop, streamserve-client's PolicyClient, one connection and one
   session each) run back-to-back seeded episodes at each rate of `--hz` for `--seconds`; each sends an
   observation every H/2 ticks (H: the chunk's horizon) with the deadline of the chunk in hand, and holds still on
   a tick with no row queued (`--rtc K`: with real-time chunking, the K rows queued from the observation's tick
   on sent as its action_prefix). Per level: latency p50/p99 (observation sent -> reply read), the control rate the
   loops held (ticks run / seconds / hz), ticks that ran more than a period late, held ticks and the share of
   ticks with a row to run, stale replies, success rate, forwards per chunk and draft acceptance (from the
   replies' policy_timing). `held_max`: per rate, the most arms of the levels tried with >= 95% of ticks served
   and the loops on their clock.
2. Stateful vs stateless at step 1,000 (in process, the same engine): a persistent episode session has run 1,000
   ticks; each further tick appends only the new observation. A stateless server re-sends the history every tick:
   all of it, or at best the tail the model still attends to (its sinks and window). All three are timed side by
   side on the same ticks, and the stateless action chunks compared with the session's (they must be equal).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HZ = 50.0
HELD_SHARE = 0.95  # a level is held when >= 95% of its ticks had a row to run and the loops kept their clock


def load_example() -> Any:
    spec = importlib.util.spec_from_file_location("robot_loop_example", ROOT / "examples" / "robot_loop.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


def start_server(model: str = "default-policy") -> tuple[subprocess.Popen[str], int, collections.deque[str]]:
    """`streamserve serve --model default-policy` (or `model`) on a free loopback port, ready -> (process, port, its
    log's tail). A thread keeps reading its stderr: a pipe nobody reads would fill and stall it."""
    env = {k: v for k, v in os.environ.items() if k != "STREAMSERVE_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "streamserve", "serve", "--port", "0", "--device", "cpu",
                             "--model", model, "--offline", "--no-voice", "--no-vision"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1"}, cwd=ROOT)
    port, lines = None, collections.deque(maxlen=200)
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        port = int(m.group(1)) if m else port
        if "ready:" in line or "failed" in line:
            break
    if port is None or not any("ready:" in x for x in lines):
        proc.kill()
        raise SystemExit(f"streamserve serve --model default-policy did not start: {''.join(lines)[-3000:]}")
    threading.Thread(target=lines.extend, args=(proc.stderr,), daemon=True).start()
    return proc, port, lines


async def robots(ex: Any, url: str, n: int, seconds: float, hz: float = HZ, rtc: int = 0) -> dict[str, Any]:
    """`n` arms at `hz` for `seconds`, each on its own connection, episodes back to back (`rtc`: real-time
    chunking's prefix rows)."""

    async def one(k: int) -> tuple[list[Any], float]:
        conn = await ex.native_connection(url, None)
        replan = ex.default_replan(conn.metadata)
        deadline = ex.default_deadline_ms(conn.metadata, hz, replan)
        out, t0, e = [], time.monotonic(), 0
        try:
            while time.monotonic() < t0 + seconds:
                seed = 200_000 + 1_000 * k + e
                out.append(await ex.run_episode(conn.request, seed, hz, replan, deadline, rtc=rtc))
                e += 1
        finally:
            await conn.close()
        return out, time.monotonic() - t0  # its episodes, and the time it ran them (its last may end late)

    per_robot = await asyncio.gather(*(one(k) for k in range(n)))
    episodes = [e for r, _ in per_robot for e in r]
    s = ex.summary(episodes)
    s["robots"], s["hz"], s["rtc"] = n, hz, rtc
    # 1.0: every loop ran all its ticks on time (each over its own running time)
    s["control_rate_held"] = round(s["ticks"] / (sum(wall for _, wall in per_robot) * hz), 3)
    s["fresh_tick_share"] = round(1.0 - s["held_ticks"] / max(1, s["ticks"]), 3)  # ticks with a row to run
    s["held"] = s["fresh_tick_share"] >= HELD_SHARE and s["control_rate_held"] >= HELD_SHARE \
        and s["missed_ticks"] <= (1.0 - HELD_SHARE) * s["ticks"]
    return s


def stateless_ratio(ticks_before: int, measured: int, model: str = "default-policy") -> dict[str, Any]:
    """Per-tick cost on a persistent session at step `ticks_before` vs a stateless server's, which runs each tick
    on a fresh session: re-sending the whole history (the issue's comparison), or only the tail the model still
    attends to (the sinks and a window's worth: the least a stateless server could re-send and get the same
    actions). Fresh sessions use the episode's window, so the same context gives the same actions; checked."""
    import torch

    from streamserve import Engine
    from streamserve.robot import arm
    from streamserve.robot.rollout import EnginePolicy, engine_codec
    from streamserve.tools.compiled import wait_compiled

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    engine = Engine.from_pretrained(model, device="cpu")
    wait_compiled(engine)  # the compiled decode step a user gets (cpu_compile auto), not its compile
    codec = engine_codec(engine)
    kw = {"max_tokens": codec.n_action_tokens, "temperature": 0.0, "stop_token_ids": (),
          "allowed_token_ids": codec.action_ids}
    q, target = arm.episode_start(7)
    rng = np.random.default_rng(7)
    replan = max(1, codec.action_horizon // 2)
    cost = {"stateful": 0.0, "full_history": 0.0, "window_tail": 0.0}
    same = {"full_history": 0, "window_tail": 0}
    tokens = {"full_history": 0, "window_tail": 0}

    def fresh(ids: list[int]) -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        with engine.open_session(window=codec.window, sinks=codec.sinks) as s:
            s.append(token_ids=ids)
            out = [i for d in s.stream(**kw) for i in d.token_ids]
        return time.perf_counter() - t0, codec.actions(out)

    history: list[int] = []  # every token the episode's session took (its own token log keeps only the recent)
    with EnginePolicy(engine, codec) as policy:
        for t in range(ticks_before + measured):
            if t and t % 150 == 0:  # a new target now and then: the arm keeps moving
                target = arm.random_target(rng)
            before = len(policy.session) if policy.session is not None else 0
            t0 = time.perf_counter()
            chunk = policy(arm.observation(q, target))
            dt = time.perf_counter() - t0
            assert policy.session is not None
            history += list(policy.session.token_ids)[before - len(policy.session):]
            if t >= ticks_before:
                cost["stateful"] += dt
                hist = history[:-codec.n_action_tokens]  # the tick's input, whole
                tail = hist[:codec.sinks] + hist[codec.sinks:][-(codec.window + codec.n_action_tokens):]
                for name, ids in (("full_history", hist), ("window_tail", tail)):
                    sec, actions = fresh(ids)
                    cost[name] += sec
                    tokens[name] = len(ids)
                    same[name] += bool(np.array_equal(actions, chunk))
            for qd in chunk[:replan]:
                q = arm.step(q, qd)
    engine.shutdown()
    ms = {k: round(v / measured * 1000, 2) for k, v in cost.items()}
    return {"step": ticks_before, "ticks_measured": measured, "ms_per_tick": ms,
            "tokens_per_tick": {"stateful": codec.state_dims + 2, **tokens},
            "cost_ratio_full_history": round(cost["full_history"] / cost["stateful"], 2),
            "cost_ratio_window_tail": round(cost["window_tail"] / cost["stateful"], 2),
            "same_actions": {k: f"{v}/{measured}" for k, v in same.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--robots", default=None, help="comma-separated robot counts (default 1,8,16,32; --quick 1,2)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds per level (default 20; --quick 4)")
    ap.add_argument("--step", type=int, default=None, help="ticks before the stateless comparison (default 1000)")
    ap.add_argument("--hz", default=None, help="comma-separated control rates (default 50,10; --quick 50)")
    ap.add_argument("--rtc", type=int, default=0, metavar="K",
                    help="real-time chunking: each observation's action_prefix is the K rows queued (default 0: off)")
    ap.add_argument("--model", default="default-policy", help="the policy checkpoint served (default-policy)")
    ap.add_argument("--quick", action="store_true", help="a short smoke run (CI)")
    args = ap.parse_args()
    rates = [float(x) for x in (args.hz or ("50" if args.quick else "50,10")).split(",")]
    levels = [int(x) for x in (args.robots or ("1,2" if args.quick else "1,8,16,32")).split(",")]
    seconds = args.seconds or (4.0 if args.quick else 20.0)
    step = args.step if args.step is not None else (60 if args.quick else 1000)
    ex = load_example()
    result: dict[str, Any] = {"benchmark": "robot_loop", "cpu_count": os.cpu_count(), "hz": HZ,
                              "seconds": seconds, "rtc": args.rtc, "model": args.model,
                              "load_avg_1m_at_start": round(os.getloadavg()[0], 2), "levels": []}
    proc, port, log = start_server(args.model)
    try:
        for hz in rates:
            for n in levels:
                r = asyncio.run(robots(ex, f"ws://127.0.0.1:{port}/v1/policy", n, seconds, hz, args.rtc))
                print(json.dumps(r), file=sys.stderr, flush=True)
                result["levels"].append(r)
        # the most arms held at each rate (levels tried only; None: not even the fewest)
        result["held_max"] = {str(hz): max((r["robots"] for r in result["levels"] if r["hz"] == hz and r["held"]),
                                           default=None) for hz in rates}
    except BaseException:
        print("".join(log)[-3000:], file=sys.stderr)
        raise
    finally:
        proc.terminate()
        proc.wait(30)
    result["stateless"] = stateless_ratio(step, 10 if args.quick else 30, args.model)
    result["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
