"""The compile worker's process (engine/worker_process.py) beside a serving engine: it runs at SCHED_IDLE, is
stopped as soon as the engine has work, and continues only once the engine has rested RESUME_AFTER_S. A stand-in
worker (a sleeping child) stands for the real one: what is tested is the signals, read back from /proc."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from streamserve.engine import worker_process

WAIT = 600.0  # the most a test waits for a state (polled: the wait ends when it is reached)


def stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def wait_until_stopped(pid: int, want: bool) -> bool:
    """Wait (bounded, polling /proc) until the process is stopped (`want`) or running; -> whether it got there."""
    end = time.monotonic() + WAIT
    while stopped(pid) != want:
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def test_the_worker_stops_while_the_engine_works_and_waits_for_a_real_rest(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """Stopped as soon as the engine has work; continued only once it has been idle RESUME_AFTER_S (gaps between
    back-to-back steps never wake it)."""
    from streamserve.engine.loop import Quiet

    monkeypatch.setattr(worker_process, "WORKER", [sys.executable, "-c", "import time; time.sleep(600)"])
    monkeypatch.setattr(worker_process, "STARVE_S", 3600.0)  # no grant in this test
    monkeypatch.setattr(worker_process, "RESUME_AFTER_S", 3600.0)
    quiet = Quiet()
    quiet.clear()  # the engine has work
    proc = worker_process.WorkerProcess(quiet)

    def run() -> None:
        with pytest.raises(RuntimeError):  # killed by close()
            proc.run({"out": str(tmp_path / "x.so")})

    runner = threading.Thread(target=run)
    runner.start()
    try:
        while proc.worker is None:
            time.sleep(0.005)
        pid = proc.worker.pid
        assert wait_until_stopped(pid, True)  # stopped while the engine works
        quiet.set()  # idle, but not for RESUME_AFTER_S yet
        time.sleep(0.1)  # 20 of the compile thread's polls
        assert stopped(pid)
        monkeypatch.setattr(worker_process, "RESUME_AFTER_S", 0.0)
        assert wait_until_stopped(pid, False)  # continued once the rest is long enough
        quiet.clear()
        assert wait_until_stopped(pid, True)
    finally:
        proc.close()
        runner.join(WAIT)
    assert not runner.is_alive() and proc.pauses >= 2


def test_the_worker_runs_at_idle_priority() -> None:
    code = ("import os; from streamserve.engine.compile_worker import idle_priority; "
            "print(idle_priority(), os.sched_getscheduler(0) == os.SCHED_IDLE)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT, check=True)
    assert out.stdout.split() == ["idle", "True"]
