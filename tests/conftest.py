"""Shared fixtures: one tiny random checkpoint per supported architecture, and an Engine on each."""

from __future__ import annotations

# First of all: `python -m pytest` put the repository root first on sys.path, where its kernels/ folder would shadow
# the `kernels` package transformers imports; importing streamserve moves the root behind site-packages
# (streamserve/checkout.py). `make test` runs pytest so; tests/test_shadowing.py checks that nothing is shadowed.
# isort: off
import streamserve  # noqa: F401
# isort: on

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ARCH_CONFIGS, make_checkpoint

# Triton kernels run in Triton's interpreter on a CPU; it must be chosen before triton compiles anything.
os.environ.setdefault("TRITON_INTERPRET", "1")
# cpu_compile "auto" (the default) would start a background compile of every engine the suite builds (hundreds, two
# cores): here auto means off, also in the servers tests start. The tests of the default unset it
# (tests/engine/test_cpu_compile_default.py).
os.environ["STREAMSERVE_CPU_COMPILE"] = "off"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: (root / arch, make_checkpoint(root / arch, arch)) for arch in ARCH_CONFIGS}


@pytest.fixture(scope="session")
def engines(checkpoints: dict[str, tuple[Path, torch.nn.Module]]) -> dict[str, Any]:
    from streamserve import Engine

    return {arch: Engine.from_pretrained(path, device="cpu", kv_memory="64MiB")
            for arch, (path, _) in checkpoints.items()}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_RSS_LOG = os.environ.get("STREAMSERVE_TEST_RSS_LOG")  # a path: each test's resident memory after it, for leaks
# Engines, servers and voice models a test drops sit in reference cycles (threads, callbacks) until Python's
# full collection runs, which the allocation heuristics rarely trigger: a KV pool is 1 GiB in one object. The
# whole suite then held ~17 GiB by its end and was killed on a 24 GiB machine. Collect when the process is big.
GC_ABOVE_KIB = 3 << 20


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc `malloc_trim`): what servers and voice models freed
    stays in the process otherwise, and each test module's server adds its own."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _forget_aiohttp_handlers() -> None:
    """aiohttp keeps the last 1024 (handler, apps) pairs it built middleware chains for
    (`web_app._cached_build_middleware`, an lru_cache): a handler is a bound method of a test's Server, so every
    server a test started, its engine and KV pool with it, stayed alive for the rest of the run (the whole suite
    reached 20 GiB and was killed). One server per process, as in production, holds only its own."""
    from aiohttp import web_app

    cached = getattr(web_app, "_cached_build_middleware", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


@pytest.fixture(autouse=True)
def _collect_dropped_engines() -> Any:
    yield
    _forget_aiohttp_handlers()
    if _rss_kib() > GC_ABOVE_KIB:
        import gc

        gc.collect()
        if not os.environ.get("STREAMSERVE_TEST_NO_TRIM"):
            _trim_heap()


if _RSS_LOG:
    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(item: pytest.Item) -> None:
        live = ""
        if os.environ.get("STREAMSERVE_TEST_ENGINES"):  # slow: counts live engines (what holds them: the leak)
            import gc

            from streamserve.engine.engine import Engine
            gc.collect()
            live = f"\t{sum(isinstance(o, Engine) for o in gc.get_objects())}"
        with open(_RSS_LOG, "a") as f:
            f.write(f"{_rss_kib()}\t{item.nodeid}{live}\n")
