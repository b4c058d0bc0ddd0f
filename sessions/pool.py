"""The global paged KV pool: per-layer K/V pages and a reference-counted page allocator.

Storage per layer: keys and values `[num_pages, page_size, KVH, hd]`. A session holds a page table
(logical page -> physical page); pages are allocated one at a time as a session grows and returned
the moment they are no longer needed. The allocator counts every page: free + held == total, and no
page is ever free and held, or held twice without a reference for each holder.
"""

from __future__ import annotations

import torch

from streamserve.errors import CapacityError, InvalidInputError

DEFAULT_PAGE_SIZE = 16


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise InvalidInputError(f"a KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest ids are handed out first
        self._refs = [0] * num_pages

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """n fresh pages (reference count 1), or CapacityError with nothing taken."""
        if n > len(self._free):
            raise CapacityError(f"the KV pool has {len(self._free)} free pages, {n} needed")
        pages = [self._free.pop() for _ in range(n)]
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
                self._free.append(p)

    def check(self, held: list[list[int]] | None = None) -> None:
        """Integrity: free + held == total, nothing free and held. With `held` (every holder's page list),
        each page's reference count must equal the number of holders listing it."""
        free = set(self._free)
        if len(free) != len(self._free):
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
    """Per-layer K/V page storage plus its allocator."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = DEFAULT_PAGE_SIZE, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if page_size < 1:
            raise InvalidInputError(f"page_size must be >= 1, got {page_size}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.dtype, self.device = page_size, dtype, torch.device(device)
        self.allocator = PageAllocator(num_pages)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages
