"""Many real-time sessions on one engine: the default model, through the async API.

    python benchmarks/concurrency.py [--sessions 1,8,32,128] [--seconds 8] [--search 3]
                                     [--flood-step-tokens 256,64,32] [--quick]

Each of N sessions appends a 200 ms text chunk in real time (5 per second: the next few words of the KJV,
with its capture time and the default deadline of capture + 200 ms) and every 2 s asks for a 16-token
greedy reply, read as it streams while its chunks keep coming (they queue behind the reply). Session
starts are spread over the first chunk period. Per N: p50/p99 append latency (capture to ack), the
share of chunks acked after their deadline, time to first token, inter-token latency, engine steps
and tokens per step. Then the largest N held in real time without a missed deadline: the largest level
that missed none, refined by --search rounds of bisection towards the smallest level that missed some.

Then the flood case, per step budget in --flood-step-tokens (an engine each): N = 8 sessions appending
as above but asking for no replies (a chunk sent during a session's own reply waits for it, which is not
what is measured here), alone, then again while a ninth session floods the engine with 1,000-token chunks
(3 kept submitted, from 0.3 s before the 8 start; capture time = submission, default deadline: they fall
behind at once). Side by side: the 8 sessions' append p50/p99 and missed deadlines with and without the
flood, how many of the 8 missed any, the p99 ratio, and the flood's own throughput (it still progresses).
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time

from streamserve import Engine
from streamserve.config import SCHEDULER_DEFAULTS, SchedulerConfig
from streamserve.engine.session import Session
from streamserve.errors import SessionClosedError
from streamserve.tools.compiled import wait_compiled

CHUNK_S = 0.2  # one chunk every 200 ms
REPLY_EVERY = 10  # chunks: a reply every 2 s
REPLY_TOKENS = 16
FLOOD_TOKENS = 1000
FLOOD_QUEUED = 3
FLOOD_SESSIONS = 8


def corpus_words() -> list[str]:
    try:
        text = subprocess.run(["bible", "-f", "Genesis 1:1-50:26"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    words = text.split()
    return words if len(words) > 1000 else ("In the beginning God created the heaven and the earth . " * 200).split()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def session_task(engine: Engine, words: list[str], start: float, seconds: float, rng: random.Random,
                       rec: dict[str, list[float]], index: int, replies: bool = True) -> None:
    s = engine.open_session()
    pos = rng.randrange(len(words) - 1000)
    tasks: list[asyncio.Task] = []  # the replies asked for

    async def reply(asked: float) -> None:
        last = None
        async for _ in s.stream(max_tokens=REPLY_TOKENS, stop_token_ids=()):
            now = time.monotonic()
            if last is None:
                rec["ttft"].append(now - asked)
            else:
                rec["itl"].append(now - last)
            last = now

    try:
        k = 0
        while True:
            due = start + k * CHUNK_S
            if due - start >= seconds:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            n = rng.randint(1, 3)  # about 2.5 words a second: speech
            text = " " + " ".join(words[pos:pos + n])
            pos += n
            ack = await s.append_chunk_async(text=text, capture_time=due)
            rec["append"].append(time.monotonic() - due)
            rec["missed"].append(float(ack.deadline_missed))
            if ack.deadline_missed:
                rec["sessions_missing"].append(index)
            k += 1
            if replies and k % REPLY_EVERY == 0 and (not tasks or tasks[-1].done()):
                tasks.append(asyncio.create_task(reply(time.monotonic())))
        await asyncio.gather(*tasks)
    finally:
        s.close()


async def flood_task(session: Session, stop: asyncio.Event, acked: list[int]) -> None:
    """Keep FLOOD_QUEUED chunks of FLOOD_TOKENS submitted until `stop`; `acked` gets each chunk's tokens."""
    rng = random.Random(0)
    pending: set[asyncio.Future] = set()
    while not stop.is_set():
        while len(pending) < FLOOD_QUEUED:
            ids = [rng.randrange(10, 4000) for _ in range(FLOOD_TOKENS)]
            pending.add(asyncio.wrap_future(session.submit_chunk(token_ids=ids)))
        done, pending = await asyncio.wait(pending, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
        acked += [f.result().tokens for f in done]
    session.close()  # its queued chunks fail: they were only there to be in the way
    for f in pending:
        with contextlib.suppress(SessionClosedError):
            await f


async def run_level(engine: Engine, words: list[str], n: int, seconds: float, flood: bool = False,
                    replies: bool = True) -> dict[str, float]:
    rec: dict[str, list[float]] = {"append": [], "missed": [], "ttft": [], "itl": [], "sessions_missing": []}
    rng = random.Random(n)
    stop, flood_acked = asyncio.Event(), list[int]()
    flooding: asyncio.Task[None] | None = None
    if flood:
        flooding = asyncio.create_task(flood_task(engine.open_session(window=1024), stop, flood_acked))
        await asyncio.sleep(0.3)  # its chunks queue up ahead of everyone's
    t0 = time.monotonic() + 0.05
    steps0, tokens0 = engine.loop.steps, engine.stats()["prefill_tokens"] + engine.stats()["decode_tokens"]
    await asyncio.gather(*(session_task(engine, words, t0 + CHUNK_S * i / n, seconds, rng, rec, i, replies)
                           for i in range(n)))
    steps = engine.loop.steps - steps0
    tokens = engine.stats()["prefill_tokens"] + engine.stats()["decode_tokens"] - tokens0
    elapsed = time.monotonic() - t0
    stop.set()
    if flooding is not None:
        await flooding
    ms = 1e3
    return {
        "sessions": n, "chunks": len(rec["append"]), "replies_tokens": len(rec["itl"]) + len(rec["ttft"]),
        "sessions_missing_deadlines": len(set(rec["sessions_missing"])),
        **({"flood_tokens_per_s": round(sum(flood_acked) / elapsed, 1)} if flood else {}),
        "append_p50_ms": round(pct(rec["append"], 0.5) * ms, 2),
        "append_p99_ms": round(pct(rec["append"], 0.99) * ms, 2),
        "missed_deadlines": int(sum(rec["missed"])),
        "missed_share": round(sum(rec["missed"]) / max(1, len(rec["missed"])), 4),
        **({"ttft_p50_ms": round(pct(rec["ttft"], 0.5) * ms, 2), "ttft_p99_ms": round(pct(rec["ttft"], 0.99) * ms, 2),
            "itl_p50_ms": round(pct(rec["itl"], 0.5) * ms, 2), "itl_p99_ms": round(pct(rec["itl"], 0.99) * ms, 2)}
           if replies else {}),
        "steps": steps, "tokens_per_step": round(tokens / max(1, steps), 2),
    }


def flood_case(words: list[str], step_tokens: int, seconds: float) -> dict[str, object]:
    """N = FLOOD_SESSIONS alone, then with the flood, on one engine with `step_tokens` per step."""
    # min_append_tokens (default 32) is a floor under every step's append budget: lowered with the budget here
    engine = Engine.from_pretrained("default", kv_memory="1GiB", scheduler=SchedulerConfig(
        step_tokens=step_tokens, min_append_tokens=min(step_tokens, SCHEDULER_DEFAULTS.min_append_tokens)))
    wait_compiled(engine)
    asyncio.run(run_level(engine, words, 2, 0.5))  # warm-up
    alone = asyncio.run(run_level(engine, words, FLOOD_SESSIONS, seconds, replies=False))
    flooded = asyncio.run(run_level(engine, words, FLOOD_SESSIONS, seconds, flood=True, replies=False))
    engine.shutdown()
    for name, r in (("alone", alone), ("flood", flooded)):
        print(f"step_tokens={step_tokens:4d} {name:5s}  append p50 {r['append_p50_ms']:7.2f} ms  "
              f"p99 {r['append_p99_ms']:8.2f} ms  missed {r['missed_deadlines']:4d}/{r['chunks']:5d} "
              f"in {r['sessions_missing_deadlines']} of {FLOOD_SESSIONS} sessions", file=sys.stderr)
    return {"step_tokens": step_tokens, "without_flood": alone, "with_flood": flooded,
            "append_p99_ratio_with_vs_without": round(flooded["append_p99_ms"] / alone["append_p99_ms"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="1,8,32,128", help="comma-separated session counts")
    ap.add_argument("--seconds", type=float, default=8.0, help="real-time seconds per level")
    ap.add_argument("--search", type=int, default=3, help="bisection rounds for the largest N held")
    ap.add_argument("--flood-step-tokens", default="256,64,32",
                    help="step budgets (SchedulerConfig.step_tokens) to run the flood case with, one engine each")
    ap.add_argument("--quick", action="store_true", help="N = 1 and 4 for 2.2 s, flood case at 16 (CI smoke run)")
    args = ap.parse_args()
    levels = [1, 4] if args.quick else [int(x) for x in args.sessions.split(",") if x]
    rounds = 0 if args.quick else args.search
    seconds = 2.2 if args.quick else args.seconds
    engine = Engine.from_pretrained("default", kv_memory="1GiB")
    wait_compiled(engine)  # the compiled decode step a user gets (cpu_compile auto), not its compile
    words = corpus_words()
    # warm up (first-call allocations) before anything is timed
    asyncio.run(run_level(engine, words, 2, 0.5))
    results: list[dict[str, float]] = []

    def level(n: int) -> bool:
        r = asyncio.run(run_level(engine, words, n, seconds))
        results.append(r)
        print(f"N={n:4d}  append p50 {r['append_p50_ms']:7.2f} ms  p99 {r['append_p99_ms']:8.2f} ms  "
              f"missed {r['missed_deadlines']:4d}/{r['chunks']:5d}  ttft p50 {r['ttft_p50_ms']:7.2f} ms  "
              f"itl p50 {r['itl_p50_ms']:6.2f} p99 {r['itl_p99_ms']:7.2f} ms  tokens/step {r['tokens_per_step']}",
              file=sys.stderr)
        return r["missed_deadlines"] == 0

    ok = {n: level(n) for n in levels}
    good = max((n for n in ok if ok[n]), default=0)
    bad = min((n for n in ok if not ok[n] and n > good), default=None)
    for _ in range(rounds):
        if bad is None or bad - good <= 1:
            break
        mid = (good + bad) // 2
        if level(mid):
            good = mid
        else:
            bad = mid
    engine.shutdown()
    budgets = [16] if args.quick else [int(x) for x in args.flood_step_tokens.split(",") if x]
    floods = [flood_case(words, b, seconds) for b in budgets]
    print(json.dumps({"benchmark": "concurrency", "model": "default", "device": str(engine.device),
                      "dtype": str(engine.dtype).removeprefix("torch."), "seconds_per_level": seconds,
                      "levels": results, "largest_n_without_missed_deadline": good,
                      "smallest_n_with_missed_deadline": bad, "flood": floods}))


if __name__ == "__main__":
    main()
