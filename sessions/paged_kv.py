"""One session's keys and values on the global paged pool.

The session's page table maps logical pages (tokens [j*P, (j+1)*P)) to physical pool pages. A step
(`begin` -> one `update` per layer -> `commit` or `abort`) writes its T new tokens into their slots and
reads back only the slots its queries may see: the sinks and the window (or everything without a
window). Nothing already cached is recomputed, moved or copied. After a commit, pages that fell wholly
outside `[sinks | window]` go back to the pool; after an abort, the pages the step took go back and the
session is exactly as before (the committed length is the rollback checkpoint).
"""

from __future__ import annotations

import torch

from streamserve.errors import ContextLengthError, PageCapError, RewindError
from streamserve.kernels.reference import PagedKeys
from streamserve.sessions.policy import WindowPolicy
from streamserve.sessions.pool import KVPool


class HostPages:
    """A session's held pages copied to host memory: per layer keys/values [n, P, KVH, hd]."""

    def __init__(self, logical: list[int], k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.logical, self.k, self.v = logical, k, v

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class PagedSessionKV:
    def __init__(self, pool: KVPool, policy: WindowPolicy, max_tokens: int, page_cap: int | None = None) -> None:
        self.pool, self.policy = pool, policy
        self.max_tokens = max_tokens  # the model's context (absolute positions only)
        self.page_cap = page_cap
        self.page_table: dict[int, int] = {}  # logical page -> physical page, for the pages still held
        self.length = 0  # committed tokens: the rollback checkpoint of the step in flight
        self.parked: HostPages | None = None
        self._pending = 0
        self._step_pages: list[int] = []  # logical pages taken by the step in flight (provisional)
        self.q_pos = self.k_pos = self.read_slots = self._write = torch.empty(0, dtype=torch.long)

    # ---- what the model's attention reads -------------------------------------------------------------
    @property
    def rolling(self) -> bool:
        return self.policy.rolling

    @property
    def write_slots(self) -> torch.Tensor:
        """The slots [T] the planned step (after `begin`) writes its keys and values to."""
        return self._write

    @property
    def held_pages(self) -> list[int]:
        return list(self.page_table.values())

    def _slots(self, start: int, end: int) -> torch.Tensor:
        """Logical positions [start, end) -> flat slot ids [end - start] in the pool storage viewed as
        [num_pages * P, KVH, hd]. One page-table lookup per page, not per token."""
        if end <= start:
            return torch.empty(0, dtype=torch.long, device=self.pool.device)
        P = self.pool.page_size
        lo = start // P
        table = torch.tensor([self.page_table[j] for j in range(lo, (end - 1) // P + 1)], dtype=torch.long)
        pos = torch.arange(start, end, dtype=torch.long)
        return (table[pos // P - lo] * P + pos % P).to(self.pool.device)

    def begin(self, n: int) -> None:
        """Prepare a step of n tokens after the committed ones: take the pages it needs, plan its reads."""
        if self.parked is not None:
            raise RuntimeError("internal: a parked session must be unparked before a step")
        start, end = self.length, self.length + n
        if not self.rolling and end > self.max_tokens:
            raise ContextLengthError(f"{end} tokens exceed the model's context of {self.max_tokens}; "
                                     "open the session with a window (rolling positions) for endless streams")
        missing = self._missing_pages(start, end)
        if self.page_cap is not None and len(self.page_table) + len(missing) > self.page_cap:
            raise PageCapError(f"this step needs {len(self.page_table) + len(missing)} pages, over the session's "
                               f"cap of {self.page_cap}; use a window or rewind")
        taken = self.pool.allocator.alloc(len(missing))  # CapacityError: nothing taken
        self.page_table.update(zip(missing, taken, strict=True))
        self._step_pages, self._pending = missing, n
        try:  # the keys this step reads: [sinks | from the first query's window on], this step's own included
            first = min(self.policy.first_needed(start), end)
            n_sink = min(self.policy.sinks, first)
            dev = self.pool.device
            self.q_pos = torch.arange(start, end, device=dev)
            self.k_pos = torch.cat([torch.arange(n_sink), torch.arange(first, end)]).to(dev)
            self.read_slots = torch.cat([self._slots(0, n_sink), self._slots(first, end)])  # [S], like k_pos
            self._write = self.read_slots[-n:]
        except BaseException:
            self.abort()  # a step that cannot be planned takes nothing
            raise

    def _missing_pages(self, start: int, end: int) -> list[int]:
        """The logical pages positions [start, end) need that the session does not hold."""
        P = self.pool.page_size
        return [j for j in range(start // P, (end + P - 1) // P) if j not in self.page_table]

    def check_fits(self, n: int) -> None:
        """PageCapError unless n more tokens fit under the page cap (sessions without a window; with one,
        pages outside it go back as the tokens come)."""
        if self.page_cap is None or self.policy.window is not None:
            return
        total = len(self.page_table) + len(self._missing_pages(self.length, self.length + n))
        if total > self.page_cap:
            raise PageCapError(f"{n} more tokens need {total} KV pages, over the session's cap of {self.page_cap}; "
                               "use a window or rewind")

    def pages_needed(self, n: int) -> int:
        """How many free pool pages a step of n tokens (or bringing a parked session back) takes."""
        if self.parked is not None:
            return len(self.parked.logical) + len(self._missing_pages(self.length, self.length + n))
        return len(self._missing_pages(self.length, self.length + n))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> PagedKeys:
        """Store this step's k, v [T, KVH, hd] in their slots; -> the layer's pages and the slots of the keys
        at positions `k_pos` (this step's included) for attention to read."""
        kf = self.pool.k[layer].view(-1, self.pool.num_kv_heads, self.pool.head_dim)
        vf = self.pool.v[layer].view(-1, self.pool.num_kv_heads, self.pool.head_dim)
        kf.index_copy_(0, self._write, k.to(kf.dtype))
        vf.index_copy_(0, self._write, v.to(vf.dtype))
        return PagedKeys(kf, vf, self.read_slots, self.k_pos)

    def commit(self, drop: bool = True) -> None:
        """The step's tokens join the session. `drop=False` keeps the pages that fell outside the window
        (a draft verification truncates its rejected tokens first, then calls `drop_outside_window`)."""
        self.length += self._pending
        self._pending, self._step_pages = 0, []
        if drop:
            self.drop_outside_window()

    def abort(self) -> None:
        """Undo a step that failed: its pages go back, the committed state is untouched."""
        self.pool.allocator.release([self.page_table.pop(j) for j in self._step_pages])
        self._pending, self._step_pages = 0, []

    def drop_outside_window(self) -> None:
        if self.policy.window is None:
            return
        P = self.pool.page_size
        first = self.policy.first_needed(self.length)
        sink_pages = (self.policy.sinks + P - 1) // P
        drop = [j for j in self.page_table if j >= sink_pages and (j + 1) * P <= first]
        self.pool.allocator.release([self.page_table.pop(j) for j in drop])

    # ---- rewind ---------------------------------------------------------------------------------------
    def check_rewind(self, to: int) -> None:
        if isinstance(to, bool) or not isinstance(to, int):
            raise RewindError(f"rewind position must be an int, got {to!r}")
        if not 0 <= to <= self.length:
            raise RewindError(f"cannot rewind to {to}: the session holds positions 0..{self.length}")
        P = self.pool.page_size
        first = self.policy.first_needed(to)
        needed = range(first // P, (to + P - 1) // P) if to > first else range(0)
        held = self.page_table if self.parked is None else set(self.parked.logical)  # parked: checked as is
        if any(j not in held for j in needed):
            raise RewindError(f"cannot rewind to {to}: the window already dropped tokens a query there would "
                              f"see (the oldest kept non-sink position is {self.oldest_kept()})")

    def can_rewind(self, to: int) -> bool:
        """Whether `check_rewind(to)` passes."""
        try:
            self.check_rewind(to)
        except RewindError:
            return False
        return True

    def oldest_kept(self) -> int:
        P, sink_pages = self.pool.page_size, (self.policy.sinks + self.pool.page_size - 1) // self.pool.page_size
        rest = [j for j in (self.page_table if self.parked is None else self.parked.logical) if j >= sink_pages]
        return min(rest) * P if rest else self.length

    def truncate(self, to: int) -> None:
        """Forget positions >= `to` (checked with `check_rewind` first); whole pages past it go back."""
        self.check_rewind(to)
        P = self.pool.page_size
        drop = [j for j in self.page_table if j * P >= to]
        self.pool.allocator.release([self.page_table.pop(j) for j in drop])
        self.length = to

    # ---- host copies: parking and snapshots -----------------------------------------------------------
    def to_host(self) -> HostPages:
        logical = sorted(self.page_table)
        idx = torch.tensor([self.page_table[j] for j in logical], dtype=torch.long, device=self.pool.device)
        return HostPages(logical, [t.index_select(0, idx).cpu() for t in self.pool.k],
                         [t.index_select(0, idx).cpu() for t in self.pool.v])

    def check_host(self, host: HostPages) -> None:
        """ValueError unless `host` has this pool's layers and page shape, one page per logical number."""
        pool, n = self.pool, len(host.logical)
        shape = (n, pool.page_size, pool.num_kv_heads, pool.head_dim)
        if len(host.k) != pool.num_layers or len(host.v) != pool.num_layers:
            raise ValueError(f"{len(host.k)} layers of keys for a pool of {pool.num_layers}")
        bad = [tuple(t.shape) for t in host.k + host.v if tuple(t.shape) != shape]
        if bad or len(set(host.logical)) != n or any(j < 0 for j in host.logical):
            raise ValueError(f"pages of shape {bad[:1] or '?'} or page numbers {host.logical[:4]}..., "
                             f"expected {list(shape)} and distinct page numbers")

    def load_host(self, host: HostPages) -> None:
        """Take pages for `host` from the pool (CapacityError: nothing taken) and copy it in."""
        self.check_host(host)
        pages = self.pool.allocator.alloc(len(host.logical))
        try:
            idx = torch.tensor(pages, dtype=torch.long, device=self.pool.device)
            for dst, src in zip(self.pool.k + self.pool.v, host.k + host.v, strict=True):
                dst.index_copy_(0, idx, src.to(device=dst.device, dtype=dst.dtype))
        except BaseException:
            self.pool.allocator.release(pages)
            raise
        self.page_table = dict(zip(host.logical, pages, strict=True))

    def park(self) -> None:
        """Move the held pages to host memory and give them back to the pool."""
        if self.parked is None:
            host = self.to_host()
            self.release()
            self.parked = host

    def unpark(self) -> None:
        if self.parked is not None:
            self.load_host(self.parked)
            self.parked = None

    def release(self) -> None:
        """Give every held page back (close, expiry, park). Safe to call twice."""
        self.pool.allocator.release(list(self.page_table.values()))
        self.page_table = {}
        self._pending, self._step_pages = 0, []
