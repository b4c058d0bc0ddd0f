"""CUDA-graph decode: steps of 1 to `max_batch` sessions of 1 to 8 tokens each (batched decode and
draft-verification widths) replayed from captured graphs over fixed-size buffers.

A step's shapes change with its sessions, so each step is padded to fixed shapes made only of bucketed values:

- sessions are grouped by window policy into parts (policies in a fixed order); a part of n sessions runs in
  `batch_bucket(n)` slots, the smallest of the ladder 1, 2, 4, ..., `max_batch` (`batch_buckets`) >= n;
- every session runs `W` tokens, the step's widest (1..8): a narrower session's extra rows repeat its last
  token (same id and position; their keys and values are copies of its last row's, written to its last slot,
  so the duplicate writes are identical) and their logits are dropped;
- each part's sessions read the same number of keys per layer group: the next power of two (at least 64) over
  its longest read, padded with positions no query reaches (masked as "future" keys) at slot 0.

Padding slots: a part's real sessions take its LAST slots; each padding slot before them is a copy of the
part's first real session (same ids, positions, reads and write slots), its logits dropped. Its keys and values
land in that session's write slots, which the session itself writes later in the same layer (the model runs
sessions' `update`s in slot order, every kernel on one stream), and only that session reads them, after its own
write. So padding never changes a real session's KV and needs no reserved page (any page, slot 0 included,
may belong to a real session: the allocator hands out the lowest ids first, and a page held by the graphs
would be a page no session lists, which the leak checker rejects). Warm-up (`warm_up`) runs before any
session exists: its padding writes to slot 0 of a free page and reads that key back (never an all-masked
row, which could leave NaN in the pool).

The key of a graph is (W, whether any session wants all its rows' logits, per part: its window policy, batch
bucket and key buckets): no client input enters it unbucketed, and at most `MAX_GRAPHS` entries are kept
(least recently used dropped first; the start-up warm-up's `len(batch_buckets(max_batch))` entries included).
A steady workload uses few keys: W is 1 for plain decode, each part's batch bucket is one of at most
log2(max_batch) + 2 values and its key buckets grow by doublings with the context. Window policies are part
of the key because attention takes a session's position mode, window and sinks as Python constants, baked into
a capture; sinks without a window change nothing and are left out (`policy_key`). Clients choose windows
freely, so graphs serve at most `MAX_GRAPH_POLICIES` policies at a time: a step of any other policy runs
eagerly (`run` returns None), and an admitted policy gives its place (and its graphs) to a new one only
after `POLICY_IDLE_RUNS` graphable steps without it (refused steps count too). A flood of distinct batch sizes
or windows can therefore neither grow the cache past `MAX_GRAPHS` nor force a capture per step. Per replay
the step's ids, positions, slots and logit rows are copied into the static buffers, the graph runs, the wanted
logits are gathered; nothing in a captured step syncs to the host.

On CUDA `warm_up` captures the decode graphs (W 1, the default policy, key buckets of a short context) of
every batch bucket at start-up; other shapes are captured the first time they run. On a CPU there is nothing
to capture: with `cuda_graphs="on"` the same padded static-buffer steps run eagerly, which is how the tests
check that padding and fixed shapes change no result; with `cpu_compile="on"` they run from AOTInductor-compiled code
once their shape has compiled in the background (`compiled`, engine/compiled.py). The buffers themselves are
engine/static_step.py's."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch

from streamserve.engine.static_step import (
    PAD_POSITION,
    Entry,
    GraphKey,
    Part,
    PolicyKey,
    StaticPart,
    StaticReads,
    StaticStepKV,
    build_entry,
)
from streamserve.models import CausalLM
from streamserve.sessions import KVPool, PagedSessionKV, WindowPolicy

__all__ = ["PAD_POSITION", "CompiledRunner", "DecodeGraphs", "GraphKey", "Part", "PolicyKey", "StaticPart",
           "StaticReads", "StaticStepKV", "batch_bucket", "batch_buckets", "bucket_for", "graphable", "policy_key",
           "rows_of"]

log = logging.getLogger("streamserve")

class CompiledRunner(Protocol):
    """What a CPU's compiled steps offer the graphs (engine/compiled.py's `CompiledSteps`; imports run that way)."""

    def serves(self, key: GraphKey, policies: dict[PolicyKey, WindowPolicy]) -> bool:
        """Whether shape `key` runs compiled now; if not, the step is counted (a shape seen often is queued)."""
        ...

    def run(self, entry: Entry, key: GraphKey, reload: Callable[[], object]) -> torch.Tensor:
        """The loaded entry's logits: compiled (a shape it `serves`), or eagerly if the compiled code fails."""
        ...

    def close(self) -> None:
        """Stop compiling."""
        ...


