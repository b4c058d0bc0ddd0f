"""`GET /` and `GET /web/{path}`: the browser voice/video demo (clients/web/), path-safe.

Where the files are: the wheel installs clients/web/ as the package `streamserve.web` (package data); a source
checkout whose editable install predates that mapping still has them at `<checkout>/clients/web`. `web_root()`
tries the package first, then the checkout; `None` when neither is there (the routes then answer 404 with what to
install).

Path safety by construction: the files are listed ONCE when the handler is built (regular files only, under the
root, with a known type, no dot-files, no symlink leading outside the root) and read into memory (a few hundred
kB, capped). A request names a key of that table or gets 404: no request path ever reaches the file system, so
`..`, `%2e%2e`, absolute paths, backslashes, NUL bytes and symlinks cannot escape. Every answer carries
`X-Content-Type-Options: nosniff` and a Content-Security-Policy that lets the page load only its own scripts and
connect only to this server (no CDN, no third party). `Expect` is answered by server/transports/clients.py's handler.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from streamserve.server.transports.clients import expect

log = logging.getLogger("streamserve.server")

PACKAGE = "streamserve.web"
INDEX = "index.html"
MAX_TOTAL_BYTES = 8 << 20  # the demo is ~100 kB; a root holding more than this is not the demo (refused)
MAX_FILES = 256
TYPES = {  # suffix -> Content-Type: what the page uses; anything else under the root is not served
    ".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon", ".json": "application/json",
    ".webmanifest": "application/manifest+json",
}
# 'self' covers ws:/wss: to this host (CSP 3); media from the page's own streams; workers/worklets from 'self'
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "media-src 'self' blob: mediastream:; connect-src 'self'; worker-src 'self'; manifest-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"X-Content-Type-Options": "nosniff", "Content-Security-Policy": CSP, "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}  # revalidate (ETag): a new server version's page is never stale
MISSING = ("the browser demo's files are not installed (they ship in the streamserve wheel as streamserve/web; "
           "in a source checkout they are clients/web/)")


def web_root() -> Path | None:
    """The folder holding index.html: the installed `streamserve.web` package, else the source checkout's
    clients/web, else None."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    candidates = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    candidates.append(Path(__file__).resolve().parents[3] / "clients" / "web")  # <checkout>/clients/web
    return next((c for c in candidates if (c / INDEX).is_file()), None)


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str  # a strong validator: the content's hash, quoted


def collect(root: Path) -> dict[str, Asset]:
    """Every servable file under `root` -> {its path relative to root, '/'-separated: Asset}. ValueError when the
    root holds more than MAX_FILES servable files or MAX_TOTAL_BYTES."""
    root = root.resolve()
    assets: dict[str, Asset] = {}
    total = 0
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith((".", "_")) for part in rel.parts) or path.suffix not in TYPES:
            continue  # dot-files, __init__.py/__pycache__, sources and docs are never served
        real = path.resolve()
        if not real.is_file() or not real.is_relative_to(root):  # a link out of the root is not followed
            continue
        body = real.read_bytes()
        total += len(body)
        if len(assets) >= MAX_FILES or total > MAX_TOTAL_BYTES:
            raise ValueError(f"{root} holds more than {MAX_FILES} files or {MAX_TOTAL_BYTES} bytes: not the demo")
        digest = hashlib.sha256(body).hexdigest()[:32]
        assets[rel.as_posix()] = Asset(body, TYPES[path.suffix], f'"{digest}"')
    return assets


class StaticFiles:
    """The demo's files, served from memory. `index` answers `GET /`, `asset` answers `GET /web/{path}`."""

    def __init__(self, root: Path | None = None) -> None:
        root = root if root is not None else web_root()
        self.root = root
        self.assets = collect(root) if root is not None else {}
        if INDEX not in self.assets:
            log.warning("streamserve: %s", MISSING)

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/", self.index, expect_handler=expect),
                web.get("/web/{path:.+}", self.asset, expect_handler=expect)]

    async def index(self, request: web.Request) -> web.Response:
        return self.answer(request, INDEX)

    async def asset(self, request: web.Request) -> web.Response:
        return self.answer(request, request.match_info["path"])

    def answer(self, request: web.Request, name: str) -> web.Response:
        asset = self.assets.get(name)  # the table's keys are the only names there are: no path is ever opened
        if asset is None:
            text = MISSING if not self.assets else "no such file"
            return web.Response(status=404, text=text + "\n", headers={"X-Content-Type-Options": "nosniff"})
        headers = {**HEADERS, "ETag": asset.etag}
        if asset.etag in (t.strip() for t in request.headers.get("If-None-Match", "").split(",")):
            return web.Response(status=304, headers=headers)
        return web.Response(body=asset.body, headers={**headers, "Content-Type": asset.content_type})
