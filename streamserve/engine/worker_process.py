"""The compile worker as seen from the engine: one child process at a time (engine/compile_worker.py), run for a
step shape's compile request, stopped while the engine has work. engine/compiled.py's compile thread calls `run`.

Why stopped: SCHED_IDLE (the worker's priority) gives the engine every CPU cycle it asks for, but not the caches and
the memory's read rate, which the compiler's C++ builds and kernel timings share with the engine's decode: a 2-core
real-time loop still missed a fifth of its 200 ms deadlines beside a SCHED_IDLE worker
(benchmarks/compile_background.py). So the worker's process group (the C++ compilers too) gets SIGSTOP when the
engine gets work and SIGCONT once it has had none for RESUME_AFTER_S (`Quiet`, engine/loop.py, tells both at once);
an engine that never rests lets it run GRANT_S after each STARVE_S, so that a compile still ends.
Why not at once: a client appending back to back leaves the engine idle a fraction of a millisecond between steps;
continuing the worker (its threads and compilers) in each of those gaps cost the next step its caches. Gaps
between a real-time stream's chunks (tens of ms) still let it run.

Why its own process group but not its own session: a kill or a stop must reach the compilers it started, and on
Linux a new session is a new scheduler autogroup, which gets an equal share of the CPUs whatever its priority (the
real-time loop then missed most of its deadlines)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("streamserve")

WORKER = [sys.executable, "-m", "streamserve.engine.compile_worker"]  # + the request file
WORKER_IDLE = True  # the worker runs at SCHED_IDLE (benchmarks/compile_background.py compares normal priority)
PAUSE_WORKER = True  # the worker is stopped while the engine has work (the benchmark compares without)
STARVE_S = 1.0  # an engine busy this long without a break lets the worker run GRANT_S anyway
GRANT_S = 0.25
RESUME_AFTER_S = 0.02  # a stopped worker continues once the engine has been idle this long
POLL_S = 0.005  # the compile thread's check of the worker (its end, a resume, a starved worker's grant)
# the worker's own process group (Python 3.10 has no process_group argument: setpgrp between fork and exec)
OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


class WorkerProcess:
    """Runs compile requests in the worker, one at a time. `quiet`: set while the engine has no work (with
    `listen`/`unlisten`, engine/loop.py's Quiet, the worker is paused while it is clear)."""

    def __init__(self, quiet: threading.Event) -> None:
        self.quiet = quiet
        self.pause = PAUSE_WORKER and hasattr(quiet, "listen")
        self._lock = threading.Lock()  # the worker, its state and its signals, from two threads
        self.worker: subprocess.Popen[bytes] | None = None  # the one running now
        self._stopped_at: float | None = None  # when the worker was stopped (None: it runs)
        self._quiet_since: float | None = None  # when the engine last fell idle (None: it has work)
        self._granted_until = 0.0
        self._closed = False
        self.runs = 0  # workers started
        self.pauses = 0  # times a worker was stopped for the engine's steps
        if self.pause:
            quiet.listen(self._on_quiet)  # type: ignore[attr-defined]

    def run(self, request: dict[str, Any]) -> None:
        """Build `request["out"]` (waits; `close()` kills the worker). Its output goes to a log beside the package; a
        failure raises with the worker's last line."""
        out = Path(request["out"])
        out.parent.mkdir(parents=True, exist_ok=True)
        log_path = out.with_suffix(".log")
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({**request, "idle": WORKER_IDLE, "parent": os.getpid()}, f)
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("closed")
                self.runs += 1
                with log_path.open("wb") as sink:
                    worker = self.worker = subprocess.Popen([*WORKER, f.name], stdin=subprocess.DEVNULL,
                                                            stdout=sink, stderr=subprocess.STDOUT, **OWN_GROUP)
            if self.pause:
                self._on_quiet(self.quiet.is_set())  # the engine has work now: stopped until it has none
            while True:
                try:
                    code = worker.wait(POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    if self.pause:
                        self._poll(worker)
        finally:
            with self._lock:
                self.worker, self._stopped_at, self._granted_until = None, None, 0.0
            os.unlink(f.name)
        if code != 0:
            lines = log_path.read_text(errors="replace").strip().splitlines() if log_path.is_file() else []
            why = lines[-1] if lines else f"exit status {code}"
            raise RuntimeError(f"the compile worker failed ({why}; its log: {log_path})")

    def close(self) -> None:
        """Kill the worker running now (if any); nothing more runs. Never waits for a compile."""
        with self._lock:
            self._closed = True
            worker = self.worker
        if self.pause:
            self.quiet.unlisten(self._on_quiet)  # type: ignore[attr-defined]
        if worker is not None:
            kill_worker(worker)

    def _on_quiet(self, quiet: bool) -> None:
        """The engine fell idle (quiet: `_poll` continues the worker after RESUME_AFTER_S) or got work (the worker
        stops now): on the loop's thread, under its lock; one signal at most."""
        with self._lock:
            self._quiet_since = time.monotonic() if quiet else None
            worker = self.worker
            if worker is not None and not quiet and self._stopped_at is None:
                self._signal(worker, signal.SIGSTOP)
                self._stopped_at = time.monotonic()

    def _poll(self, worker: subprocess.Popen[bytes]) -> None:
        """On the compile thread every POLL_S: a stopped worker continues once the engine has been idle for
        RESUME_AFTER_S; one stopped for STARVE_S runs for GRANT_S whatever the engine does."""
        with self._lock:
            now = time.monotonic()
            if (self._stopped_at is not None and self._quiet_since is not None
                    and now - self._quiet_since >= RESUME_AFTER_S):
                self._signal(worker, signal.SIGCONT)
                self._stopped_at, self._granted_until = None, 0.0
            elif self._stopped_at is not None and now - self._stopped_at >= STARVE_S:
                self._signal(worker, signal.SIGCONT)
                self._stopped_at, self._granted_until = None, now + GRANT_S
            elif (self._stopped_at is None and self._granted_until and now >= self._granted_until
                  and not self.quiet.is_set()):
                self._signal(worker, signal.SIGSTOP)
                self._stopped_at, self._granted_until = now, 0.0

    def _signal(self, worker: subprocess.Popen[bytes], sig: int) -> None:
        if sig == signal.SIGSTOP:
            self.pauses += 1
        with contextlib.suppress(ProcessLookupError, PermissionError):  # it ended already
            os.killpg(worker.pid, sig)


def kill_worker(worker: subprocess.Popen[bytes]) -> None:
    """End a compile worker and what it started (its process group), by its id."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # it ended already
        os.killpg(worker.pid, signal.SIGKILL)
    try:
        worker.wait(5.0)
    except subprocess.TimeoutExpired:
        log.warning("cpu_compile: the compile worker %d did not end", worker.pid)
