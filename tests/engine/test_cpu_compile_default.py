"""cpu_compile's default, "auto" (engine/inductor_setup.py): an engine built with no compile argument compiles its
decode step in the background on a CPU with torch kernels and serves compiled once ready, with the eager engine's
greedy tokens; it serves (eagerly) while the compile runs, at the lowest CPU priority; a shutdown does not wait for
a compile in progress; auto is off without a C++ compiler, off CPUs, with Triton kernels and where the environment
says STREAMSERVE_CPU_COMPILE=off (as the rest of this suite does: tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import make_checkpoint, random_ids

from streamserve import Engine
from streamserve.engine import compiled as compiled_module
from streamserve.engine import worker_process
from streamserve.engine.compiled import CompiledSteps
from streamserve.engine.inductor_setup import CPU_COMPILE_ENV, compiler_missing, cpu_compile_wanted
from streamserve.errors import InvalidInputError
from streamserve.tools.batched import replies_together

WAIT = 600.0  # seconds a test waits for a compile (an event: the wait ends when it is done)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("default-compile") / "qwen3"
    make_checkpoint(path, "qwen3", num_hidden_layers=2, intermediate_size=64)
    return path


@pytest.fixture
def auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment a user has: no STREAMSERVE_CPU_COMPILE."""
    monkeypatch.delenv(CPU_COMPILE_ENV, raising=False)


def default_engine(path: Path) -> Engine:
    return Engine.from_pretrained(path, device="cpu", kv_memory="16MiB")  # no cpu_compile argument


def compiled_of(engine: Engine) -> CompiledSteps:
    assert engine.graphs is not None and engine.graphs.compiled is not None
    return engine.graphs.compiled


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    with engine.open_session() as s:
        s.append(token_ids=prompt)
        return s.generate(max_tokens=n, stop_token_ids=())


def compile_thread() -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == "streamserve-compile"), None)


