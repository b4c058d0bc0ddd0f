"""One session's keys and values on the global paged pool.

The session has one page table per layer group (`group_kv.GroupKV`; one group unless the model mixes
native windows, as Gemma 3's local and global layers do), each mapping logical pages (tokens
[j*P, (j+1)*P)) to pool pages. A step (`begin` -> one `update` per layer -> `commit` or `abort`) writes its
T new tokens into their slots in every group and reads back, per group, only the slots its queries may
see: the sinks and the window (or everything without a window), narrowed to the group's native window.
Nothing already cached is recomputed, moved or copied. After a commit, pages that fell wholly outside
what a group keeps (`[sinks | window]`, and for a local group its native window plus the pool's rewind
reach) go back to the pool; after an abort, the pages the step took go back and the session is exactly as
before (the committed length is the rollback checkpoint).
"""

from __future__ import annotations

import torch

from streamserve.errors import ContextLengthError, PageCapError, RewindError
from streamserve.kernels.reference import PagedKeys
from streamserve.sessions.group_kv import GroupKV
from streamserve.sessions.policy import WindowPolicy
from streamserve.sessions.pool import KVPool


class HostPages:
    """A session's held pages copied to host memory: per layer group the logical page numbers, per layer the
    keys/values [n, P, KVH, hd] (n: the pages of the layer's group)."""

    def __init__(self, logical: list[list[int]], k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.logical, self.k, self.v = logical, k, v

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def count(self) -> int:
        """Pages of every group."""
        return sum(len(g) for g in self.logical)


class PagedSessionKV:
    def __init__(self, pool: KVPool, policy: WindowPolicy, max_tokens: int, page_cap: int | None = None) -> None:
        """`page_cap`: the most pages the session may hold in each layer group."""
        self.pool, self.policy = pool, policy
        self.max_tokens = max_tokens  # the model's context (absolute positions only)
        self.page_cap = page_cap
        self.groups = [GroupKV(pool, g, policy) for g in range(len(pool.groups))]
        self.layer_group = pool.layer_group  # layer -> index into `groups`
        self.length = 0  # committed tokens: the rollback checkpoint of the step in flight
        self.parked: HostPages | None = None
        self._pending = 0
        self.q_pos = torch.empty(0, dtype=torch.long)

    # ---- what the model's attention reads -------------------------------------------------------------
    @property
    def rolling(self) -> bool:
        return self.policy.rolling

    @property
    def k_pos(self) -> torch.Tensor:
        """Group 0's (the widest reads) key positions [S] of the planned step; `groups[g].k_pos` per group."""
        return self.groups[0].k_pos

    @property
    def read_slots(self) -> torch.Tensor:
        return self.groups[0].read_slots

    @property
    def write_slots(self) -> torch.Tensor:
        """Group 0's slots [T] the planned step (after `begin`) writes its keys and values to."""
        return self.groups[0].write

    @property
    def page_table(self) -> dict[tuple[int, int], int]:
        """Every held page, (group, logical page) -> page id (a copy: for counting and comparing)."""
        return {(g, j): p for g, grp in enumerate(self.groups) for j, p in grp.table.items()}

    @property
    def held_pages(self) -> list[int]:
        return [p for grp in self.groups for p in grp.table.values()]

    @property
    def held_count(self) -> int:
        return sum(len(grp.table) for grp in self.groups)

    @property
    def held_bytes(self) -> int:
        """Bytes of the pages held on the pool now, every layer group counted (0 while parked)."""
        return sum(len(grp.table) * self.pool.group_page_bytes(g) for g, grp in enumerate(self.groups))

    def held_in(self, group: int) -> int:
        return len(self.groups[group].table)

    def begin(self, n: int) -> None:
        """Prepare a step of n tokens after the committed ones: take the pages it needs, plan its reads."""
        if self.parked is not None:
            raise RuntimeError("internal: a parked session must be unparked before a step")
        start, end = self.length, self.length + n
        if not self.rolling and end > self.max_tokens:
            raise ContextLengthError(f"{end} tokens exceed the model's context of {self.max_tokens}; "
                                     "open the session with a window (rolling positions) for endless streams")
        missing = [grp.missing(start, end) for grp in self.groups]
        for grp, m in zip(self.groups, missing, strict=True):
            grp.check_cap(len(m), self.page_cap)
        self._pending = n
        try:  # a step that cannot get its pages (CapacityError) or be planned takes nothing
            for grp, m in zip(self.groups, missing, strict=True):
                grp.take(m)
            self.q_pos = torch.arange(start, end, device=self.pool.device)
            for grp in self.groups:
                grp.plan(start, end)
        except BaseException:
            self.abort()
            raise

    def check_fits(self, n: int) -> None:
        """PageCapError unless n more tokens fit under the page cap in the groups that keep everything
        (sessions without a window; groups that drop pages give them back as the tokens come)."""
        if self.page_cap is None:
            return
        for grp in self.groups:
            total = len(grp.table) + len(grp.missing(self.length, self.length + n))
            if not grp.drops and total > self.page_cap:
                raise PageCapError(f"{n} more tokens need {total} KV pages, over the session's cap of "
                                   f"{self.page_cap}; use a window or rewind")

    def group_pages_needed(self, n: int) -> list[int]:
        """Per group, how many free pool pages a step of n tokens (or bringing a parked session back) takes."""
        need = [len(grp.missing(self.length, self.length + n)) for grp in self.groups]
        if self.parked is not None:
            need = [a + len(b) for a, b in zip(need, self.parked.logical, strict=True)]
        return need

    def pages_needed(self, n: int) -> int:
        """How many free pool pages (of all groups) a step of n tokens (or bringing a parked session back) takes."""
        return sum(self.group_pages_needed(n))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> PagedKeys:
        """Store this step's k, v [T, KVH, hd] in their slots of the layer's group; -> the layer's pages and the
        slots of the keys at the group's `k_pos` (this step's included) for attention to read."""
        grp = self.groups[self.layer_group[layer]]
        kf, vf = self.pool.k_slots[layer], self.pool.v_slots[layer]  # [pages * P, KVH, hd]
        # (`.to` only where the pool's dtype differs: a call costs microseconds, and a decode makes two per layer)
        kf.index_copy_(0, grp.write, k if k.dtype == kf.dtype else k.to(kf.dtype))
        vf.index_copy_(0, grp.write, v if v.dtype == vf.dtype else v.to(vf.dtype))
        return PagedKeys(kf, vf, grp.read_slots, grp.k_pos)

    def commit(self, drop: bool = True) -> None:
        """The step's tokens join the session. `drop=False` keeps the pages that fell outside the window
        (a draft verification truncates its rejected tokens first, then calls `drop_outside_window`)."""
        self.length += self._pending
        self._pending = 0
        for grp in self.groups:
            grp.step_pages = []
        if drop:
            self.drop_outside_window()

    def abort(self) -> None:
        """Undo a step that failed: its pages go back, the committed state is untouched."""
        for grp in self.groups:
            grp.abort()
        self._pending = 0

    def drop_outside_window(self) -> None:
        for grp in self.groups:
            grp.drop(self.length)

    # ---- rewind ---------------------------------------------------------------------------------------
    def check_rewind(self, to: int) -> None:
        if isinstance(to, bool) or not isinstance(to, int):
            raise RewindError(f"rewind position must be an int, got {to!r}")
        if not 0 <= to <= self.length:
            raise RewindError(f"cannot rewind to {to}: the session holds positions 0..{self.length}")
        for g, grp in enumerate(self.groups):
            held = grp.table if self.parked is None else set(self.parked.logical[g])  # parked: checked as is
            if grp.can_read_at(to, held):
                continue
            oldest = grp.oldest_kept(list(held), self.length)
            if grp.group.keep is not None and grp.keep_first(self.length) > self.policy.first_needed(self.length):
                raise RewindError(f"cannot rewind to {to}: the model's sliding-window layers (window "
                                  f"{grp.group.window}) keep only their window plus {grp.group.reach} tokens "
                                  f"(the oldest kept position is {oldest}); rewind at most {grp.group.reach} "
                                  "tokens back, or start the engine with a larger rewind_reach")
            raise RewindError(f"cannot rewind to {to}: the window already dropped tokens a query there would "
                              f"see (the oldest kept non-sink position is {oldest})")

    def can_rewind(self, to: int) -> bool:
        """Whether `check_rewind(to)` passes."""
        try:
            self.check_rewind(to)
        except RewindError:
            return False
        return True

    def truncate(self, to: int) -> None:
        """Forget positions >= `to` (checked with `check_rewind` first); whole pages past it go back."""
        self.check_rewind(to)
        for grp in self.groups:
            grp.truncate(to)
        self.length = to

    # ---- host copies: parking and snapshots -----------------------------------------------------------
    def to_host(self) -> HostPages:
        logical = [sorted(grp.table) for grp in self.groups]
        rows = [grp.rows(lg) for grp, lg in zip(self.groups, logical, strict=True)]
        return HostPages(logical, [t.index_select(0, rows[g]).cpu() for t, g in zip(self.pool.k, self.layer_group,
                                                                                    strict=True)],
                         [t.index_select(0, rows[g]).cpu() for t, g in zip(self.pool.v, self.layer_group,
                                                                           strict=True)])

    def check_host(self, host: HostPages) -> None:
        """ValueError unless `host` has this pool's groups, layers and page shape, one page per logical number."""
        pool = self.pool
        if len(host.k) != pool.num_layers or len(host.v) != pool.num_layers:
            raise ValueError(f"{len(host.k)} layers of keys for a pool of {pool.num_layers}")
        if not isinstance(host.logical, list) or len(host.logical) != len(self.groups) or not all(
                isinstance(lg, list) and all(isinstance(j, int) and j >= 0 for j in lg) and len(set(lg)) == len(lg)
                for lg in host.logical):
            raise ValueError(f"page numbers {str(host.logical)[:40]}... are not {len(self.groups)} lists of distinct "
                             "page numbers (one per layer group)")
        for layer, g in enumerate(self.layer_group):
            shape = (len(host.logical[g]), pool.page_size, pool.num_kv_heads, pool.head_dim)
            bad = [tuple(t.shape) for t in (host.k[layer], host.v[layer]) if tuple(t.shape) != shape]
            if bad:
                raise ValueError(f"pages of shape {bad[0]} in layer {layer}, expected {list(shape)}")

    def regrouped(self, host: HostPages) -> HostPages:
        """`host` checked (ValueError) for this pool. A snapshot written before layer groups existed has one list
        of page numbers, every layer's pages [n, P, KVH, hd] following it: on a pool whose layers now form
        several groups, every group holds those pages (a local group gives back what it no longer keeps at the
        next commit). The tensors are shared, not copied."""
        if len(self.groups) > 1 and isinstance(host.logical, list) and len(host.logical) == 1:
            host = HostPages([list(host.logical[0]) for _ in self.groups], host.k, host.v)
        self.check_host(host)
        return host

    def load_host(self, host: HostPages) -> None:
        """Take pages for `host` from the pool (CapacityError: nothing taken) and copy it in."""
        self.check_host(host)
        try:
            rows = [grp.load(lg) for grp, lg in zip(self.groups, host.logical, strict=True)]
            for layer, g in enumerate(self.layer_group):
                for dst, src in ((self.pool.k[layer], host.k[layer]), (self.pool.v[layer], host.v[layer])):
                    dst.index_copy_(0, rows[g], src.to(device=dst.device, dtype=dst.dtype))
        except BaseException:
            self.release()
            raise

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
        for grp in self.groups:
            grp.release()
        self._pending = 0
