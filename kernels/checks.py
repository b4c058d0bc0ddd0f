"""Argument checks for kernel launchers: a wrong tensor is a ValueError that names it and says what was
expected, before anything is launched."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_tensor(name: str, t: object, *, dims: int | None = None, shape: Sequence[int] | None = None,
                 dtypes: Sequence[torch.dtype] | None = None, device: torch.device | None = None,
                 contiguous: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {list(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {list(t.shape)}, expected {list(shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {list(t.stride())}); call .contiguous() once "
                         "at load time, not per step")