@pytest.mark.slow
@pytest.mark.skipif(compiler_missing() is not None, reason="torch.compile cannot build CPU code here")
def test_default_engine_serves_compiled_once_ready(tiny: Path, auto: None, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    """Inductor for real (C++ built and run), into a cache of the test's own; frozen, not autotuned (CI's time:
    tests/engine/test_cpu_compile.py autotunes)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(compiled_module, "INDUCTOR_OPTIONS", {**compiled_module.INDUCTOR_OPTIONS,
                                                               "max_autotune": False})
    eager = Engine.from_pretrained(tiny, device="cpu", kv_memory="16MiB", cpu_compile="off")
    engine = default_engine(tiny)
    try:
        assert eager.graphs is None and eager.stats()["compiled_step"] is None
        compiled = compiled_of(engine)
        assert compiled.wait_idle(WAIT) and not compiled.failed and compiled.ready == 1
        prompt = random_ids(30, seed=11)
        assert greedy(engine, prompt, 24) == greedy(eager, prompt, 24)
        assert compiled.steps >= 23  # served compiled
        step = engine.stats()["compiled_step"]
        assert step["state"] == "active" and step["steps_compiled"] == compiled.steps
        assert step["ready_after_s"] > 0 and step["compile_seconds"] > 0
        assert any((tmp_path / "inductor").iterdir())  # the cache a second start compiles from
        engine.check_integrity()
    finally:
        engine.shutdown()
        eager.shutdown()


def test_serves_while_compiling_at_idle_priority_and_shutdown_does_not_wait(tiny: Path, auto: None, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker is held (a stand-in that takes the worker's priority, then waits) while the default engine serves
    two sessions at once: every step eager, the same tokens as an eager engine; the worker runs at SCHED_IDLE; a
    shutdown with the worker still running returns and ends it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    marker = tmp_path / "worker"
    held = ("import os, pathlib, time\nfrom streamserve.engine.compile_worker import idle_priority\n"
            f"pathlib.Path({str(marker)!r}).write_text(f'{{os.getpid()}} {{idle_priority()}}')\ntime.sleep(600)")
    monkeypatch.setattr(worker_process, "WORKER", [sys.executable, "-c", held])
    eager = Engine.from_pretrained(tiny, device="cpu", kv_memory="16MiB", cpu_compile="off")
    engine = default_engine(tiny)
    compiled = compiled_of(engine)
    try:
        prompts, kws = [random_ids(25, seed=12), random_ids(33, seed=13)], [{}, {}]
        assert replies_together(engine, prompts, 20, kws) == replies_together(eager, prompts, 20, kws)
        assert compiled.steps == 0 and compiled.eager_steps >= 19
        assert engine.stats()["compiled_step"]["state"] == "compiling"
        deadline = time.monotonic() + WAIT
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pid, priority = marker.read_text().split()
        if hasattr(os, "SCHED_IDLE"):
            assert priority == "idle"
        engine.check_integrity()
    finally:
        engine.shutdown()  # returns with the worker still running: it is killed
        eager.shutdown()
    thread = compile_thread()
    if thread is not None:
        thread.join(WAIT)
    assert compiled.ready == 0 and not compiled.failed  # closed: nothing published, no failure logged
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"


def test_auto_follows_the_device_kernels_compiler_and_environment(tiny: Path, auto: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert not cpu_compile_wanted("auto", "cuda", "torch")  # CUDA graphs are the GPU's fixed-shape steps
    assert not cpu_compile_wanted("auto", "cpu", "triton")
    assert not cpu_compile_wanted("off", "cpu", "torch") and cpu_compile_wanted("on", "cpu", "torch")
    assert cpu_compile_wanted("auto", "cpu", "torch") == (compiler_missing() is None)
    with pytest.raises(InvalidInputError, match="cpu_compile must be auto, on or off"):
        cpu_compile_wanted("yes", "cpu", "torch")
    monkeypatch.setenv(CPU_COMPILE_ENV, "off")
    assert not cpu_compile_wanted("auto", "cpu", "torch") and cpu_compile_wanted("on", "cpu", "torch")
    engine = default_engine(tiny)
    assert engine.graphs is None  # nothing compiles, nothing is fixed-shape
    engine.shutdown()
    monkeypatch.delenv(CPU_COMPILE_ENV)
    monkeypatch.setenv("PATH", "")  # no compiler to be found
    monkeypatch.delenv("CXX", raising=False)
    assert "no C++ compiler" in (compiler_missing() or "")
    assert not cpu_compile_wanted("auto", "cpu", "torch")


def test_models_pull_warms_the_default_decode_step(tiny: Path, auto: None, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`streamserve models pull` compiles the step chat and serve start with (cli/models.py warm_compiled_step),
    with progress on stderr; nothing where auto is off. A stand-in worker and package here: the real compile and its
    cache are the test above's."""
    from streamserve.cli import models as models_cli

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    script = ("import json, pathlib, sys, time; time.sleep(0.2); "
              "pathlib.Path(json.loads(pathlib.Path(sys.argv[1]).read_text())['out']).write_bytes(b'')")
    monkeypatch.setattr(worker_process, "WORKER", [sys.executable, "-c", script])
    monkeypatch.setattr(compiled_module, "load_package", lambda path: lambda *inputs: torch.zeros(1))
    monkeypatch.setattr(models_cli, "WARM_REPORT_EVERY", 0.01)  # a progress line at once
    seconds = models_cli.warm_compiled_step(tiny)
    assert seconds is not None and seconds > 0
    err = capsys.readouterr().err
    assert "compiling qwen3's CPU decode step into the cache" in err and "decode step compiled in" in err
    bad = tiny.parent / "damaged.gguf"
    bad.write_bytes(b"GGUF" + b"x" * 64)
    assert models_cli.warm_compiled_step(bad) is None  # the pull stands; the first start compiles instead
    assert "the decode step was not compiled" in capsys.readouterr().err
    monkeypatch.setenv(CPU_COMPILE_ENV, "off")
    assert models_cli.warm_compiled_step(tiny) is None
    assert "no CPU decode step to compile here" in capsys.readouterr().err
    monkeypatch.delenv(CPU_COMPILE_ENV)
    assert models_cli.warm_compiled_step(tiny) == 0.0  # a second pull: the package is in the cache
    assert "decode step was in the cache" in capsys.readouterr().err


@pytest.mark.skipif(compiler_missing() is not None, reason="torch.compile cannot build CPU code here")
def test_a_script_that_exits_while_its_engine_compiles_exits_cleanly(tmp_path: Path) -> None:
    """A script that ends while its engine's step compiles exits at once and cleanly, and its worker (a process
    that would compile for a minute more) is ended with it (`inductor_setup.stop_compiles_at_exit`)."""
    script = ("import time; from streamserve import Engine; "
              "e = Engine.from_pretrained('default', device='cpu', kv_memory='16MiB'); "
              "c = e.graphs.compiled; time.sleep(3); print('compiling', not c.idle.is_set(), c.process.worker.pid)")
    env = {k: v for k, v in os.environ.items() if k != CPU_COMPILE_ENV}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # cold: the exit comes mid-compile
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=WAIT)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-2000:]
    said, pid = done.stdout.strip().rsplit(" ", 1)
    assert said == "compiling True"
    stat = Path(f"/proc/{pid}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z"
