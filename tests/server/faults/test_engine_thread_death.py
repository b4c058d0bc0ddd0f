"""Fault injection: the engine thread dies (a BaseException escapes a step, which the loop's per-step handling of
Exceptions does not catch). The server must say so and stop rather than hang: the work in flight and every later
request fail with the typed `engine_failed`, /healthz says `failed`, new connections are closed with 1011, the
thread is not silently restarted, and `streamserve serve` shuts down and exits with status 1."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import pytest
import websockets
from serving import serve

from streamserve.config import ServerConfig


class EngineKilled(BaseException):
    """What kills the thread: not an Exception, so no `except Exception` on the way stops it."""


def raw(frame: dict[str, Any]) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


async def recv(ws: websockets.ClientConnection) -> dict:
    return msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60))


async def until(ws: websockets.ClientConnection, *kinds: str) -> dict:
    while (m := await recv(ws))["type"] not in kinds:
        pass
    return m


async def open_session(ws: websockets.ClientConnection) -> str:
    assert (await recv(ws))["type"] == "hello"
    await ws.send(raw({"type": "open", "id": 1}))
    sid = (await until(ws, "opened"))["session"]
    await ws.send(raw({"type": "append", "session": sid, "text": "In the beginning"}))
    assert (await until(ws, "ack", "error"))["type"] == "ack"
    return sid


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.asyncio
async def test_a_dead_engine_thread_fails_what_ran_refuses_new_work_and_reports_unhealthy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with serve(ServerConfig()) as srv:
        runner = srv.engine.loop.runner
        real, armed = runner.execute, asyncio.Event()

        def execute(plan: Any) -> Any:
            if armed.is_set():
                raise EngineKilled("injected: the engine thread dies here")
            return real(plan)

        monkeypatch.setattr(runner, "execute", execute)
        a, b = await websockets.connect(srv.url + "/v1/stream"), await websockets.connect(srv.url + "/v1/stream")
        sid_a, sid_b = await open_session(a), await open_session(b)
        await a.send(raw({"type": "respond", "session": sid_a, "max_tokens": 1024}))
        assert (await until(a, "delta"))["type"] == "delta"  # a reply is streaming when the thread dies
        armed.set()
        end = await until(a, "done", "error")  # the reply ends, typed; it does not hang
        assert end.get("code") == "engine_failed" or end.get("reason") == "error", end
        await asyncio.wait_for(srv.server.engine_failed.wait(), 30)
        assert await asyncio.to_thread(health, srv.http) == (503, {"status": "failed"})  # off the server's loop
        thread = srv.engine.loop.thread
        assert thread is not None
        await asyncio.to_thread(thread.join, 30)  # its on_death callbacks ran on it just before it ends
        assert not thread.is_alive()
        await b.send(raw({"type": "append", "session": sid_b, "seq": 1, "text": " God"}))
        refused = await until(b, "error")
        assert refused["code"] == "engine_failed" and "restart" in refused["message"], refused
        assert srv.engine.loop.thread is thread  # refused, not run on a new thread with sessions half-stepped
        late = await websockets.connect(srv.url + "/v1/stream")
        with pytest.raises(websockets.ConnectionClosed) as info:
            await recv(late)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1011
        await a.close()
        await b.close()


# `streamserve serve` with the engine's step made to raise SystemExit once the trigger file exists
SERVE_WITH_FAULT = textwrap.dedent("""
    import os, sys
    from streamserve.engine.runner import Runner
    real = Runner.execute
    def execute(self, plan):
        if os.path.exists(os.environ["FAULT_TRIGGER"]):
            raise SystemExit("injected: the engine thread dies here")
        return real(self, plan)
    Runner.execute = execute
    from streamserve.cli import main
    main(["serve", "--port", "0", "--kv-memory", "64MiB", "--no-voice", "--no-vision"])
""")


@pytest.mark.asyncio
async def test_serve_exits_non_zero_when_its_engine_thread_dies(tmp_path: Path) -> None:
    trigger = tmp_path / "die"
    proc = subprocess.Popen([sys.executable, "-c", SERVE_WITH_FAULT], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "FAULT_TRIGGER": str(trigger)})
    try:
        assert proc.stderr is not None
        port = None

        def wait_ready() -> int | None:
            found = None
            for line in proc.stderr:  # type: ignore[union-attr]
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                found = int(m.group(1)) if m else found
                if "ready:" in line:
                    return found
            return None

        port = await asyncio.to_thread(wait_ready)
        assert port is not None, proc.poll()
        ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/stream")
        sid = await open_session(ws)
        trigger.touch()
        await ws.send(raw({"type": "append", "session": sid, "text": " God created"}))
        assert (await until(ws, "error"))["code"] == "engine_failed"
        with pytest.raises(websockets.ConnectionClosed):  # the server shuts down: told, then closed
            while True:
                await recv(ws)
        assert await asyncio.to_thread(proc.wait, 60) == 1
        rest = await asyncio.to_thread(proc.stderr.read)
        assert "the engine thread died" in rest and "shutting down" in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()  # only this test's own process, by its pid
            proc.wait(30)
