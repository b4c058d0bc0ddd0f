"""The demo's static files (streamserve/server/transports/static.py): what is served, with which headers, and that no
request path reaches a file outside the table built at start (traversal, encodings, symlinks, dot-files, sources)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import ClientSession, web
from yarl import URL

from streamserve.config import ServerConfig
from streamserve.errors import StreamserveError
from streamserve.server.app import Server
from streamserve.server.transports.static import CSP, INDEX, MISSING, StaticFiles, collect, web_root

ROOT = Path(__file__).resolve().parents[2]


def no_engine() -> None:
    raise StreamserveError("no model in this test: only the static routes are asked")


@pytest_asyncio.fixture
async def site() -> AsyncIterator[str]:
    """The real app (its origin guard, its error middleware, the demo's routes), no model."""
    server = Server(ServerConfig(host="127.0.0.1", port=0, no_voice=True, no_vision=True), no_engine)
    runner = web.AppRunner(server.app)
    await runner.setup()
    s = web.TCPSite(runner, "127.0.0.1", 0)
    await s.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def test_the_checkout_is_found_and_holds_the_page() -> None:
    root = web_root()
    assert root is not None and (root / INDEX).is_file()
    assets = collect(root)
    assert {"index.html", "app.js", "style.css", "worklets/capture.js", "worklets/player.js",
            "worklets/resampler.js"} <= set(assets)
    assert not [n for n in assets if n.endswith((".py", ".md")) or "__pycache__" in n]


@pytest.mark.asyncio
async def test_the_page_and_its_modules_are_served_with_safe_headers(site: str) -> None:
    async with ClientSession() as http:
        async with http.get(f"{site}/") as r:
            assert r.status == 200 and r.content_type == "text/html"
            page = await r.text()
            assert r.headers["Content-Security-Policy"] == CSP
            assert r.headers["X-Content-Type-Options"] == "nosniff"
            etag = r.headers["ETag"]
        assert '<script type="module" src="/web/app.js">' in page
        async with http.get(f"{site}/", headers={"If-None-Match": etag}) as r:
            assert r.status == 304 and await r.read() == b""
        async with http.get(f"{site}/web/worklets/capture.js") as r:
            assert r.status == 200 and r.content_type == "text/javascript"
            assert "registerProcessor" in await r.text()
        async with http.head(f"{site}/web/style.css") as r:
            assert r.status == 200 and r.content_type == "text/css"


@pytest.mark.asyncio
@pytest.mark.parametrize("path", [
    "/web/../pyproject.toml", "/web/%2e%2e/%2e%2e/pyproject.toml", "/web/..%2f..%2fpyproject.toml",
    "/web//etc/passwd", "/web/%2fetc%2fpasswd", "/web/__init__.py", "/web/README.md", "/web/worklets/../app.js",
    "/web/..\\..\\pyproject.toml", "/web/app.js%00.png", "/web/APP.JS", "/web/", "/index.html",
    "/web/streamserve/server/transports/static.py",
])
async def test_nothing_outside_the_table_is_served(site: str, path: str) -> None:
    async with ClientSession() as http, http.get(URL(f"{site}{path}", encoded=True)) as r:  # sent as written
        body = await r.read()
        assert r.status == 404, (path, r.status)
        assert b"[project]" not in body and b"root:" not in body and b"import" not in body


@pytest.mark.asyncio
async def test_a_foreign_origin_is_refused_before_the_page(site: str) -> None:
    async with ClientSession() as http:
        async with http.get(f"{site}/", headers={"Origin": "https://evil.example"}) as r:
            assert r.status == 403
        async with http.post(f"{site}/") as r:
            assert r.status == 405


def test_links_out_dot_files_and_unknown_types_are_left_out(tmp_path: Path) -> None:
    root = tmp_path / "web"
    (root / "sub").mkdir(parents=True)
    secret = tmp_path / "secret.js"
    secret.write_text("the key")
    (root / INDEX).write_text("<!doctype html>")
    (root / "sub" / "ok.js").write_text("export {};")
    (root / ".env.js").write_text("hidden")
    (root / "notes.txt").write_text("not a web type")
    (root / "inside.js").symlink_to(root / "sub" / "ok.js")
    (root / "outside.js").symlink_to(secret)
    os.symlink(tmp_path, root / "up")  # a folder link out of the root
    assets = collect(root)
    assert set(assets) == {INDEX, "sub/ok.js", "inside.js"}
    assert assets["sub/ok.js"].content_type.startswith("text/javascript")


def test_a_root_that_is_not_the_demo_is_refused(tmp_path: Path) -> None:
    (tmp_path / INDEX).write_bytes(b"x")
    (tmp_path / "big.png").write_bytes(b"\0" * (9 << 20))
    with pytest.raises(ValueError, match="not the demo"):
        collect(tmp_path)


@pytest.mark.asyncio
async def test_without_the_files_the_routes_say_what_is_missing(tmp_path: Path) -> None:
    files = StaticFiles(tmp_path)  # an empty root: no index.html
    app = web.Application()
    app.add_routes(files.routes())
    runner = web.AppRunner(app)
    await runner.setup()
    s = web.TCPSite(runner, "127.0.0.1", 0)
    await s.start()
    try:
        async with ClientSession() as http, http.get(f"http://127.0.0.1:{runner.addresses[0][1]}/") as r:
            assert r.status == 404 and MISSING in await r.text()
    finally:
        await runner.cleanup()
