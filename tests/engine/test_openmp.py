"""engine/openmp.py: a thread hands its OpenMP worker threads back, and the engine does so on the threads that stop
running torch work (the loading thread, the compile thread after a compile, the engine thread when it falls idle),
so that the engine thread's steps never share the CPUs with sleeping pools (libgomp then wakes a worker for every
parallel region: the cost is in docs/benchmarks.md, never asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import make_checkpoint, random_ids

from streamserve import Engine
from streamserve.engine import engine as engine_module
from streamserve.engine import loop as loop_module

needs_openmp = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2 or "parallel backend: OpenMP" not in torch.__config__.parallel_info()
    or not Path("/proc/self/task").is_dir(), reason="needs torch on OpenMP, 2 CPUs and /proc")

# In a fresh process (no other thread starts or ends meanwhile): a thread's 2-thread op starts one OpenMP worker,
# which the release ends; a second release finds no pool and still succeeds.
SCRIPT = """
import json, os, threading, torch
from streamserve.engine.openmp import release_openmp_threads
tasks = lambda: len(os.listdir("/proc/self/task"))
out = {}
def work():
    torch.set_num_threads(2)
    out["before"] = tasks()
    torch.randn(512, 512) @ torch.randn(512, 512)
    out["pool"] = tasks()
    out["released"] = release_openmp_threads()
    out["after"] = tasks()
    out["again"] = release_openmp_threads()
t = threading.Thread(target=work)
t.start()
t.join()
print(json.dumps(out))
"""


@needs_openmp
def test_release_ends_the_calling_threads_workers() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["pool"] == got["before"] + 1  # one worker next to the thread itself
    assert got["released"] and got["after"] == got["before"] and got["again"]


def test_the_engine_releases_on_the_threads_that_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loading thread after the load, the engine thread once idle (a compile runs in a child process: no
    OpenMP pool of this process's)."""
    calls: list[str] = []
    engine_released = threading.Event()

    def counted() -> bool:
        calls.append(threading.current_thread().name)
        if calls[-1] == "streamserve-engine":
            engine_released.set()
        return True

    for module in (engine_module, loop_module):
        monkeypatch.setattr(module, "release_openmp_threads", counted)
    path = tmp_path / "qwen3"
    make_checkpoint(path, "qwen3", num_hidden_layers=2)
    engine = Engine.from_pretrained(path, device="cpu", kv_memory="16MiB")
    try:
        assert threading.current_thread().name in calls  # the load
        engine_released.clear()
        with engine.open_session() as s:
            s.append(token_ids=random_ids(12, seed=1))
            assert len(s.generate(max_tokens=6, stop_token_ids=())) == 6
        assert engine_released.wait(60)  # once the reply is done and nothing is left to do
    finally:
        engine.shutdown()
