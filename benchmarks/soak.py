"""Soak: endless windowed sessions on `streamserve serve` for a long time; the server's memory must stay flat.

    python benchmarks/soak.py [--minutes 30] [--sessions 4] [--window 256] [--sample-s 10] [--model default]
    python benchmarks/soak.py --quick          # 20 seconds: checks the script runs

It starts `streamserve serve` on loopback (a free port) and runs --sessions native-protocol sessions through the
Python SDK, each with a sliding window and 4 attention sinks: every 200 ms a chunk of KJV words is appended in
real time, and every 10 chunks a 16-token greedy reply is streamed. Every session is closed and reopened every
--reopen-minutes (connections and sessions churn as they do in service). Every --sample-s seconds the server's
resident memory (VmRSS of its process, from /proc) and its KV pages in use (the `stats` message) are sampled.

Reported: the RSS and pages curves; RSS growth from the end of warm-up (the first fifth of the run) to the end, as
MiB and as MiB per hour (a least-squares slope over the samples after warm-up); pages in use after warm-up (min,
max: a windowed session's pages are constant); append p50/p99 (capture to ack) and missed deadlines; errors by
code; and, after every session is closed, the pages still in use (leaked pages; must be 0). The last line printed
is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import streamserve_client as sc

ROOT = Path(__file__).resolve().parent.parent
CHUNK_S = 0.2
REPLY_EVERY = 10
REPLY_TOKENS = 16
WORDS = ("In the beginning God created the heaven and the earth . And the earth was without form , and void ; "
         "and darkness was upon the face of the deep . And the Spirit of God moved upon the face of the waters . "
         ).split()


def start_server(model: str) -> tuple[subprocess.Popen[str], int, collections.deque[str]]:
    """`streamserve serve` on a free loopback port -> (process, port, the last lines of its log)."""
    args = [sys.executable, "-m", "streamserve", "serve", "--port", "0", "--device", "cpu", "--kv-memory", "512MiB",
            "--no-voice"]
    if model != "default":
        args += ["--model", model]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    tail: collections.deque[str] = collections.deque(maxlen=50)
    port = None
    assert proc.stderr is not None
    for line in proc.stderr:
        tail.append(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
        if "ready:" in line:
            break
    if port is None or proc.poll() is not None:
        proc.kill()
        raise SystemExit("the server did not start:\n" + "".join(tail))

    def drain() -> None:  # keep reading its log, or a full pipe would block it
        assert proc.stderr is not None
        for line in proc.stderr:
            tail.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return proc, port, tail


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per hour."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    den = sum((p[0] - mx) ** 2 for p in points)
    return 0.0 if den == 0 else 3600 * sum((p[0] - mx) * (p[1] - my) for p in points) / den


class Tally:
    def __init__(self) -> None:
        self.append_ms: list[float] = []
        self.missed = 0
        self.chunks = 0
        self.replies = 0
        self.errors: collections.Counter[str] = collections.Counter()


async def session_loop(url: str, window: int, deadline: float, reopen_s: float, offset: float, tally: Tally) -> None:
    """One endless windowed session, reopened (on a new connection) every `reopen_s` seconds until `deadline`."""
    await asyncio.sleep(offset)
    w = int(offset * 1000) % len(WORDS)
    while time.monotonic() < deadline:
        until = min(deadline, time.monotonic() + reopen_s)
        try:
            async with sc.connect(url) as client:
                s = await client.open_session(window=window, sinks=4)
                n, nxt = 0, time.monotonic()
                while time.monotonic() < until:
                    nxt += CHUNK_S
                    text = " ".join(WORDS[(w + i) % len(WORDS)] for i in range(4))
                    w += 4
                    t0 = time.monotonic()
                    await s.append(text=" " + text)
                    ms = (time.monotonic() - t0) * 1e3
                    tally.append_ms.append(ms)
                    tally.chunks += 1
                    tally.missed += ms > CHUNK_S * 1e3
                    n += 1
                    if n % REPLY_EVERY == 0:
                        await s.respond(max_tokens=REPLY_TOKENS, temperature=0.0).wait()
                        tally.replies += 1
                    await asyncio.sleep(max(0.0, nxt - time.monotonic()))
                await s.close()
        except (sc.StreamserveClientError, OSError) as e:  # counted by code; the loop reconnects
            tally.errors[getattr(e, "code", type(e).__name__)] += 1
            await asyncio.sleep(0.5)


async def sampler(url: str, pid: int, t0: float, deadline: float, every: float, out: list[dict[str, float]]) -> None:
    async with sc.connect(url) as client:
        while True:
            st = await client.stats()
            out.append({"t_s": round(time.monotonic() - t0, 1), "rss_mib": round(rss_mib(pid), 1),
                        "kv_pages_used": st["kv_pages_used"], "sessions_open": st["sessions_open"]})
            if time.monotonic() >= deadline:
                return
            await asyncio.sleep(min(every, max(0.0, deadline - time.monotonic())))


async def soak(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    seconds = args.minutes * 60
    t0 = time.monotonic()
    deadline = t0 + seconds
    tally, samples = Tally(), list[dict[str, float]]()
    tasks = [asyncio.create_task(session_loop(url, args.window, deadline, args.reopen_minutes * 60,
                                              i * CHUNK_S / args.sessions, tally)) for i in range(args.sessions)]
    await sampler(url, pid, t0, deadline, args.sample_s, samples)
    await asyncio.gather(*tasks)
    await asyncio.sleep(1.0)  # closes settle
    async with sc.connect(url) as client:
        st = await client.stats()
    warm = [s for s in samples if s["t_s"] >= seconds / 5]
    res: dict[str, Any] = {
        "minutes": args.minutes, "sessions": args.sessions, "window": args.window, "model": args.model,
        "chunks": tally.chunks, "replies": tally.replies, "missed_deadlines": tally.missed,
        "append_p50_ms": round(pct(tally.append_ms, 0.5), 2), "append_p99_ms": round(pct(tally.append_ms, 0.99), 2),
        "errors": dict(tally.errors), "samples": samples,
        "rss_warm_mib": warm[0]["rss_mib"] if warm else None, "rss_end_mib": samples[-1]["rss_mib"],
        "rss_growth_after_warmup_mib": round(warm[-1]["rss_mib"] - warm[0]["rss_mib"], 1) if warm else None,
        "rss_slope_mib_per_hour": round(slope_per_hour([(s["t_s"], s["rss_mib"]) for s in warm]), 1),
        "pages_after_warmup": [min(s["kv_pages_used"] for s in warm), max(s["kv_pages_used"] for s in warm)]
        if warm else None,
        "leaked_pages": st["kv_pages_used"], "sessions_open_at_end": st["sessions_open"]}
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--window", type=int, default=256, help="each session's sliding window (tokens), 4 sinks")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between memory samples")
    p.add_argument("--reopen-minutes", type=float, default=5.0, help="each session is closed and reopened this often")
    p.add_argument("--model", default="default")
    p.add_argument("--quick", action="store_true", help="20 seconds, 2 sessions: checks the script runs")
    args = p.parse_args()
    if args.quick:
        args.minutes, args.sessions, args.sample_s, args.reopen_minutes = 1 / 3, 2, 2.0, 0.1
    proc, port, tail = start_server(args.model)
    try:
        res = asyncio.run(soak(f"ws://127.0.0.1:{port}", proc.pid, args))
    except BaseException:
        print("the server's last log lines:\n" + "".join(tail), file=sys.stderr)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"RSS {res['rss_warm_mib']} -> {res['rss_end_mib']} MiB after warm-up "
          f"({res['rss_slope_mib_per_hour']} MiB/h), pages {res['pages_after_warmup']}, leaked {res['leaked_pages']}, "
          f"missed {res['missed_deadlines']}/{res['chunks']}, errors {res['errors']}", file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
