"""One layer group's share of a session's KV: its page table, what it keeps, and the reads of the step in flight.

A group keeps what the session's policy keeps, intersected with its layers' native window plus the pool's
rewind reach (`LayerGroup.keep`): the sinks (with a session window) and, from the positions on, the last
`keep` tokens. It reads less than it keeps: a step's queries see the sinks and the last `window` tokens of
the group's layers (`read_first`). Page ids are the pool's global ids; the storage row of page p is
`p - base`.
"""

from __future__ import annotations

import numpy as np
import torch

from streamserve.errors import PageCapError
from streamserve.sessions.policy import WindowPolicy
from streamserve.sessions.pool import KVPool


class GroupKV:
    def __init__(self, pool: KVPool, index: int, policy: WindowPolicy) -> None:
        self.pool, self.index, self.policy = pool, index, policy
        self.group = pool.groups[index]
        self.base = pool.allocator.bases[index]
        self.table: dict[int, int] = {}  # logical page -> page id, for the pages still held
        self.step_pages: list[int] = []  # logical pages taken by the step in flight (provisional)
        # sinks are kept (and read) only with a session window: without one the session keeps everything
        self.sinks = policy.sinks if policy.window is not None else 0
        self.sink_pages = -(-self.sinks // pool.page_size)
        self.drops = policy.window is not None or self.group.keep is not None  # pages ever leave before the end
        self.k_pos = self.read_slots = self.write = torch.empty(0, dtype=torch.long)
        self.first = self.end = 0  # the planned step's oldest non-sink read position and its end (block tables)

    def read_first(self, pos: int) -> int:
        """The oldest non-sink position a query at `pos` may attend to in this group's layers."""
        first, w = self.policy.first_needed(pos), self.group.window
        return first if w is None else max(first, pos - w + 1)

    def keep_first(self, length: int) -> int:
        """The oldest non-sink position kept once the session holds `length` tokens: its last `keep` (window +
        reach) tokens. A rewind of `reach` tokens truncates the KV to length - reach - 1 (the last kept token
        runs again), whose query reads from length - reach - window: exactly the oldest kept."""
        first, keep = self.policy.first_needed(length), self.group.keep
        return first if keep is None else max(first, length - keep)

    # ---- a step ---------------------------------------------------------------------------------------
    def missing(self, start: int, end: int) -> list[int]:
        """The logical pages positions [start, end) need that the group does not hold."""
        P = self.pool.page_size
        return [j for j in range(start // P, (end + P - 1) // P) if j not in self.table]

    def check_cap(self, missing: int, cap: int | None) -> None:
        if cap is not None and len(self.table) + missing > cap:
            where = "" if len(self.pool.groups) == 1 else f" of layer group {self.index}"
            raise PageCapError(f"this step needs {len(self.table) + missing} pages{where}, over the session's "
                               f"cap of {cap}; use a window or rewind")

    def take(self, missing: list[int]) -> None:
        """Take pages for `missing` (CapacityError: nothing taken); they are the step's until commit/abort."""
        taken = self.pool.allocator.alloc(len(missing), self.index)
        self.table.update(zip(missing, taken, strict=True))
        self.step_pages = missing

    def slots(self, start: int, end: int) -> np.ndarray:
        """Logical positions [start, end) -> flat slot ids [end - start] int64 in the group's storage viewed as
        [pages * P, KVH, hd]. One page-table lookup per page, not per token. Host index math in numpy: a step
        plans it between forwards that stream every weight through the caches, where each small torch op costs
        ~10-20 us and a numpy one ~1 us (the plan of a SmolLM2 decode step: 229 us in torch)."""
        if end <= start:
            return np.empty(0, dtype=np.int64)
        P, lo = self.pool.page_size, start // self.pool.page_size
        table = np.array([self.table[j] - self.base for j in range(lo, (end - 1) // P + 1)], dtype=np.int64)
        pos = np.arange(start, end, dtype=np.int64)
        return table[pos // P - lo] * P + pos % P

    def plan(self, start: int, end: int) -> None:
        """The keys this step reads: [sinks | from the first query's window on], this step's own included."""
        first = min(self.read_first(start), end)
        self.first, self.end = first, end
        n_sink = min(self.sinks, first)
        dev = self.pool.device
        k_pos = np.concatenate([np.arange(n_sink, dtype=np.int64), np.arange(first, end, dtype=np.int64)])
        read = np.concatenate([self.slots(0, n_sink), self.slots(first, end)])
        self.k_pos = torch.from_numpy(k_pos).to(dev)  # [S]
        self.read_slots = torch.from_numpy(read).to(dev)  # [S], like k_pos
        self.write = self.read_slots[-(end - start):]

    def abort(self) -> None:
        self.pool.allocator.release([self.table.pop(j) for j in self.step_pages])
        self.step_pages = []

    def drop(self, length: int) -> None:
        """Give back the pages wholly outside what the group keeps at `length` tokens."""
        if not self.drops:
            return
        P, first = self.pool.page_size, self.keep_first(length)
        gone = [j for j in self.table if j >= self.sink_pages and (j + 1) * P <= first]
        self.pool.allocator.release([self.table.pop(j) for j in gone])

    # ---- rewind ---------------------------------------------------------------------------------------
    def can_read_at(self, to: int, held: set[int] | dict[int, int]) -> bool:
        """Whether the pages `held` cover every key a query at `to` reads."""
        P, first = self.pool.page_size, self.read_first(to)
        return to <= first or all(j in held for j in range(first // P, (to + P - 1) // P))

    def oldest_kept(self, held: list[int] | dict[int, int], length: int) -> int:
        rest = [j for j in held if j >= self.sink_pages]
        return min(rest) * self.pool.page_size if rest else length

    def truncate(self, to: int) -> None:
        """Whole pages at or past position `to` go back."""
        P = self.pool.page_size
        self.pool.allocator.release([self.table.pop(j) for j in [j for j in self.table if j * P >= to]])

    def release(self) -> None:
        self.pool.allocator.release(list(self.table.values()))
        self.table, self.step_pages = {}, []

    # ---- host copies ----------------------------------------------------------------------------------
    def rows(self, logical: list[int]) -> torch.Tensor:
        """Storage rows [n] of these held logical pages."""
        return torch.tensor([self.table[j] - self.base for j in logical], dtype=torch.long, device=self.pool.device)

    def load(self, logical: list[int]) -> torch.Tensor:
        """Take pages for `logical` (CapacityError: nothing taken) -> their storage rows [n]."""
        pages = self.pool.allocator.alloc(len(logical), self.index)
        self.table = dict(zip(logical, pages, strict=True))
        return self.rows(logical)
