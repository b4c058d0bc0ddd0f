"""One server for voice/chat and robots: `--policy-model` serves a policy checkpoint on /v1/policy beside the main
model, each on an engine of its own. The policy endpoint's metadata and the native hello say which model each
serves, a robot loop and a native text session run at once, sessions of both are freed at the end, and a
--policy-model that is no policy fails the start with the reason."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest
import websockets
from helpers import make_checkpoint
from policy_fixture import POLICY, POLICY_CONFIG, connect, infer, obs
from serving import RunningServer

from streamserve.engine import Engine
from streamserve.server.app import Server, start

pytestmark = pytest.mark.asyncio


def chat_loader(folder: Path):  # type: ignore[no-untyped-def]
    return lambda: Engine.from_pretrained(folder, device="cpu", kv_memory="64MiB")


async def test_a_policy_beside_the_main_model(tmp_path: Path, policy_checkpoint: Path) -> None:
    main = tmp_path / "tiny-chat"
    make_checkpoint(main, "llama", seed=11)
    cfg = dataclasses.replace(POLICY_CONFIG, policy_model=str(policy_checkpoint))
    srv = await RunningServer.start(cfg, chat_loader(main))
    try:
        policy = srv.server.policy.service
        assert policy is not None and policy.engine is not srv.engine  # its own engine
        ws, meta = await connect(srv)
        assert meta["streamserve"]["model"] == policy.engine.name != srv.engine.name
        assert meta["action_horizon"] == POLICY["action_horizon"]
        native = await websockets.connect(f"{srv.url}/v1/stream")
        hello = msgpack.unpackb(await native.recv())
        assert hello["model"] == srv.engine.name and hello["policy_model"] == policy.engine.name
        # a robot and a text session at once, each on its own engine
        await native.send(msgpack.packb({"type": "open", "id": 1}))
        opened = msgpack.unpackb(await native.recv())
        assert opened["type"] == "opened", opened
        await native.send(msgpack.packb({"type": "append", "session": opened["session"], "seq": 0, "text": "hi"}))
        for i in range(4):
            out = await infer(ws, obs((0.1 * i, 0.0, 0.5), step=2 * i))
            assert out["actions"].shape == (POLICY["action_horizon"], POLICY["action_dims"]) and out["stale"] is False
            assert np.isfinite(out["actions"]).all()
        ack = msgpack.unpackb(await native.recv())
        assert ack["type"] == "ack" and ack["session"] == opened["session"], ack
        assert policy.registry.all() and srv.engine.stats()["sessions_open"] == 1  # the text session only
        async with aiohttp.ClientSession() as http, http.get(f"{srv.http}/metrics") as r:
            text = await r.text()
        # each engine's metrics, the policy's under streamserve_policy_*: its 4 observations counted there
        policy_tokens = re.search(r'^streamserve_policy_tokens_total\{kind="append"\} (\S+)$', text, re.M)
        assert r.status == 200 and policy_tokens and float(policy_tokens.group(1)) > 0, text[:2000]
        assert "streamserve_sessions_open 1.0" in text and "streamserve_policy_sessions_open 1.0" in text
        assert text.count("# TYPE streamserve_policy_step_seconds histogram") == 1
        await ws.close()
        await native.close()  # (its text session is kept for a resume, as the native protocol does)
        end = asyncio.get_running_loop().time() + 30
        while (policy.registry.all() or policy.engine.stats()["kv_pages_used"]) \
                and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.05)
        assert not policy.registry.all() and policy.engine.stats()["kv_pages_used"] == 0
    finally:
        await srv.stop()


async def test_a_policy_model_that_is_no_policy_fails_the_start(tmp_path: Path) -> None:
    main, other = tmp_path / "tiny-chat", tmp_path / "not-a-policy"
    make_checkpoint(main, "llama", seed=11)
    make_checkpoint(other, "llama", seed=12)
    server = Server(dataclasses.replace(POLICY_CONFIG, host="127.0.0.1", port=0, no_voice=True, no_vision=True,
                                        policy_model=str(other)), chat_loader(main))
    runner, _ = await start(server)
    try:
        await asyncio.wait_for(server.ready.wait(), 120)
        assert server.load_error is not None and "not a robot policy" in str(server.load_error)
    finally:
        await runner.cleanup()