MIN_BUCKET = 64
MAX_GRAPH_TOKENS = 8  # the widest per-session step replayed from a graph (a draft of 7 plus the bonus token)
MAX_GRAPHS = 64  # captured graphs kept (least recently used dropped first)
MAX_GRAPH_POLICIES = 4  # distinct window policies served from graphs at a time; others run eagerly
POLICY_IDLE_RUNS = 1000  # graphable steps without an admitted policy before a new one may take its place
WARM_UP_SECONDS = 120.0  # start-up captures stop after this long; the rest are captured when first needed



def bucket_for(n_keys: int) -> int:
    return max(MIN_BUCKET, 1 << (n_keys - 1).bit_length())


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch ladder: powers of two below `max_batch`, then `max_batch` itself."""
    return (*[1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch], max_batch)


def batch_bucket(n: int, ladder: tuple[int, ...]) -> int:
    """The smallest bucket of the ladder that holds n sessions (n <= the ladder's last)."""
    return next(b for b in ladder if b >= n)


def policy_key(policy: WindowPolicy) -> PolicyKey:
    """What a captured step depends on of a session's policy: mode, window, and sinks (only with a window)."""
    return (policy.mode, policy.window, policy.sinks if policy.window is not None else 0)


def _policy_order(p: PolicyKey) -> tuple[str, int, int]:
    return (p[0] or "", -1 if p[1] is None else p[1], p[2])


def rows_of(widths: list[int], all_rows: list[bool]) -> list[int]:
    """The rows of a batched step whose logits are wanted: every token of a session with `all_rows`, else
    its last."""
    rows, start = [], 0
    for w, f in zip(widths, all_rows, strict=True):
        rows += list(range(start, start + w)) if f else [start + w - 1]
        start += w
    return rows


def graphable(widths: list[int]) -> bool:
    """Whether sessions taking these numbers of tokens may run from a graph (`DecodeGraphs.run` also needs at
    most `max_batch` of them, and admitted policies)."""
    return len(widths) > 0 and all(0 < w <= MAX_GRAPH_TOKENS for w in widths)


class DecodeGraphs:
    def __init__(self, model: CausalLM, capture: bool, max_batch: int = 64) -> None:
        self.model, self.capture, self.max_batch = model, capture, max_batch
        self.ladder = batch_buckets(max_batch)
        self._entries: OrderedDict[GraphKey, Entry] = OrderedDict()  # LRU first
        self._policies: OrderedDict[PolicyKey, int] = OrderedDict()  # admitted policy -> last run, LRU first
        self.runs = 0  # graphable steps seen (served from graphs, or refused for their policies)
        self.created = 0  # entries built: graphs captured, or on a CPU what would have been captured
        self.compiled: CompiledRunner | None = None  # on a CPU with cpu_compile auto or on: the compiled steps

    @classmethod
    def start(cls, model: CausalLM, pool: KVPool, max_batch: int, capture: bool) -> DecodeGraphs:
        """The engine's graphs; on CUDA the decode graphs of every batch bucket are captured now (`warm_up`)."""
        graphs = cls(model, capture, max_batch)
        if capture:
            graphs.warm_up(pool)
        return graphs

    def close(self) -> None:
        """Stop compiling (engine shutdown): the compile thread ends after the compile in progress, if any."""
        if self.compiled is not None:
            self.compiled.close()

    @property
    def captured(self) -> int:
        return sum(1 for e in self._entries.values() if e.graph is not None)

    def entry_keys(self) -> list[GraphKey]:
        """The cached entries' keys (W, all rows, parts), least recently used first."""
        return list(self._entries)

    def _admit(self, policies: set[PolicyKey]) -> bool:
        """Whether a step of these policies may use graphs: each is admitted already, or takes a free place,
        or the place of an admitted policy unused for POLICY_IDLE_RUNS graphable steps (whose graphs are
        dropped). A refused step changes nothing."""
        new = [p for p in policies if p not in self._policies]
        if new:
            free = MAX_GRAPH_POLICIES - len(self._policies)
            idle = [p for p, last in self._policies.items()  # least recently used first
                    if p not in policies and self.runs - last >= POLICY_IDLE_RUNS]
            if len(new) > free + len(idle):
                return False
            for old in idle[:max(0, len(new) - free)]:
                del self._policies[old]
                for key in [k for k in self._entries if any(part.policy == old for part in k[2])]:
                    del self._entries[key]
        for p in policies:
            self._policies[p] = self.runs
            self._policies.move_to_end(p)
        return True

    def _entry(self, key: GraphKey, pool: KVPool, policies: dict[PolicyKey, WindowPolicy]) -> Entry:
        """The cached entry of `key` (now the most recently used), or a new one (the LRU entry dropped if full)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            while len(self._entries) >= MAX_GRAPHS:
                self._entries.popitem(last=False)
            self.created += 1
            entry = build_entry(key, pool, policies)
        self._entries[key] = entry
        return entry

    def warm_up(self, pool: KVPool, policy: WindowPolicy | None = None) -> list[GraphKey]:
        """Build (on CUDA: capture) the decode graphs of every batch bucket: width 1, `policy` (default: no
        window), the smallest key bucket. Before any session exists: the padding writes land on free pages.
        -> the keys built. Stops after WARM_UP_SECONDS; the rest are captured when first needed."""
        policy = policy or WindowPolicy()
        pk = policy_key(policy)
        if not self._admit({pk}):
            return []
        keys: list[GraphKey] = []
        t0 = time.perf_counter()
        log.info("capturing decode CUDA graphs for batch buckets %s", list(self.ladder) if self.capture else [])
        for b in self.ladder:
            if time.perf_counter() - t0 > WARM_UP_SECONDS:
                log.warning("CUDA graph warm-up stopped after %.0fs at batch %d", WARM_UP_SECONDS, b)
                break
            key: GraphKey = (1, False, (Part(pk, b, (MIN_BUCKET,) * len(pool.groups)),))
            entry = self._entry(key, pool, {pk: policy})
            keys.append(key)
            if self.capture and entry.graph is None and not entry.failed:
                try:
                    self._capture(entry)
                except Exception as e:
                    log.warning("CUDA graph capture failed for batch %d, running it eagerly: %s", b, e)
                    entry.failed, entry.graph = True, None
        if self.capture:
            log.info("captured %d decode CUDA graphs in %.1fs", self.captured, time.perf_counter() - t0)
        return keys

    def run(self, kvs: list[PagedSessionKV], ids: list[list[int]], all_rows: list[bool]) -> torch.Tensor | None:
        """The logits of a planned step (after `kv.begin`) of the sessions `kvs` over `ids` (`graphable`
        widths): [R, V], for each session its last token, or all its tokens where `all_rows` (draft
        verification); None when the step runs eagerly (more than `max_batch` sessions, or window policies
        graphs do not serve now). The caller commits or aborts each session's step."""
        widths = [len(i) for i in ids]
        assert graphable(widths)
        if len(kvs) > self.max_batch:
            return None
        self.runs += 1  # every graphable step counts, served or not: admitted policies nobody uses age out
        pkeys = [policy_key(kv.policy) for kv in kvs]
        if not self._admit(set(pkeys)):
            return None
        by_policy: dict[PolicyKey, list[int]] = {}
        for i, p in enumerate(pkeys):
            by_policy.setdefault(p, []).append(i)
        order = sorted(by_policy, key=_policy_order)
        width, all_logits = max(widths), any(all_rows)
        parts = tuple(Part(p, batch_bucket(len(by_policy[p]), self.ladder),
                           tuple(bucket_for(max(kvs[i].groups[g].k_pos.shape[0] for i in by_policy[p]))
                                 for g in range(len(kvs[0].groups)))) for p in order)
        key: GraphKey = (width, all_logits, parts)
        policies = {p: kvs[by_policy[p][0]].policy for p in order}
        if self.compiled is not None and not self.capture and not self.compiled.serves(key, policies):
            return None  # not compiled (yet): the plain eager step, which reads no padded keys, is the faster one
        entry = self._entry(key, kvs[0].pool, policies)
        wanted = self._load(entry, parts, by_policy, kvs, ids, all_rows)
        logits = self._replay(entry, key, lambda: self._load(entry, parts, by_policy, kvs, ids, all_rows))
        pick = torch.tensor([r for rows in wanted for r in rows], dtype=torch.long, device=logits.device)
        return logits.index_select(0, pick)  # [R, V] in the sessions' order (a copy: the buffers are reused)

    @staticmethod
    def _load(entry: Entry, parts: tuple[Part, ...], by_policy: dict[PolicyKey, list[int]],
              kvs: list[PagedSessionKV], ids: list[list[int]], all_rows: list[bool]) -> list[list[int]]:
        """Copy the step into the entry's buffers -> per session its rows of the replay's logits."""
        width, all_logits = entry.ids.shape[0] // len(entry.kvs), entry.rows is None
        flat: list[int] = []
        wanted: list[list[int]] = [[] for _ in kvs]
        slot_rows: list[int] = []  # per slot: the row of its last token among all S * W
        slot = 0
        for part, static in zip(parts, entry.parts, strict=True):
            idx = by_policy[part.policy]
            pad = part.batch - len(idx)
            for j in range(part.batch):  # padding slots first, each a copy of the part's first session
                i = idx[max(0, j - pad)]
                w = len(ids[i])
                if j >= pad:
                    static.slots[j].load(kvs[i], w)
                flat += ids[i] + [ids[i][-1]] * (width - w)
                slot_rows.append(slot * width + w - 1)
                if j >= pad:  # logits: [S * W, V] with every row, else [S, V] with each slot's last
                    wanted[i] = (list(range(slot * width, slot * width + w)) if all_rows[i]
                                 else [slot * width + w - 1] if all_logits else [slot])
                slot += 1
            if pad:
                static.pad(pad)
        entry.ids.copy_(torch.tensor(flat, dtype=torch.long))
        if entry.rows is not None:
            entry.rows.copy_(torch.tensor(slot_rows, dtype=torch.long))
        return wanted

    def _replay(self, entry: Entry, key: GraphKey, reload: Callable[[], object]) -> torch.Tensor:
        """Run the loaded entry: eagerly (a CPU, or a shape whose capture failed) or compiled (a CPU with
        `compiled`), or from its graph (captured now the first time) -> its logits (the graph's output buffer)."""
        if not self.capture or entry.failed:
            if self.compiled is not None:  # a CPU: the shape's compiled step once it is ready, else eagerly
                return self.compiled.run(entry, key, reload)
            return entry.forward(self.model)
        if entry.graph is None:
            try:
                self._capture(entry)
            except Exception as e:  # e.g. an op that syncs to the host: run this shape eagerly for good
                log.warning("CUDA graph capture failed for %s, running it eagerly: %s", key[:2], e)
                entry.failed, entry.graph = True, None
                reload()  # the failed capture may have left the buffers half-written
                return entry.forward(self.model)
        assert entry.graph is not None and entry.logits is not None
        entry.graph.replay()
        return entry.logits

    def _capture(self, entry: Entry) -> None:
        # warm up on a side stream (Triton compiles, allocator settles), then capture; the warm-up writes
        # this step's own key/value slots, which the replay writes again
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                entry.forward(self.model)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads may run eagerly
            entry.logits = entry.forward(self.model)
        entry.graph = graph
