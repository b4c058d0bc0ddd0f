"""The browser tests' machinery: Debian's chromium driven by Playwright (never a downloaded browser), fake media
devices from generated files, and a network namespace holding the server and the browser (loopback only).

    with Namespace.create() as ns:                         # `ip netns add`, lo up; deleted at the end
        with DemoServer.start(ns, ["--max-reply-tokens", "64"]) as srv, Browser.launch(tmp, wav, y4m, ns) as b:
            page = b.new_page(srv.url + "/?transport=ws")

Skips (naming what to install) when chromium or the playwright package is missing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import wave
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("STREAMSERVE_CHROMIUM", "/usr/bin/chromium")
ALIAS = "127.0.0.2"  # on lo inside the namespace: the server's ICE host candidate
INSTALL = "apt-get install -y chromium && pip install playwright (never `playwright install`)"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--use-fake-ui-for-media-stream",
         "--use-fake-device-for-media-stream", "--allow-loopback-in-peer-connection",
         "--autoplay-policy=user-gesture-required", "--mute-audio"]


def chromium() -> str:
    """The chromium binary, or a skip naming what to install."""
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no chromium at {CHROMIUM}: {INSTALL}")
    pytest.importorskip("playwright.sync_api", reason=f"the playwright package is missing: {INSTALL}")
    return CHROMIUM


def write_wav(path: Path, audio: np.ndarray, rate: int) -> Path:
    """float32 mono [n] in -1..1 -> a 16-bit PCM WAV file (what Chromium's fake microphone reads, looping it)."""
    pcm = (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


def write_y4m(path: Path, frames: list[np.ndarray], fps: int = 10) -> Path:
    """RGB frames [H, W, 3] uint8 (H, W even) -> a YUV4MPEG2 4:2:0 file (Chromium's fake camera loops it)."""
    h, w, _ = frames[0].shape
    with path.open("wb") as f:
        f.write(f"YUV4MPEG2 W{w} H{h} F{fps}:1 Ip A1:1 C420jpeg\n".encode())
        for rgb in frames:
            r, g, b = (rgb[..., i].astype(np.float32) for i in range(3))
            y = 0.299 * r + 0.587 * g + 0.114 * b  # BT.601 full range (JFIF), as C420jpeg says
            u = (b - y) * 0.564 + 128
            v = (r - y) * 0.713 + 128
            sub = (lambda c: c.reshape(h // 2, 2, w // 2, 2).mean(axis=(1, 3)))  # noqa: E731  2x2 -> 1
            f.write(b"FRAME\n")
            for plane in (y, sub(u), sub(v)):
                f.write(np.clip(np.rint(plane), 0, 255).astype(np.uint8).tobytes())
    return path


def camera_frames(h: int = 240, w: int = 320, n: int = 10) -> list[np.ndarray]:
    """A black-and-white checkerboard, drifting a pixel a frame: the server's ImageNet classifier names it
    ("crossword puzzle", p ~ 0.4, above the note threshold), so the camera has something to report."""
    yy, xx = np.mgrid[0:h, 0:w]
    return [np.repeat(((((yy // 30) + ((xx + i) // 30)) % 2) * 255).astype(np.uint8)[..., None], 3, axis=-1)
            for i in range(n)]


@dataclass
class Namespace:
    """A network namespace with only loopback, up (127.0.0.1 and the alias 127.0.0.2): nothing run inside it can
    reach another address."""

    name: str
    enabled: bool = True

    @classmethod
    @contextlib.contextmanager
    def create(cls, required: bool = True) -> Iterator[Namespace]:
        """`required`: skip when one cannot be made (not root); else run in the host's namespace instead."""
        name = f"ssweb-{os.getpid()}-{secrets.token_hex(3)}"
        made = shutil.which("ip") is not None and subprocess.run(
            ["ip", "netns", "add", name], capture_output=True).returncode == 0
        if not made:
            if required:
                pytest.skip("cannot create a network namespace (`ip netns add` needs root and iproute2): the WebRTC "
                            "test keeps ICE on loopback only inside one")
            yield cls(name, enabled=False)
            return
        try:
            subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
            # aiortc (aioice) never offers 127.0.0.1 as an ICE candidate: a loopback alias gives it one
            subprocess.run(["ip", "netns", "exec", name, "ip", "addr", "add", f"{ALIAS}/8", "dev", "lo"], check=True)
            yield cls(name)
        finally:
            subprocess.run(["ip", "netns", "del", name], check=False)

    def wrap(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv] if self.enabled else argv


@dataclass
class DemoServer:
    """`streamserve serve` (it serves the demo at /) as a subprocess in the namespace."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    lines: list[str] = field(default_factory=list)

    @classmethod
    @contextlib.contextmanager
    def start(cls, ns: Namespace, flags: list[str], log: Path, port: int = 8000,
              env: dict[str, str] | None = None) -> Iterator[DemoServer]:
        if not ns.enabled:  # in the host's namespace: a free port
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        argv = ns.wrap([sys.executable, "-m", "streamserve", "serve", "--host", "127.0.0.1",
                        "--port", str(port), *flags])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        srv = cls(proc, port, log)
        try:
            srv.wait_ready()
            yield srv
        finally:
            srv.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, ceiling_s: float = 900.0) -> None:
        """Until the server announces `ready` (the model and voice loaded); its exit, or no `ready` within the
        ceiling (a hung load, never a timing check), is a failure with its log."""
        import time

        give_up = time.monotonic() + ceiling_s
        while time.monotonic() < give_up:
            text = self.log.read_text(errors="replace")
            if "streamserve: ready:" in text:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{text[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"the server did not get ready in {ceiling_s:.0f} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: `ip netns exec` and the server under it
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@dataclass
class Browser:
    """A headless Debian chromium with fake media devices, driven through Playwright's pipe."""

    playwright: Any
    context: Any
    console: list[str] = field(default_factory=list)

    @classmethod
    @contextlib.contextmanager
    def launch(cls, tmp: Path, ns: Namespace, wav: Path | None = None, y4m: Path | None = None,
               viewport: dict[str, int] | None = None, allow_media: bool = True) -> Iterator[Browser]:
        """`allow_media` False: the browser denies the page the microphone (no fake permission prompt)."""
        exe = chromium()
        from playwright.sync_api import sync_playwright

        if ns.enabled:  # the browser runs inside the namespace: a wrapper Playwright starts in its place
            wrapper = tmp / "chromium-in-netns"
            wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {ns.name} {exe} "$@"\n')
            wrapper.chmod(0o755)
            exe = str(wrapper)
        profile = Path(tempfile.mkdtemp(prefix="profile-", dir=tmp))  # a fresh --user-data-dir (Playwright passes it)
        args = [f for f in FLAGS if allow_media or f != "--use-fake-ui-for-media-stream"]
        if wav is not None:
            args.append(f"--use-file-for-fake-audio-capture={wav}")
        if y4m is not None:
            args.append(f"--use-file-for-fake-video-capture={y4m}")
        with sync_playwright() as p:
            context = p.chromium.launch_persistent_context(
                str(profile), executable_path=exe, args=args, headless=True,
                viewport=viewport or {"width": 1280, "height": 900})
            try:
                yield cls(p, context)
            finally:
                context.close()

    def new_page(self, url: str) -> Any:
        page = self.context.new_page()
        page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))
        page.goto(url)
        page.wait_for_function("() => window.__demo && window.__demo.ready")
        return page


def question_wav(path: Path, text: str, rate: int = 48000, lead_s: float = 0.6, tail_s: float = 9.0) -> Path:
    """`text` spoken by the Piper voice with silence around it: Chromium's fake microphone loops the file, so the
    question comes again every len(file) seconds (the second time while the reply plays: a barge-in)."""
    from voice_assets import speech

    silence = (np.zeros(int(rate * lead_s), np.float32), np.zeros(int(rate * tail_s), np.float32))
    return write_wav(path, np.concatenate([silence[0], speech(text, rate=rate), silence[1]]), rate)


def artifacts(name: str) -> Path:
    """Where a test's screenshots go: $STREAMSERVE_ARTIFACTS or build/artifacts, per test."""
    root = Path(os.environ.get("STREAMSERVE_ARTIFACTS", ROOT / "build" / "artifacts")) / "web" / name
    root.mkdir(parents=True, exist_ok=True)
    return root


def demo(page: Any, expression: str) -> Any:
    """A value of the page's test hook, e.g. demo(page, "latencies")."""
    return page.evaluate(f"window.__demo.{expression}")
