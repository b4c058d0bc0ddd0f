"""An SGLang server that dies mid-reply: the reply ends with a typed error, every session fails, nothing hangs, and
the server reports `failed` (and `run` would exit for a supervisor to restart it). The server here starts SGLang
itself (`--sglang-launch`), so the launch path is tested too; the test kills SGLang's whole process group."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest
from serving import serve
from sglang_support import CPU_ARGS, SGLANG_PYTHON

import streamserve_client as sc
from streamserve.config import EngineConfig, ServerConfig
from streamserve.engine.remote import SGLangEngine
from streamserve.server.service.backends import backend_loader

WAIT_S = 120.0  # generous: "nothing hangs" means everything ends, however slow the machine


@pytest.mark.asyncio
async def test_sglang_dying_mid_reply_fails_the_sessions_with_a_typed_error(checkpoint: Path) -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    cfg = EngineConfig(model=str(checkpoint), backend="sglang", sglang_launch=CPU_ARGS, sglang_python=SGLANG_PYTHON)
    async with serve(ServerConfig(), backend_loader(cfg)) as srv:
        engine = srv.engine
        assert isinstance(engine, SGLangEngine) and engine.launched is not None
        async with sc.connect(srv.url, reconnect=False) as client:
            a, b = await client.open_session(), await client.open_session()
            await a.append(token_ids=list(range(1, 40)))
            await b.append(token_ids=[5, 6, 7])
            reply = a.respond(max_tokens=1000, temperature=0.0)
            got = []

            async def read() -> None:
                async for d in reply:
                    got.extend(d.token_ids)
                    if len(got) == 2:  # mid-reply: the whole group (launcher, scheduler, detokenizer) dies
                        proc = engine.launched.proc
                        assert proc is not None
                        os.killpg(proc.pid, signal.SIGKILL)

            with pytest.raises(sc.EngineFailedError) as failed:
                await asyncio.wait_for(read(), WAIT_S)
            assert failed.value.code == "backend_unavailable"
            await asyncio.wait_for(srv.server.engine_failed.wait(), WAIT_S)
            with pytest.raises(sc.StreamserveClientError):  # the other session failed too: nothing waits for ever
                await asyncio.wait_for(b.append(token_ids=[8]), WAIT_S)
        assert engine.sessions() == []
        async with aiohttp.ClientSession() as http, http.get(srv.http + "/healthz") as r:
            assert r.status == 503 and (await r.json())["status"] == "failed"
        assert engine.launched.proc.poll() is not None
