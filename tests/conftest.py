"""Shared fixtures: one tiny random checkpoint per supported architecture, and an Engine on each."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ARCH_CONFIGS, make_checkpoint

# Triton kernels run in Triton's interpreter on a CPU; it must be chosen before triton compiles anything.
os.environ.setdefault("TRITON_INTERPRET", "1")


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
