"""Hand-off figures on this machine (the default model, CPU): snapshot/record bytes per 1,000 tokens, and the pause
per session: A's snapshot + put, B's claim + restore, and what a client sees from the 1012 close to `opened` on B.

    python benchmarks/handoff_pause.py [SESSIONS] [TOKENS]

Prints one JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # tests/serving.py: in-process servers

import msgpack
import websockets
from serving import serve

from streamserve.config import ServerConfig
from streamserve.server.service import handoff, lifecycle

SESSIONS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
CHUNK = 200
timings: dict[str, list[float]] = {"record_ms": [], "put_ms": [], "claim_ms": [], "restore_ms": []}
sizes: list[tuple[int, int]] = []  # (tokens, record bytes)


def timed(cls: type, name: str, key: str) -> None:
    fn = getattr(cls, name)

    def wrapper(*a, **kw):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            timings[key].append((time.perf_counter() - t0) * 1e3)

    setattr(cls, name, wrapper)


timed(lifecycle.ServiceLifecycle, "record_of", "record_ms")
timed(handoff.DirectoryStore, "put", "put_ms")
timed(handoff.DirectoryStore, "claim", "claim_ms")
timed(lifecycle.ServiceLifecycle, "restored", "restore_ms")
_encode = handoff.HandoffRecord.encode


def encode(self: handoff.HandoffRecord) -> bytes:
    data = _encode(self)
    sizes.append((len(self.snapshot.token_ids), len(data)))
    return data


handoff.HandoffRecord.encode = encode  # type: ignore[method-assign]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else float("nan")


async def main() -> None:
    store = tempfile.mkdtemp(prefix="handoff-store-")
    cfg = ServerConfig(snapshot_store=store, resume_ttl=60.0, max_chunk_tokens=CHUNK, messages_per_second=1000.0,
                       max_sessions_per_connection=SESSIONS)
    async with serve(cfg) as a, serve(cfg) as b:
        ws = await websockets.connect(a.url + "/v1/stream")
        await ws.recv()
        ids = a.engine.tokenizer.encode("In the beginning God created the heaven and the earth. " * 400,
                                        add_special_tokens=False)
        sessions = []
        for i in range(SESSIONS):
            await ws.send(msgpack.packb({"type": "open", "id": i}))
            m = msgpack.unpackb(await ws.recv())
            sid, token = m["session"], m["resume_token"]
            for seq, at in enumerate(range(0, TOKENS, CHUNK)):
                await ws.send(msgpack.packb({"type": "append", "session": sid, "seq": seq,
                                             "token_ids": ids[at:min(at + CHUNK, TOKENS)]}))
                while msgpack.unpackb(await ws.recv())["type"] != "ack":
                    pass
            sessions.append((sid, token))
        req = urllib.request.Request(a.http + "/admin/drain", method="POST")
        t_drain = time.perf_counter()
        await asyncio.to_thread(lambda: urllib.request.urlopen(req, timeout=30).read())
        try:
            while True:
                await ws.recv()
        except websockets.ConnectionClosed:
            pass
        t_closed = time.perf_counter()
        ws2 = await websockets.connect(b.url + "/v1/stream")
        await ws2.recv()
        client_ms = []
        for i, (sid, token) in enumerate(sessions):
            t0 = time.perf_counter()
            await ws2.send(msgpack.packb({"type": "resume", "id": i, "session": sid, "resume_token": token}))
            while (m := msgpack.unpackb(await ws2.recv()))["type"] != "opened":
                assert m["type"] != "error", m
            client_ms.append((time.perf_counter() - t0) * 1e3)
        await ws2.close()
    per_1k = [n / t * 1000 for t, n in sizes if t]
    out = {"sessions": SESSIONS, "tokens_per_session": TOKENS, "model": "default",
           "record_bytes_per_1k_tokens": round(statistics.mean(per_1k)),
           "a_snapshot_ms_p50": pct(timings["record_ms"], 0.5), "a_snapshot_ms_p99": pct(timings["record_ms"], 0.99),
           "a_put_ms_p50": pct(timings["put_ms"], 0.5), "a_put_ms_p99": pct(timings["put_ms"], 0.99),
           "drain_total_ms": round((t_closed - t_drain) * 1e3, 1),
           "b_claim_ms_p50": pct(timings["claim_ms"], 0.5), "b_restore_ms_p50": pct(timings["restore_ms"], 0.5),
           "b_resume_roundtrip_ms_p50": pct(client_ms, 0.5), "b_resume_roundtrip_ms_p99": pct(client_ms, 0.99)}
    print(json.dumps(out))


asyncio.run(main())
