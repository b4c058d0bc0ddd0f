"""Test helpers of the policy endpoint: raw openpi frames over `websockets`, and what a server holds."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import websockets
from helpers import make_checkpoint
from serving import RunningServer

from streamserve.config import ServerConfig
from streamserve.engine import Engine
from streamserve.robot.projector import save_state_projector
from streamserve.server.adapters.policy import wire

STATE_KEY = "observation/state"
# ids: 0..256 the byte tokenizer's, 257 <obs>, 258 <act>, 259 <task>, 260..275 state bins, 276..291 action bins (< 300)
POLICY = {"format": 1, "state_key": "observation/state", "state_low": [-1.0, -1.0, -2.0], "state_high": [1.0, 1.0, 2.0],
          "state_bins": 16, "state_token_offset": 260, "action_dims": 2, "action_horizon": 4,
          "action_low": [-1.0, -0.5], "action_high": [1.0, 0.5], "action_bins": 16, "action_token_offset": 276,
          "obs_token": 257, "act_token": 258, "task_token": 259, "prompt_key": "prompt", "default_prompt": "reach",
          "window": 96, "sinks": 4, "control_hz": 50.0}
POLICY_CONFIG = ServerConfig(policy_port=0, messages_per_second=1000.0, max_frame_bytes=1 << 16)


def loader(folder: Path) -> Callable[[], Engine]:
    return lambda: Engine.from_pretrained(folder, device="cpu", kv_memory="64MiB")


async def without_drafts(folder: Path, run: Callable[[RunningServer], Awaitable[Any]]) -> Any:
    """`run` against a server of its own on `folder` started with --no-policy-draft (every action token decoded in
    a forward of its own): the reference drafted replies must equal."""
    srv = await RunningServer.start(dataclasses.replace(POLICY_CONFIG, no_policy_draft=True), loader(folder))
    try:
        return await run(srv)
    finally:
        await srv.stop()


def obs(state: Any = (0.1, -0.2, 0.5), **extra: Any) -> dict[str, Any]:
    return {STATE_KEY: np.asarray(state, dtype=np.float32), **extra}


def policy_url(srv: RunningServer, port: bool = False) -> str:
    return f"ws://127.0.0.1:{srv.server.policy.port}" if port else f"{srv.url}/v1/policy"


async def connect(srv: RunningServer, port: bool = False, headers: dict[str, str] | None = None,
                  ) -> tuple[websockets.ClientConnection, dict[str, Any]]:
    """-> the connection and the metadata the server sent first."""
    ws = await websockets.connect(policy_url(srv, port), additional_headers=headers, max_size=None)
    return ws, wire.unpackb(await asyncio.wait_for(ws.recv(), 30), 1 << 20)


async def infer(ws: websockets.ClientConnection, observation: dict[str, Any]) -> dict[str, Any]:
    await ws.send(wire.packb(observation))
    return await reply(ws)


async def reply(ws: websockets.ClientConnection) -> dict[str, Any]:
    frame = await asyncio.wait_for(ws.recv(), 60)
    assert isinstance(frame, bytes), frame
    return wire.unpackb(frame, 1 << 20)


async def expect_error(ws: websockets.ClientConnection, frame: bytes | str | None = None) -> str:
    """Send `frame` (if any); the server must answer with one text frame, then close 1011. -> the text."""
    if frame is not None:
        await ws.send(frame)
    text = await asyncio.wait_for(ws.recv(), 60)
    assert isinstance(text, str), text
    try:
        extra = await asyncio.wait_for(ws.recv(), 60)
        raise AssertionError(f"a frame after the error: {extra!r:.80}")
    except websockets.ConnectionClosed as e:
        assert e.rcvd is not None and e.rcvd.code == 1011, e
    return text


def raw_array(data: bytes, dtype: str, shape: list[int]) -> dict[bytes, Any]:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def pack_raw(m: dict[Any, Any]) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def sessions(srv: RunningServer) -> list[Any]:
    return [e.session for e in srv.server.service.registry.all() if not e.session.closed]


async def freed(srv: RunningServer) -> None:
    """Wait (bounded) until the server holds no session and no KV page; assert it."""
    end = time.monotonic() + 30
    while (sessions(srv) or srv.engine.stats()["kv_pages_used"] or srv.engine.stats()["sessions_open"]) \
            and time.monotonic() < end:
        await asyncio.sleep(0.05)
    assert not sessions(srv), "a session outlived its connection"
    assert srv.engine.stats()["kv_pages_used"] == 0 and srv.engine.stats()["sessions_open"] == 0, srv.engine.stats()


def policy_checkpoint_at(folder: Path, seed: int = 3, **policy: Any) -> Path:
    """A tiny random Llama checkpoint with POLICY (updated by `policy`) as its policy.json."""
    make_checkpoint(folder, "llama", seed=seed)
    (folder / "policy.json").write_text(json.dumps({**POLICY, **policy}))
    return folder


def projector_checkpoint(folder: Path, seed: int = 3) -> Path:
    """A tiny policy whose state goes in through a random state_projector.safetensors ([hidden, 3], [hidden]),
    scaled like the model's token embeddings so that the state moves the reply."""
    policy_checkpoint_at(folder, seed, state_encoding="projector")
    hidden = json.loads((folder / "config.json").read_text())["hidden_size"]
    rng = np.random.default_rng(seed)
    save_state_projector(folder, rng.normal(0.0, 0.5, (hidden, 3)), rng.normal(0.0, 0.05, hidden))
    return folder
