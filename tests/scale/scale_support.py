"""Scale-out test support: real `streamserve serve` instances as subprocesses and Debian's nginx in front of them, on
loopback, started by the tests as this user and ended by pid.

nginx is the system's (`apt-get install nginx-light`; CI installs it in .ci/run); the tests that run it skip
without it, saying so.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from streamserve.tools.nginx import STANDALONE_DIRS, ProxyOptions, render

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
needs_nginx = pytest.mark.skipif(NGINX is None, reason="needs Debian's nginx: apt-get install nginx-light")
START_S = 120.0  # a model load on a busy 2-core CI machine; a bound on waiting, never an assertion on time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Instance:
    """One `streamserve serve` subprocess; its stderr is drained by a thread (a full pipe would block it)."""

    proc: subprocess.Popen[str]
    port: int
    log: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def kill(self) -> None:
        """SIGKILL, as a crashed machine: no goodbye to its clients."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def start_instance(*flags: str) -> Instance:
    """`streamserve serve` on a free loopback port (the default model, no voice or vision models), ready to serve;
    it trusts X-Forwarded-For from 127.0.0.1 (the nginx of these tests)."""
    cmd = [sys.executable, "-m", "streamserve", "serve", "--port", "0", "--no-voice", "--no-vision",
           "--kv-memory", "128MiB", "--trusted-proxies", "127.0.0.1", *flags]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stderr is not None
    log: list[str] = []
    port: int | None = None
    ready = threading.Event()

    def drain() -> None:
        nonlocal port
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else port
            if "ready:" in line:
                ready.set()
        ready.set()  # ended: the caller sees the exit

    threading.Thread(target=drain, daemon=True).start()
    if not ready.wait(START_S) or proc.poll() is not None or port is None:
        if proc.poll() is None:
            proc.kill()
        raise AssertionError("streamserve serve did not start:\n" + "".join(log))
    return Instance(proc, port, log)


@dataclass
class Nginx:
    proc: subprocess.Popen[bytes]
    port: int
    prefix: Path

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def error_log(self) -> str:
        path = self.prefix / "logs" / "error.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # nginx's fast shutdown; the master ends its workers
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def nginx_command(prefix: Path, conf: str = "nginx.conf") -> list[str]:
    """nginx in the foreground under `prefix`. Run by root (a CI container), its workers would switch to the
    compiled-in `nobody`, who cannot enter pytest's private temp folder: they stay this user instead."""
    assert NGINX is not None
    directives = "daemon off;" + (" user root;" if os.geteuid() == 0 else "")
    return [NGINX, "-p", str(prefix), "-c", conf, "-g", directives]


def start_nginx(prefix: Path, upstreams: tuple[str, ...], **options: object) -> Nginx:
    """nginx from `streamserve proxy-config --standalone`'s text, listening on a free loopback port."""
    port = free_port()
    for name in STANDALONE_DIRS:
        (prefix / name).mkdir(parents=True, exist_ok=True)
    text = render(ProxyOptions(upstreams=upstreams, listen=f"127.0.0.1:{port}", standalone=True,
                               **options))  # type: ignore[arg-type]
    (prefix / "nginx.conf").write_text(text)
    proc = subprocess.Popen(nginx_command(prefix), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    nginx = Nginx(proc, port, prefix)
    deadline = time.monotonic() + START_S
    while True:  # listening once a connection is accepted
        if proc.poll() is not None:
            raise AssertionError(f"nginx exited ({proc.returncode}):\n{nginx.error_log()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return nginx
        if time.monotonic() > deadline:
            nginx.stop()
            raise AssertionError(f"nginx did not listen on {port}:\n{nginx.error_log()}")
        time.sleep(0.05)


@contextlib.contextmanager
def instances(count: int, *flags: str) -> Iterator[list[Instance]]:
    """`count` instances; instance i reports max_reply_tokens 1000 + i in its hello, so a client can tell which
    one it reached (replies in these tests are far shorter)."""
    started: list[Instance] = []
    try:
        for i in range(count):
            started.append(start_instance("--max-reply-tokens", str(1000 + i), *flags))
        yield started
    finally:
        for inst in started:
            inst.stop()


def which(hello: dict[str, object]) -> int:
    """The index of the instance that sent this hello (see `instances`)."""
    limits = hello["limits"]
    assert isinstance(limits, dict)
    return int(limits["max_reply_tokens"]) - 1000
