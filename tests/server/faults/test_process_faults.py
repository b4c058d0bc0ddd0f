"""Fault injection on the `streamserve serve` process itself, run as an operator runs it (a subprocess on a
loopback port): SIGTERM while sessions are live and a reply streams, and a malformed checkpoint at start-up."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
import websockets
from helpers import make_checkpoint

SERVE = [sys.executable, "-m", "streamserve", "serve", "--port", "0", "--kv-memory", "64MiB", "--no-voice",
         "--no-vision"]


class Served:
    """`streamserve serve` in a subprocess: its port once it says it is ready, and its whole stderr."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*SERVE, *args], stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.port: int | None = None
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            self.port = int(m.group(1)) if m else self.port
            if "ready:" in line:
                self.ready.set()
        self.ready.set()  # the process ended: whoever waits for readiness must look at the exit code

    @property
    def stderr(self) -> str:
        self.reader.join(30)
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # only this test's own process, by its pid
            self.proc.wait(30)


def raw(frame: dict[str, Any]) -> bytes:
    return msgpack.packb(frame, use_bin_type=True)


async def recv(ws: websockets.ClientConnection) -> dict:
    return msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60))


@pytest.mark.asyncio
async def test_sigterm_mid_stream_tells_every_session_and_exits_cleanly() -> None:
    srv = Served()
    try:
        assert await asyncio.to_thread(srv.ready.wait, 180) and srv.proc.poll() is None, srv.stderr
        url = f"ws://127.0.0.1:{srv.port}/v1/stream"
        a, b = await websockets.connect(url), await websockets.connect(url)
        sids: dict[Any, list[str]] = {a: [], b: []}
        for ws, n in ((a, 2), (b, 1)):
            assert (await recv(ws))["type"] == "hello"
            for i in range(n):
                await ws.send(raw({"type": "open", "id": i}))
                m = await recv(ws)
                assert m["type"] == "opened", m
                sids[ws].append(m["session"])
                await ws.send(raw({"type": "append", "session": m["session"], "text": "In the beginning"}))
                assert (await recv(ws))["type"] == "ack"
        await a.send(raw({"type": "respond", "session": sids[a][0], "max_tokens": 1024}))
        assert (await recv(a))["type"] == "delta"  # the reply streams...
        srv.proc.send_signal(signal.SIGTERM)  # ...when the operator stops the server

        async def until_closed(ws: websockets.ClientConnection) -> tuple[list[dict], int | None]:
            got: list[dict] = []
            with pytest.raises(websockets.ConnectionClosed) as info:
                while True:
                    got.append(await recv(ws))
            return got, info.value.rcvd.code if info.value.rcvd is not None else None

        (got_a, code_a), (got_b, code_b) = await asyncio.gather(until_closed(a), until_closed(b))
        assert code_a == code_b == 1001  # going away, after every session of the connection was told
        for ws, got in ((a, got_a), (b, got_b)):
            told = {m["session"] for m in got if m["type"] == "closed" and m["reason"] == "shutdown"}
            assert told == set(sids[ws]), got
        # the reply ended with its session (its `closed` says so; a `done` may or may not come first): it did not
        # run to its end while the server waited
        assert not [m for m in got_a if m["type"] == "done" and m["reason"] == "length"], got_a
        assert await asyncio.to_thread(srv.proc.wait, 60) == 0
        assert "shutting down" in srv.stderr and "Traceback" not in srv.stderr
    finally:
        srv.kill()


def corrupt_config(folder: Path) -> None:
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": ')


def truncated_weights(folder: Path) -> None:
    weights = next(folder.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def wrong_shapes(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = config["hidden_size"] * 2  # every tensor on disk is now the wrong shape
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("damage", "named"), [
    (corrupt_config, "config.json"),
    (truncated_weights, ".safetensors"),
    (wrong_shapes, "shape"),
], ids=["corrupt-config", "truncated-safetensors", "wrong-shapes"])
def test_a_malformed_checkpoint_at_start_up_exits_non_zero_with_one_readable_error(tmp_path: Path, damage,
                                                                                   named: str) -> None:
    make_checkpoint(tmp_path, "llama")
    damage(tmp_path)
    out = subprocess.run([*SERVE, "--model", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr  # the operator reads what is wrong, not a stack
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("streamserve: the model failed to load: ") and named in last, out.stderr
