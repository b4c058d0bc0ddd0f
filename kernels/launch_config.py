"""Tuned launch configs, kept as JSON data (`configs/launch.json`), with a safe default per kernel.

Lookup: kernel -> device name -> dtype -> shape key (e.g. "D2048_I768"), falling back to the kernel's
"default". Explicit block sizes passed to a launcher win over both.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = Path(__file__).resolve().parent / "configs" / "launch.json"


@cache
def _table() -> dict[str, Any]:
    return json.loads(CONFIG_FILE.read_text())


def device_name(device: torch.device) -> str:
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else "cpu"


@cache
def _cuda_name(index: int) -> str:  # asked on every kernel launch: ask the driver once
    return torch.cuda.get_device_name(index)


def launch_config(kernel: str, device: torch.device, dtype: torch.dtype, shape_key: str) -> dict[str, int]:
    entry = _table()[kernel]
    tuned = entry.get(device_name(device), {}).get(str(dtype).removeprefix("torch."), {}).get(shape_key, {})
    return {**entry["default"], **tuned}
