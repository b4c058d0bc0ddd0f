"""`--sglang-launch`: an SGLang server started as a child process of streamserve, on loopback, for one checkpoint.

The child runs `PYTHON -m sglang.launch_server --model-path CKPT --host 127.0.0.1 --port FREE
--enable-streaming-session --enable-metrics ARGS` in a process group of its own (SGLang starts a scheduler and a
detokenizer process beside its launcher: stopping the group stops them all). Its output goes to streamserve's log,
line by line. `start` waits for `GET /health` to answer 200, saying every 15 s that it still waits; a child that
exits first is a `ModelLoadError` quoting its last lines. A child that exits later calls `on_exit` (the backend
then dies, and the server exits for its supervisor to restart it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path

from streamserve.errors import ModelLoadError

log = logging.getLogger("streamserve.engine")
START_TIMEOUT_S = 900.0  # a large model on many GPUs loads for minutes
PROGRESS_EVERY_S = 15.0
STOP_GRACE_S = 20.0
# flags streamserve sets itself: the user's launch arguments may not change where SGLang listens or what it serves
RESERVED = ("--model-path", "--model", "--host", "--port", "--enable-streaming-session")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedSGLang:
    def __init__(self, model: Path, args: str, python: str) -> None:
        extra = shlex.split(args)
        bad = [a for a in extra if a.split("=", 1)[0] in RESERVED]
        if bad:
            raise ModelLoadError(f"--sglang-launch may not set {', '.join(bad)}: streamserve sets the model, the "
                                 "loopback address and port, and streaming sessions itself")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
                    "--port", str(self.port), "--enable-streaming-session", "--enable-metrics", *extra]
        self.tail: deque[str] = deque(maxlen=20)  # the child's last lines, for the error when it fails
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def start(self, on_exit: Callable[[int], None]) -> None:
        log.info("streamserve: starting SGLang: %s", shlex.join(self.cmd))
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            raise ModelLoadError(f"could not start SGLang ({self.cmd[0]}): {e}; install it or name its Python with "
                                 "--sglang-python") from None
        threading.Thread(target=self._pump, name="streamserve-sglang-log", daemon=True).start()
        t0 = last = time.monotonic()
        while not self._healthy():
            code = self.proc.poll()
            if code is not None:
                raise ModelLoadError(f"SGLang exited with status {code} before it was ready; its last lines:\n"
                                     + "\n".join(self.tail))
            now = time.monotonic()
            if now - t0 > START_TIMEOUT_S:
                self.stop()
                raise ModelLoadError(f"SGLang was not ready after {START_TIMEOUT_S:.0f} s; its last lines:\n"
                                     + "\n".join(self.tail))
            if now - last >= PROGRESS_EVERY_S:
                log.info("streamserve: waiting for SGLang to load the model (%.0f s)", now - t0)
                last = now
            time.sleep(0.5)
        log.info("streamserve: SGLang is ready at %s after %.0f s", self.url, time.monotonic() - t0)
        threading.Thread(target=self._watch, args=(on_exit,), name="streamserve-sglang-watch", daemon=True).start()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            log.info("sglang: %s", line)

    def _watch(self, on_exit: Callable[[int], None]) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        if not self.stopping:
            on_exit(code)

    def stop(self) -> None:
        """SIGTERM to the child's process group (SGLang drains), SIGKILL after a grace period."""
        self.stopping = True
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        except ProcessLookupError:
            pass
        with contextlib.suppress(ProcessLookupError):  # what of its group outlived the launcher (stuck children)
            os.killpg(p.pid, signal.SIGKILL)
