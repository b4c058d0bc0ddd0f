"""`Admission`: the KV pool's page budget. Work that needs pages gets them, parking (offloading to host
memory) the least recently active idle sessions one by one when the pool runs out; when even parking
every idle session would not free enough, it fails with `CapacityError` at once, having taken nothing and
parked nobody. A parked session comes back (`unpark`) on its next use.

Pages belong to layer groups (one unless the model mixes native windows, e.g. Gemma 3's local and global
layers): what a request needs is counted per group, and it fits only when every group has the pages."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from streamserve.engine.counters import Counters
from streamserve.engine.guard import BetweenSteps
from streamserve.engine.state import SessionState
from streamserve.engine.table import SessionTable
from streamserve.errors import CapacityError
from streamserve.sessions import KVPool, PagedSessionKV


class Admission:
    def __init__(self, pool: KVPool, table: SessionTable, guard: BetweenSteps, counters: Counters,
                 queued_sessions: Callable[[], Collection[str]], reclaim: Callable[[], None]) -> None:
        """`queued_sessions`: the ids of sessions with work queued (parked only when no other is left);
        `reclaim`: frees collected sessions' pages first (they may be all that is missing)."""
        self.pool, self.table, self.guard, self.counters = pool, table, guard, counters
        self.queued_sessions, self.reclaim = queued_sessions, reclaim

    def admit(self, state: SessionState | None, take: Callable[[], None], needed: int | Sequence[int],
              busy: Collection[PagedSessionKV] = ()) -> None:
        """Run `take` (which takes `needed` pages, per layer group when a list, or raises CapacityError having
        taken none), parking the least recently active idle sessions (never `state`, never one in `busy`:
        this step's) until it succeeds."""
        alloc = self.pool.allocator
        # one number for several groups (a caller that does not split its need): checked against the totals
        split = not isinstance(needed, int) or len(alloc.group_pages) == 1
        need = ([needed] if isinstance(needed, int) else list(needed)) if split else [needed]
        free = [alloc.free_in(g) for g in range(len(need))] if split else [alloc.free_count]
        with self.guard:
            self.reclaim()
            if all(n <= f for n, f in zip(need, free, strict=True)):  # common: no search for idle sessions
                try:
                    take()
                    return
                except CapacityError:
                    pass
            step = {id(kv) for kv in busy}
            queued = self.queued_sessions()
            idle = [s for s in self.table.states() if s is not state and not s.closed and s.kv.parked is None
                    and s.kv.held_count and id(s.kv) not in step]
            free = [alloc.free_in(g) for g in range(len(need))] if split else [alloc.free_count]
            held = [sum(s.kv.held_in(g) if split else s.kv.held_count for s in idle) for g in range(len(need))]
            short = [g for g, n in enumerate(need) if n > free[g] + held[g]]
            if short:
                g = short[0]
                where = f" of layer group {g} ({self._group_name(g)})" if len(alloc.group_pages) > 1 and split else ""
                total = alloc.group_pages[g] if split else alloc.num_pages
                raise CapacityError(f"this needs {need[g]} KV pages{where}; the pool ({total} such pages of "
                                    f"{self.pool.page_size} tokens) has {free[g]} free and not enough idle "
                                    "sessions to park: retry later, close sessions, or raise kv_memory")
            if split and len(need) > 1:  # parking a session that holds no page of a group short of pages frees none
                lacking = [g for g, n in enumerate(need) if n > free[g]]
                idle = [s for s in idle if any(s.kv.held_in(g) for g in lacking)] if lacking else idle
            idle.sort(key=lambda s: (s.id in queued, s.last_active))
            while True:
                try:
                    take()
                    return
                except CapacityError:
                    if not idle:
                        raise
                    idle.pop(0).park()
                    self.counters.sessions_parked_total += 1

    def _group_name(self, g: int) -> str:
        w = self.pool.groups[g].window
        return "full-attention layers" if w is None else f"layers with a {w}-token window"

    def unpark(self, state: SessionState, busy: Collection[PagedSessionKV] = ()) -> None:
        """Bring a parked session's KV back onto the pool (nothing when it is not parked)."""
        kv = state.kv
        if kv.parked is not None:
            self.admit(state, state.unpark, kv.group_pages_needed(0), busy)

    def begin_step(self, state: SessionState | None, kv: PagedSessionKV, n: int,
                   busy: Collection[PagedSessionKV]) -> None:
        """Plan a step of n tokens of `kv` (bringing it back first if parked), parking idle sessions not in
        `busy` when pages run out (CapacityError, having taken nothing, when that cannot help)."""
        if kv.parked is not None:
            self.admit(state, state.unpark if state is not None and state.kv is kv else kv.unpark,
                       kv.group_pages_needed(0), busy)
        self.admit(state, lambda: kv.begin(n), kv.group_pages_needed(n), busy)
