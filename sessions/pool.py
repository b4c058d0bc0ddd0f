"""The global paged KV pool: per-layer K/V pages and a reference-counted page allocator.

Storage per layer: keys and values `[pages of its group, page_size, KVH, hd]`. Layers are grouped by their
model-native window (`groups.py`; one group for every model without per-layer windows): a page belongs
to one group and holds that group's layers only. Page ids are global: group g owns ids
`[base_g, base_g + pages_g)`, and its storage row of page p is `p - base_g`. A session holds a page table
per group (logical page -> page id); pages are allocated one at a time as a session grows and returned
the moment they are no longer needed. The allocator counts every page: free + held == total, and no page
is ever free and held, or held twice without a reference for each holder.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

import torch

from streamserve.errors import CapacityError, InvalidInputError
from streamserve.sessions.groups import LayerGroup

DEFAULT_PAGE_SIZE = 16


class PageAllocator:
    def __init__(self, num_pages: int | Sequence[int]) -> None:
        """`num_pages`: the pool's pages, or the pages of each layer group (ids numbered group after group)."""
        counts = [num_pages] if isinstance(num_pages, int) else list(num_pages)
        if not counts or any(n < 1 for n in counts):
            raise InvalidInputError(f"a KV pool needs at least one page per layer group, got {num_pages}")
        self.group_pages = tuple(counts)
        self.bases = (0, *accumulate(counts))[:-1]  # the first page id of each group
        self.num_pages = sum(counts)
        # a stack per group: the lowest ids are handed out first
        self._free = [list(range(b + n - 1, b - 1, -1)) for b, n in zip(self.bases, counts, strict=True)]
        self._refs = [0] * self.num_pages

    @property
    def free_count(self) -> int:
        return sum(len(f) for f in self._free)

    @property
    def used_count(self) -> int:
        return self.num_pages - self.free_count

    def free_in(self, group: int) -> int:
        return len(self._free[group])

    def used_in(self, group: int) -> int:
        return self.group_pages[group] - len(self._free[group])

    def group_of(self, page: int) -> int:
        return bisect_right(self.bases, page) - 1

    def alloc(self, n: int, group: int = 0) -> list[int]:
        """n fresh pages of `group` (reference count 1), or CapacityError with nothing taken."""
        free = self._free[group]
        if n > len(free):
            where = "" if len(self._free) == 1 else f" for layer group {group}"
            raise CapacityError(f"the KV pool has {len(free)} free pages{where}, {n} needed")
        pages = [free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more holder for each of these held pages (e.g. a snapshot kept on the device)."""
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} is free and cannot be shared")
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page whose last reference goes is free again."""
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} released twice")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free[0 if len(self._free) == 1 else self.group_of(p)].append(p)

    def check(self, held: list[list[int]] | None = None) -> None:
        """Integrity: free + held == total, nothing free and held. With `held` (every holder's page list),
        each page's reference count must equal the number of holders listing it."""
        free = {p for f in self._free for p in f}
        if len(free) != self.free_count:
            raise AssertionError("a page is on the free list twice")
        used = [p for p in range(self.num_pages) if self._refs[p] > 0]
        if free & set(used):
            raise AssertionError(f"pages both free and held: {sorted(free & set(used))[:8]}")
        if len(free) + len(used) != self.num_pages:
            raise AssertionError(f"free {len(free)} + held {len(used)} != total {self.num_pages}")
        if held is not None:
            counts = [0] * self.num_pages
            for pages in held:
                for p in pages:
                    counts[p] += 1
            if counts != self._refs:
                bad = [p for p in range(self.num_pages) if counts[p] != self._refs[p]][:8]
                raise AssertionError(f"reference counts disagree with the holders on pages {bad}")


class KVPool:
    """Per-layer K/V page storage plus its allocator, for one or more layer groups."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int | Sequence[int],
                 page_size: int = DEFAULT_PAGE_SIZE, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", groups: Sequence[LayerGroup] | None = None) -> None:
        """`groups` (default: one group of every layer, full attention) with `num_pages` per group."""
        if page_size < 1:
            raise InvalidInputError(f"page_size must be >= 1, got {page_size}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        self.groups = tuple(groups) if groups is not None else (LayerGroup(tuple(range(num_layers))),)
        if sorted(i for grp in self.groups for i in grp.layers) != list(range(num_layers)):
            raise InvalidInputError(f"layer groups {[g.layers for g in self.groups]} do not cover layers "
                                    f"0..{num_layers - 1} once each")
        self.layer_group = tuple(next(g for g, grp in enumerate(self.groups) if layer in grp.layers)
                                 for layer in range(num_layers))  # layer -> its group
        self.allocator = PageAllocator(num_pages)
        if len(self.allocator.group_pages) != len(self.groups):
            raise InvalidInputError(f"{len(self.allocator.group_pages)} page counts for {len(self.groups)} groups")
        shapes = [(n, page_size, num_kv_heads, head_dim) for n in self.allocator.group_pages]
        self.k = [torch.zeros(shapes[g], dtype=dtype, device=self.device) for g in self.layer_group]
        self.v = [torch.zeros(shapes[g], dtype=dtype, device=self.device) for g in self.layer_group]
        # the same storage as [pages * page_size, KVH, hd] per layer: flat slots, made once (not per step and layer)
        self.k_slots = [t.view(-1, num_kv_heads, head_dim) for t in self.k]
        self.v_slots = [t.view(-1, num_kv_heads, head_dim) for t in self.v]

    @staticmethod
    def bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def group_page_bytes(self, group: int) -> int:
        """Bytes of one page of `group` (its layers' keys and values)."""
        return self.bytes_per_page(len(self.groups[group].layers), self.num_kv_heads, self.head_dim,
                                   self.page_size, self.dtype)

    def group_stats(self) -> list[dict[str, int | None]]:
        """Per layer group: its native window, layers, tokens a session keeps, pages in use and in all, page bytes."""
        a = self.allocator
        return [{"window": g.window, "layers": len(g.layers), "keep_tokens": g.keep, "pages_used": a.used_in(i),
                 "pages_total": a.group_pages[i], "page_bytes": self.group_page_bytes(i)}
                for i, g in enumerate(self.groups)]

    @property
    def total_bytes(self) -> int:
        """The pool's storage: every group's pages."""
        return sum(self.allocator.group_pages[g] * self.group_page_bytes(g) for g in range(len(self.groups)))

    @property
    def used_bytes(self) -> int:
        return sum(self.allocator.used_in(g) * self.group_page_bytes(g) for g in range(len(self.groups)))

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages
