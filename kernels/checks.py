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


def check_paged(q: torch.Tensor, h: int, hd: int, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                k_pos: torch.Tensor, q_pos: torch.Tensor, tokens: int) -> int:
    """The paged-attention inputs for `tokens` queries of `h` heads of `hd` dims; -> KVH."""
    check_tensor("k_pool", k_pool, dims=3, dtypes=(q.dtype,), device=q.device, contiguous=True)
    _, kvh, hd_k = k_pool.shape
    if hd_k != hd or h % kvh or hd % 2:
        raise ValueError(f"k_pool has shape {list(k_pool.shape)}: expected [slots, KVH, {hd}] with {h} % KVH == 0")
    check_tensor("v_pool", v_pool, shape=k_pool.shape, dtypes=(q.dtype,), device=q.device, contiguous=True)
    check_tensor("slots", slots, dims=1, dtypes=(torch.int32, torch.int64), device=q.device)
    check_tensor("k_pos", k_pos, shape=slots.shape, dtypes=(torch.int32, torch.int64), device=q.device)
    check_tensor("q_pos", q_pos, shape=(tokens,), dtypes=(torch.int32, torch.int64), device=q.device)
    return kvh
