"""How the compiled CPU decode steps (engine/compiled.py) are set up: whether `cpu_compile="auto"` compiles here,
Inductor's options and on-disk cache, the compiled steps' cache and the digest that names each, and the exit that
ends running compile workers."""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
import weakref
from pathlib import Path
from typing import Any, Protocol

import torch

from streamserve.errors import InvalidInputError
from streamserve.models.store import default_home

log = logging.getLogger("streamserve")

CPU_COMPILE_CHOICES = ("auto", "on", "off")
# `auto` everywhere in this process reads as `off` when this is "off" in the environment: for test suites (every
# engine they build would otherwise start a compile) and machines where background compiles are unwanted
CPU_COMPILE_ENV = "STREAMSERVE_CPU_COMPILE"


def compiler_missing() -> str | None:
    """Why torch.compile cannot build CPU code here (None: it can): Inductor writes C++ that a C++ compiler builds
    against Python's headers (`cpp_wrapper`)."""
    if sys.platform not in ("linux", "darwin"):
        return f"Inductor's CPU code is not built on {sys.platform} by streamserve"
    names = [os.environ.get("CXX") or "", "g++", "clang++", "c++"]
    if not any(n and shutil.which(n) for n in names):
        return "no C++ compiler (g++ or clang++) on PATH"
    if not (Path(sysconfig.get_path("include")) / "Python.h").is_file():
        return f"no Python headers ({sysconfig.get_path('include')}/Python.h; install python3-dev)"
    return None


def cpu_compile_wanted(setting: str, device_type: str, ops: str) -> bool:
    """Whether decode steps run compiled: `on` on a CPU with torch kernels; `auto` (the default) the same where a
    compiler is there and STREAMSERVE_CPU_COMPILE is not "off"; `off` never. CUDA and Triton kernels never
    (CUDA graphs are their fixed-shape steps)."""
    if setting not in CPU_COMPILE_CHOICES:
        raise InvalidInputError(f"cpu_compile must be auto, on or off, got {setting!r}")
    if setting == "off" or device_type != "cpu" or ops != "torch":
        return False
    if setting == "on":
        return True
    if os.environ.get(CPU_COMPILE_ENV, "").strip().lower() == "off":
        return False
    why = compiler_missing()
    if why is not None:
        log.info("cpu_compile auto: decode steps run eagerly (%s)", why)
    return why is None


class Stoppable(Protocol):
    def close(self) -> None: ...


_COMPILERS: weakref.WeakSet[Stoppable] = weakref.WeakSet()


def stop_at_exit(compiler: Stoppable) -> None:
    """Close `compiler`, which kills its compile worker, when the interpreter exits: a worker left running would
    take the CPUs for minutes after its engine's process ended."""
    _COMPILERS.add(compiler)


@atexit.register
def stop_compiles_at_exit() -> None:
    for compiler in list(_COMPILERS):
        compiler.close()


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache: the user's TORCHINDUCTOR_CACHE_DIR, else <streamserve home>/inductor (set now,
    before the first compile reads it). Importing torch._dynamo writes Inductor's default (/tmp/torchinductor_USER)
    into the variable: that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = current = str(default_home() / "inductor")
    return current


# Inductor's options for a decode step's package (the compile worker passes them to AOTInductor, whose code calling
# the kernels is C++ by construction):
# - freezing: the model's weights and packed quantized forms become constants of the graph (they are never written
#   while a step runs), which Inductor may fold and repack;
# - max_autotune with the CPP GEMM template next to aten: each quantized matmul shape is timed once per compile
#   (a few seconds each) between aten's packed kernel and Inductor's own micro-GEMM over a weight it reblocks at
#   compile time. At batch 1 the template reads int8 weights as a stream of blocks where aten's int8 kernel is
#   compute-bound: SmolLM2's compiled int8 step went from 41 to 63 tok/s (benchmarks/cpu_decode.py). Float
#   matmuls are tuned the same way.
# - cpp.min_chunk_size 32768 (Inductor's default: 512 elements a thread): a kernel parallelizes only with more work
#   than that. A decode step's norms, activations and key gathers are a few thousand elements: run by one thread,
#   they skip an OpenMP fork and join each (with Inductor's default of 512, 1.08x as long, the same benchmark).
#   A long context's key gather, and a batch's, still split.
INDUCTOR_OPTIONS: dict[str, Any] = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                                    "cpp.min_chunk_size": 32768}


def step_cache_dir() -> Path:
    """Where the compiled steps' packages live: beside Inductor's own caches (`inductor_cache_dir`)."""
    return Path(inductor_cache_dir()) / "streamserve-steps"


STEP_SOURCES = ("models", "sessions", "kernels", "engine/static_step.py", "engine/exported_step.py",
                "engine/compiled_ops.py", "engine/compile_worker.py")  # under the streamserve package


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of the code a compiled step is traced from: a package built by other code is never loaded."""
    root = Path(__file__).resolve().parents[1]  # the streamserve package
    h = hashlib.sha256()
    for name in STEP_SOURCES:
        path = root / name
        if not path.exists():  # kernels/ and sessions/ in a source tree: packages mapped from elsewhere
            spec = importlib.util.find_spec(f"streamserve.{name}")
            assert spec is not None and spec.origin is not None
            path = Path(spec.origin).parent
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def step_digest(request: dict[str, Any]) -> str:
    """The name of a step's package: a digest of its compile request (model, shape, pool, options), torch's version,
    the CPU's vector instructions and the model code (`source_digest`)."""
    h = hashlib.sha256(json.dumps(request, sort_keys=True).encode())
    cpu = torch.backends.cpu.get_cpu_capability()
    h.update(f"{torch.__version__}|{cpu}|{platform.machine()}|{source_digest()}".encode())
    return h.hexdigest()[:32]
