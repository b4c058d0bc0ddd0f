"""Tests of the SGLang backend against a real SGLang server (`make test-sglang`).

They need SGLang's own virtual environment (tests/support/sglang/install.sh: 2.6 GB, ~3 minutes) and start SGLang
servers of ~40 s each, which does not fit the CI run beside the rest of the suite: `make test-sglang` installs the
environment and runs this folder with STREAMSERVE_SGLANG_PYTHON set to its Python; without it, the folder is
skipped (docs/scale.md says why). SGLang runs on this CPU with its torch-native attention, on 127.0.0.1, serving a
tiny random qwen3 checkpoint with a chat template, in float32 (SGLang's `auto` would make it float16), so its
greedy tokens equal streamserve's own engine's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from chat_checkpoints import chat_checkpoint
from sglang_support import SGLANG_PYTHON, launch

from streamserve.engine.remote.launch import LaunchedSGLang


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SGLANG_PYTHON:
        return
    skip = pytest.mark.skip(reason="needs a real SGLang: run `make test-sglang` (its own 2.6 GB environment and "
                                   "~40 s servers do not fit the CI run; docs/scale.md)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_checkpoint(tmp_path_factory.mktemp("sglang") / "qwen3-chat", "chatml")


@pytest.fixture(scope="session")
def sglang(checkpoint: Path) -> Iterator[LaunchedSGLang]:
    """One SGLang server shared by the tests that do not kill it."""
    child = launch(checkpoint)
    try:
        yield child
    finally:
        child.stop()
