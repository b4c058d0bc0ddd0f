"""A per-session KV cache: one growing buffer per layer, [KVH, capacity, hd] for keys and for values.

A step writes its T new keys/values after the committed length and attends over everything up to
them; `commit(T)` makes them part of the session only once the whole forward succeeded, so a failed
step leaves the session exactly as it was. Capacity doubles when needed (amortised O(1) per token).
"""

from __future__ import annotations

import torch

from streamserve.errors import ContextLengthError


class ContiguousKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype, device: torch.device, initial_capacity: int = 256) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_tokens, self.dtype, self.device = max_tokens, dtype, device
        self.length = 0  # committed tokens
        self._pending = 0  # tokens of the step in flight
        self._capacity = 0
        self._initial = min(initial_capacity, max_tokens)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def begin(self, n: int) -> None:
        """Make room for a step of n tokens after the committed ones."""
        need = self.length + n
        if need > self.max_tokens:
            raise ContextLengthError(f"{need} tokens exceed the model's context of {self.max_tokens}")
        if need > self._capacity:
            cap = min(self.max_tokens, max(need, 2 * self._capacity, self._initial))
            shape = (self.num_kv_heads, cap, self.head_dim)
            new_k = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            new_v = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
            if self.k:
                for old, new in zip(self.k + self.v, new_k + new_v, strict=True):
                    new[:, : self.length].copy_(old[:, : self.length])
            self.k, self.v, self._capacity = new_k, new_v, cap
        self._pending = n

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [T, KVH, hd] -> keys, values [KVH, length + T, hd] (views, no copy of the prefix)."""
        start, end = self.length, self.length + k.shape[0]
        self.k[layer][:, start:end].copy_(k.transpose(0, 1))
        self.v[layer][:, start:end].copy_(v.transpose(0, 1))
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def commit(self) -> None:
        self.length += self._pending
        self._pending = 0

    def truncate(self, to: int) -> None:
        """Forget the committed tokens from position `to` on."""
        self.length = max(0, min(self.length, to))

    def abort(self) -> None:
        self._pending = 0

    def free(self) -> None:
        self.k, self.v, self._capacity, self.length, self._pending = [], [], 0, 0, 0
