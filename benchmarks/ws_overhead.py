"""What the WebSocket server adds to a chunk, and how many chunks a second it sustains, on loopback.

    python benchmarks/ws_overhead.py [--seconds 4] [--connections 1,16,64] [--quick]

Starts `streamserve serve` (default model, CPU) in a subprocess on a free loopback port; the clients are
the Python SDK in this process. Both engines run eagerly (`--cpu-compile off`): a compile finishing mid-run would
change the compute under the rates, and the overhead is measured beyond the compute anyway.
1. Overhead: one connection appends 200 small chunks (4 token ids) one after another. Per chunk, the
   round trip seen by the client minus the engine's compute (`ack.compute_ms`) and queueing
   (`ack.queue_ms`): what the protocol, the server and the network stack add. Beside it, the same
   chunks through the engine's own asyncio API in this process (`append_chunk_async`, no server): what
   the engine loop's hand-over adds. Both as p50 / p99 ms.
2. Sustained rate: C connections (1, 16, 64), each with one session, append 4-token chunks as fast as
   acks come back, up to 8 in flight per connection, for --seconds: acks a second, and the p50 / p99
   round trip.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import streamserve_client as sc
from streamserve import Engine

CHUNK = [101, 102, 103, 104]
IN_FLIGHT = 8


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else float("nan")


def start_server() -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "streamserve", "serve", "--port", "0", "--device", "cpu",
                             "--kv-memory", "512MiB", "--messages-per-second", "100000",
                             "--max-sessions-per-connection", "2", "--cpu-compile", "off"],
                            stderr=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
    port = None
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
        if "ready:" in line:
            break
        if "failed" in line:
            raise SystemExit(line)
    assert port is not None
    return proc, port


async def overhead_server(url: str, n: int) -> list[float]:
    async with sc.connect(url) as client:
        s = await client.open_session(window=512)
        out = []
        for _ in range(n):
            ack = await s.append(token_ids=CHUNK)
            out.append(ack.round_trip_ms - ack.compute_ms - ack.queue_ms)
        await s.close()
    return out[10:]  # the first few warm things up


async def overhead_engine(engine: Engine, n: int) -> list[float]:
    s = engine.open_session(window=512)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        ack = await s.append_chunk_async(token_ids=CHUNK)
        out.append((time.perf_counter() - t0) * 1e3 - ack.compute_ms - ack.queue_ms)
    s.close()
    return out[10:]


async def sustained(url: str, connections: int, seconds: float) -> dict[str, float]:
    clients = [sc.connect(url) for _ in range(connections)]
    await asyncio.gather(*(c.connect() for c in clients))
    sessions = await asyncio.gather(*(c.open_session(window=512) for c in clients))
    rtt: list[float] = []
    done = 0
    end = time.monotonic() + seconds

    async def pump(s: sc.Session) -> None:
        nonlocal done
        while time.monotonic() < end:
            acks = await asyncio.gather(*(s.append(token_ids=CHUNK) for _ in range(IN_FLIGHT)))
            rtt.extend(a.round_trip_ms for a in acks)
            done += len(acks)

    t0 = time.monotonic()
    await asyncio.gather(*(pump(s) for s in sessions))
    elapsed = time.monotonic() - t0
    await asyncio.gather(*(c.close() for c in clients))
    return {"connections": connections, "acks_per_s": round(done / elapsed, 1), "rtt_p50_ms": pct(rtt, 0.5),
            "rtt_p99_ms": pct(rtt, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--connections", default="1,16,64")
    ap.add_argument("--quick", action="store_true", help="60 chunks, connections 1 and 4 for 1 s (CI smoke run)")
    args = ap.parse_args()
    n = 60 if args.quick else 200
    levels = [1, 4] if args.quick else [int(x) for x in args.connections.split(",")]
    seconds = 1.0 if args.quick else args.seconds
    proc, port = start_server()
    url = f"ws://127.0.0.1:{port}"
    try:
        server_ms = asyncio.run(overhead_server(url, n))
        engine = Engine.from_pretrained("default", device="cpu", kv_memory="256MiB", cpu_compile="off")
        engine_ms = asyncio.run(overhead_engine(engine, n))
        engine.shutdown()
        rates = []
        for c in levels:
            r = asyncio.run(sustained(url, c, seconds))
            rates.append(r)
            print(f"{c:3d} connections: {r['acks_per_s']:8.1f} acks/s, round trip p50 {r['rtt_p50_ms']} ms, "
                  f"p99 {r['rtt_p99_ms']} ms", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(30)
    res = {"benchmark": "ws_overhead", "model": "default", "device": "cpu", "chunk_tokens": len(CHUNK),
           "server_overhead_p50_ms": pct(server_ms, 0.5), "server_overhead_p99_ms": pct(server_ms, 0.99),
           "engine_api_overhead_p50_ms": pct(engine_ms, 0.5), "engine_api_overhead_p99_ms": pct(engine_ms, 0.99),
           "sustained": rates}
    print(f"overhead beyond compute: server {res['server_overhead_p50_ms']} ms p50 "
          f"({res['server_overhead_p99_ms']} p99); engine API alone {res['engine_api_overhead_p50_ms']} ms p50",
          file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
