"""What the SGLang backend's tests share: the Python with SGLang, the CPU recipe, a launcher (helpers, not tests)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from streamserve.engine.remote.launch import LaunchedSGLang

SGLANG_PYTHON = os.environ.get("STREAMSERVE_SGLANG_PYTHON")
# the recipe of tests/support/sglang/README.md (streamserve adds the host, port and streaming sessions)
CPU_ARGS = ("--device cpu --attention-backend torch_native --disable-overlap-schedule --max-total-tokens 16384 "
            "--dtype float32 --sleep-on-idle")


def launch(model: Path) -> LaunchedSGLang:
    """An SGLang server for `model`, started by the backend's own launcher (as `--sglang-launch` does)."""
    assert SGLANG_PYTHON
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU engine: without it `--device cpu` takes GPU paths
    child = LaunchedSGLang(model, CPU_ARGS, SGLANG_PYTHON)
    child.start(lambda code: print(f"SGLang exited with status {code}", file=sys.stderr))
    return child
