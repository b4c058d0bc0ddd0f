"""Hand-off seen from outside: the Python SDK, connected through a loopback forwarder (a stand-in for the proxy)
that sends new connections to instance B once A drains, resumes on B transparently and its greedy continuation
equals an uninterrupted one; `streamserve serve` drains on SIGUSR1 and exits 0."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import websockets
from test_handoff import REPLY, TURNS, WAIT_S, Raw, drain, moved_out, pages, pair, uninterrupted

import streamserve_client as sc


class Forwarder:
    """A loopback TCP forwarder: each new connection goes to the port `target` names when it arrives (a proxy that
    sends new connections to another instance once one drains)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            w.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.close()

        for t in (asyncio.create_task(pipe(r, uw)), asyncio.create_task(pipe(ur, w))):
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for t in list(self.tasks):
            t.cancel()


@pytest.mark.asyncio
async def test_the_sdk_resumes_on_the_other_instance_transparently(tmp_path: Path) -> None:
    async with pair(tmp_path) as (a, b):
        expected = await uninterrupted(b, chat=False)
        fwd = Forwarder(a.port)
        port = await fwd.start()
        try:
            async with sc.connect(f"ws://127.0.0.1:{port}") as client:
                s = await client.open_session()
                got = []
                for i in range(2):
                    await s.append(text=TURNS[i])
                    r = s.respond(max_tokens=REPLY, temperature=0.0)
                    _ = [d async for d in r]
                    got.append(r.token_ids)
                fwd.target = b.port  # new connections reach B from now on
                await drain(a)
                await asyncio.wait_for(a.server.drained.wait(), WAIT_S)
                ack = await asyncio.wait_for(s.append(text=TURNS[2]), WAIT_S)  # on B, after the resume
                assert ack.seq == 2 and client.channel.generation == 2
                r = s.respond(max_tokens=REPLY, temperature=0.0)
                _ = [d async for d in r]
                got.append(r.token_ids)
                assert got == expected
                assert b.server.service.registry.find(s.id) is not None and pages(a) == 0
                await s.close()
            assert pages(b) == 0
        finally:
            await fwd.stop()


def test_sigusr1_drains_the_serve_process_into_the_store_and_it_exits_0(tmp_path: Path) -> None:
    """`streamserve serve` handles SIGUSR1 where it handles SIGINT and SIGTERM: a drain, then exit status 0; the
    session of a connected client is in the store afterwards, and the client got `reconnect` and 1012."""
    import re
    import signal
    import subprocess
    import sys

    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "streamserve", "serve", "--port", "0", "--kv-memory", "64MiB",
                             "--no-voice", "--no-vision", "--snapshot-store", str(store)],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        port = None
        for line in proc.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else port
            if "ready:" in line:
                break
        assert port is not None

        async def client() -> str:
            ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/stream")
            c = Raw(ws)
            await c.recv()
            sid = (await c.request({"type": "open"}))["session"]
            await c.append(sid, 0, text=TURNS[0])
            proc.send_signal(signal.SIGUSR1)
            await moved_out(c, sid)
            return sid

        sid = asyncio.run(client())
        rest = proc.stderr.read()
        assert proc.wait(60) == 0 and "drained" in rest, rest
        assert [p.name for p in store.iterdir()] == [f"{sid}.rec"]
    finally:
        if proc.poll() is None:
            proc.kill()
