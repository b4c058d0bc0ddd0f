"""What the model reads from a session's KV in a step (`LayerKV`), as protocols: the engine's `PagedSessionKV`
(sessions/) and the CUDA-graph static buffers (engine/graphs.py) both provide it; models/ never imports them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from streamserve.kernels.reference import PagedKeys


class StreamPolicy(Protocol):
    window: int | None
    sinks: int


class KeyReads(Protocol):
    """The keys one layer group's layers read in a step."""

    k_pos: torch.Tensor  # [S] absolute positions of the keys `update` returns for the group's layers
    read_slots: torch.Tensor  # [S] their flat slots in the group's storage


class LayerKV(Protocol):
    """What a forward needs from a session's KV: this step's positions, and per layer a place to store
    the new keys/values and read back the ones its queries may see. Layers with the same native window
    form a layer group (one unless the model mixes windows, as Gemma 3 does) and read the same keys."""

    rolling: bool  # keys cached before RoPE, positions counted inside the cache (StreamingLLM)
    policy: StreamPolicy
    q_pos: torch.Tensor  # [T] absolute positions of this step's tokens
    groups: Sequence[KeyReads]  # per layer group: the keys its layers read
    layer_group: tuple[int, ...]  # layer -> its group (the same for every session of a pool)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> PagedKeys:
        """Store k, v [T, KVH, hd]; -> the pages and slots of the keys at `k_pos`, these T tokens included."""
        ...
