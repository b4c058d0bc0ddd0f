"""The SGLang backend against a real SGLang: streamserve's sessions over SGLang's streaming sessions give the same
greedy tokens as streamserve's own engine on the same checkpoint, reuse SGLang's cache turn after turn, keep what a
cancelled reply produced, rewind, refuse what SGLang cannot do with typed errors, and free SGLang's sessions.
(The death of SGLang mid-reply: test_backend_death.py.)"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from serving import RunningServer

import streamserve_client as sc
from streamserve.config import EngineConfig, ServerConfig
from streamserve.engine import Engine
from streamserve.engine.remote import RemoteSession, SGLangEngine
from streamserve.engine.remote.launch import LaunchedSGLang
from streamserve.errors import NotSupportedError
from streamserve.server.service.backends import backend_loader

pytestmark = pytest.mark.asyncio(loop_scope="module")
TURNS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
         [40, 41, 42], [77] * 17, [1], list(range(100, 160)))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def on_sglang(sglang: LaunchedSGLang, checkpoint: Path) -> AsyncIterator[RunningServer]:
    cfg = EngineConfig(model=str(checkpoint), backend="sglang", sglang_url=sglang.url)
    srv = await RunningServer.start(ServerConfig(), backend_loader(cfg))
    yield srv
    await srv.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def on_engine(checkpoint: Path) -> AsyncIterator[RunningServer]:
    srv = await RunningServer.start(ServerConfig(), lambda: Engine.from_pretrained(checkpoint, device="cpu",
                                                                                  kv_memory="64MiB"))
    yield srv
    await srv.stop()


async def conversation(url: str, turns: tuple[list[int], ...]) -> list[list[int]]:
    """Each turn appended as token ids, then a greedy reply of up to 12 tokens; -> the replies."""
    async with sc.connect(url) as client:
        s = await client.open_session()
        replies = []
        for ids in turns:
            await s.append(token_ids=ids)
            r = s.respond(max_tokens=12, temperature=0.0)
            await r.wait()
            replies.append(r.token_ids)
        return replies


async def test_greedy_tokens_through_the_server_equal_the_engine(on_sglang: RunningServer,
                                                                  on_engine: RunningServer) -> None:
    mine = await conversation(on_sglang.url, TURNS)
    assert mine == await conversation(on_engine.url, TURNS)
    assert all(mine)


async def test_cache_reuse_per_request(on_sglang: RunningServer) -> None:
    engine = on_sglang.engine
    assert isinstance(engine, SGLangEngine)
    async with sc.connect(on_sglang.url) as client:
        s = await client.open_session()
        remote = engine.get_session(s.id)
        assert isinstance(remote, RemoteSession)
        for i, ids in enumerate(TURNS):
            before = len(remote.token_ids)
            await s.append(token_ids=ids)
            prompt, cached = remote.cache
            assert prompt == before + len(ids)
            # SGLang ran only this chunk (and the previous last token again): the session's KV stayed there
            assert cached == (max(before - 1, 0) if i else 0)
            r = s.respond(max_tokens=6, temperature=0.0)
            await r.wait()
            prompt, cached = remote.cache
            assert (prompt, cached) == (len(remote.token_ids) - len(r.token_ids), len(remote.token_ids)
                                        - len(r.token_ids) - 1)


async def test_chat_session_replies_equal_the_engine(on_sglang: RunningServer, on_engine: RunningServer) -> None:
    async def chat(url: str) -> list[str]:
        async with sc.connect(url) as client:
            s = await client.open_session(chat=True)
            out = []
            for text in ("Hello there", "And then?"):
                await s.append(message={"role": "user", "content": text})
                r = s.respond(max_tokens=10, temperature=0.0)
                await r.wait()
                out.append(r.text)
            return out
    assert await chat(on_sglang.url) == await chat(on_engine.url)


async def test_cancel_keeps_what_was_produced_and_rewind_rebuilds(on_sglang: RunningServer,
                                                                  on_engine: RunningServer) -> None:
    remote_engine, local = on_sglang.engine, on_engine.engine
    s = await asyncio.to_thread(remote_engine.open_session)
    ref = await asyncio.to_thread(local.open_session)
    try:
        await asyncio.to_thread(s.append, token_ids=TURNS[0])
        st = s.stream(max_tokens=200, stop_token_ids=())
        got = 0
        async for d in st:
            got += len(d.token_ids)
            if got >= 3:
                st.cancel()
        assert st.finish_reason == "cancelled" and 3 <= len(st.token_ids) < 200
        assert list(s.token_ids) == TURNS[0] + st.token_ids  # what the cancelled reply made stays
        await asyncio.to_thread(ref.append, token_ids=list(s.token_ids))
        for extra in ([7, 8], [9]):
            await asyncio.to_thread(s.append, token_ids=extra)
            await asyncio.to_thread(ref.append, token_ids=extra)
            assert await asyncio.to_thread(s.generate, 8, stop_token_ids=()) == \
                await asyncio.to_thread(ref.generate, 8, stop_token_ids=())
        to = len(s.token_ids) - 11
        assert await asyncio.to_thread(s.rewind, to=to) == to == await asyncio.to_thread(ref.rewind, to=to)
        assert s.revisions == 1 and s.backend_id != s.id
        await asyncio.to_thread(s.append, token_ids=[3, 4])
        await asyncio.to_thread(ref.append, token_ids=[3, 4])
        assert await asyncio.to_thread(s.generate, 8, stop_token_ids=()) == \
            await asyncio.to_thread(ref.generate, 8, stop_token_ids=())
    finally:
        await asyncio.to_thread(s.close)
        await asyncio.to_thread(ref.close)


async def test_what_sglang_cannot_do_is_refused_with_typed_errors(on_sglang: RunningServer) -> None:
    async with sc.connect(on_sglang.url) as client:
        assert client.hello["capabilities"] == ["rewind"]
        with pytest.raises(sc.NotSupportedError):
            await client.open_session(window=64)
        with pytest.raises(sc.NotSupportedError):
            await client.open_session(drafter="ngram")
        s = await client.open_session()  # the connection goes on
        await s.append(text="fine")
    remote = await asyncio.to_thread(on_sglang.engine.open_session)
    try:
        with pytest.raises(NotSupportedError):
            remote.snapshot()
        with pytest.raises(NotSupportedError):
            remote.stream(stop_token_ids=[3])  # without the EOS ids SGLang would stop at anyway
        with pytest.raises(NotSupportedError):
            remote.submit_chunk(embeds=object())
    finally:
        await asyncio.to_thread(remote.close)


async def test_a_closed_session_is_gone_from_sglang(on_sglang: RunningServer, sglang: LaunchedSGLang) -> None:
    async with sc.connect(on_sglang.url) as client:
        s = await client.open_session()
        await s.append(token_ids=[1, 2, 3])
        sid = s.id
        assert generate_status(sglang.url, sid) == 200
        await s.close()
    for _ in range(100):  # the close reaches SGLang from the backend's thread
        if generate_status(sglang.url, sid) == 400:
            break
        await asyncio.sleep(0.1)
    assert generate_status(sglang.url, sid) == 400
    assert on_sglang.engine.stats()["sessions_open"] == 0


def generate_status(url: str, session_id: str) -> int:
    body = json.dumps({"input_ids": [1], "session_params": {"id": session_id},
                       "sampling_params": {"max_new_tokens": 0}}).encode()
    req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def test_openai_realtime_sdk_works_unchanged(on_sglang: RunningServer, on_engine: RunningServer) -> None:
    """/v1/realtime on the SGLang backend: the openai SDK's text conversation, the same words as the engine's."""
    from openai import AsyncOpenAI

    async def talk(http: str) -> list[str]:
        client = AsyncOpenAI(api_key="unused", base_url=f"{http}/v1")
        out = []
        async with client.realtime.connect(model="any") as conn:
            assert (await conn.recv()).type == "session.created"
            for text in ("In the beginning", "And then"):
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": text}]})
                await conn.response.create(response={"max_output_tokens": 8})
                async for ev in conn:
                    if ev.type == "error":
                        raise AssertionError(ev.error)
                    if ev.type == "response.done":
                        assert ev.response.status in ("completed", "incomplete"), ev.response
                        out.append(ev.response.output[0].content[0].text)
                        break
        return out
    assert await talk(on_sglang.http) == await talk(on_engine.http)


async def test_metrics_show_the_backend_and_sglangs_own(on_sglang: RunningServer) -> None:
    import aiohttp

    await conversation(on_sglang.url, TURNS[:1])
    async with aiohttp.ClientSession() as http:
        for _ in range(60):  # SGLang's are scraped every few seconds
            async with http.get(on_sglang.http + "/metrics") as r:
                text = await r.text()
            if "sglang:" in text:
                break
            await asyncio.sleep(0.5)
    assert 'streamserve_tokens_total{kind="decode"}' in text and "streamserve_connections" in text
    assert "sglang:" in text


async def test_a_drain_on_the_sglang_backend_closes_its_sessions_and_stores_nothing(
        sglang: LaunchedSGLang, checkpoint: Path, tmp_path: Path) -> None:
    """SGLang's sessions cannot be snapshot: a drain closes them as a shutdown does (the client hears `closed`)."""
    import aiohttp
    from serving import serve

    cfg = EngineConfig(model=str(checkpoint), backend="sglang", sglang_url=sglang.url)
    async with serve(ServerConfig(snapshot_store=str(tmp_path)), backend_loader(cfg)) as srv:
        async with sc.connect(srv.url, reconnect=False) as client:
            s = await client.open_session()
            await s.append(token_ids=[1, 2, 3])
            async with aiohttp.ClientSession() as http, http.post(srv.http + "/admin/drain") as r:
                assert r.status == 202, await r.text()
            await asyncio.wait_for(srv.server.drained.wait(), 60)
        assert [p for p in tmp_path.iterdir() if not p.name.startswith(".")] == []
        engine = srv.engine
    assert engine.sessions() == []  # closed with the server


def test_the_sglang_backend_benchmark_runs_and_prints_json_last() -> None:
    import subprocess
    import sys

    from sglang_support import SGLANG_PYTHON

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "sglang_backend.py"
    out = subprocess.run([sys.executable, str(script), "--sglang-python", str(SGLANG_PYTHON), "--sessions", "2",
                          "--turns", "3", "--chunks", "3"], stdout=subprocess.PIPE, text=True, timeout=600, check=True)
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["greedy_outputs_equal"] is True and line["sglang_workload"]["turns_per_s"] > 0
