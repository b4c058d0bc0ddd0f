"""CUDA-graph decode: small steps (1 to 8 sessions of 1 to 8 tokens each: batched decode and draft-verification
widths) replayed from captured graphs over fixed-size buffers.

A step's shapes change with its sessions (how many keys each reads), so each step is padded to a bucket: every
session's key list to the same next power of two (at least 64) over the longest, with padding positions past
any query (masked as "future" keys) and slot 0; a model with several layer groups (local and global layers)
has one key list, so one bucket, per group. Per (sessions, buckets, tokens per session, all-logits, window
policies) one graph is captured the first time and replayed after: the step's ids, positions and slots are
copied into the static buffers, the graph runs, the logits are copied out. Nothing in a captured step syncs to
the host (top-k ids, the rolling base and the split-KV merge all stay on the device).

Window policies are part of a graph's key because attention takes a session's position mode, window and sinks
as Python constants (`attention`, `attention_rolling`, `rolling_rope`, the batched layout's sink/window
tensors), so they are baked into a capture; sinks without a window change nothing and are left out of the key
(`policy_key`). Clients choose windows freely, so graphs serve at most `MAX_GRAPH_POLICIES` distinct
policies at a time: a step of any other policy runs eagerly (`run` returns None), and an admitted policy
gives its place (and its graphs) to a new one only after `POLICY_IDLE_RUNS` graphable steps without it
(steps refused for their policy count too, or policies of sessions long gone would hold their places for ever). A flood
of distinct windows can therefore neither grow the cache past `MAX_GRAPHS` nor force a capture per step.

On a CPU there is nothing to capture: with `cuda_graphs="on"` the same static-buffer steps run eagerly, which
is how the tests check that padding and fixed shapes change no result.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from streamserve.kernels.reference import PagedKeys
from streamserve.models import CausalLM
from streamserve.sessions import PagedSessionKV, WindowPolicy
from streamserve.sessions.group_kv import GroupKV

log = logging.getLogger("streamserve")

MIN_BUCKET = 64
MAX_GRAPH_TOKENS = 8  # the widest per-session step replayed from a graph (a draft of 7 plus the bonus token)
MAX_GRAPH_BATCH = 8  # the most sessions in a step replayed from a graph
PAD_POSITION = 1 << 62  # a key position no query reaches: masked as a future key


def bucket_for(n_keys: int) -> int:
    return max(MIN_BUCKET, 1 << (n_keys - 1).bit_length())


class StaticReads:
    """The keys one layer group reads in a step, in fixed-size buffers: positions and slots [bucket], and the
    slots [T] the step writes."""

    def __init__(self, bucket: int, tokens: int, dev: torch.device) -> None:
        self.k_pos = torch.full((bucket,), PAD_POSITION, dtype=torch.long, device=dev)
        self.read_slots = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.write = torch.zeros(tokens, dtype=torch.long, device=dev)

    def load(self, grp: GroupKV) -> None:
        n = grp.k_pos.shape[0]
        self.k_pos[:n].copy_(grp.k_pos)
        self.k_pos[n:].fill_(PAD_POSITION)
        self.read_slots[:n].copy_(grp.read_slots)
        self.read_slots[n:].zero_()
        self.write.copy_(grp.write)


class StaticStepKV:
    """A T-token step of some session, in fixed-size buffers (the `LayerKV` the model reads)."""

    def __init__(self, kv: PagedSessionKV, buckets: tuple[int, ...], tokens: int) -> None:
        dev = kv.pool.device
        self.pool, self.policy, self.rolling = kv.pool, kv.policy, kv.policy.rolling
        self.layer_group = kv.layer_group
        self.q_pos = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.groups = [StaticReads(b, tokens, dev) for b in buckets]

    @property
    def k_pos(self) -> torch.Tensor:
        return self.groups[0].k_pos

    def load(self, kv: PagedSessionKV) -> None:
        """Copy a planned step (after `kv.begin(T)`) into the buffers; the rest stays padding."""
        self.q_pos.copy_(kv.q_pos)
        for static, grp in zip(self.groups, kv.groups, strict=True):
            static.load(grp)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> PagedKeys:
        grp = self.groups[self.layer_group[layer]]
        kf = self.pool.k[layer].view(-1, self.pool.num_kv_heads, self.pool.head_dim)
        vf = self.pool.v[layer].view(-1, self.pool.num_kv_heads, self.pool.head_dim)
        kf.index_copy_(0, grp.write, k.to(kf.dtype))
        vf.index_copy_(0, grp.write, v.to(vf.dtype))
        return PagedKeys(kf, vf, grp.read_slots, grp.k_pos)


MAX_GRAPHS = 64  # captured graphs kept (least recently used dropped first)
MAX_GRAPH_POLICIES = 4  # distinct window policies served from graphs at a time; others run eagerly
POLICY_IDLE_RUNS = 1000  # graphable steps without an admitted policy before a new one may take its place

PolicyKey = tuple[str | None, int | None, int]


def policy_key(policy: WindowPolicy) -> PolicyKey:
    """What a captured step depends on of a session's policy: mode, window, and sinks (only with a window)."""
    return (policy.mode, policy.window, policy.sinks if policy.window is not None else 0)


@dataclass
class _Entry:
    kvs: list[StaticStepKV]
    ids: torch.Tensor  # [N] the sessions' tokens, concatenated
    rows: torch.Tensor | None  # [R] the rows whose logits are wanted (None: all)
    logits: torch.Tensor | None = None  # [n, V] or [N, V], written by each replay
    graph: torch.cuda.CUDAGraph | None = None
    failed: bool = False  # capture failed once: this step shape runs eagerly from now on

    def forward(self, model: CausalLM) -> torch.Tensor:
        return model.forward_batch(self.ids, self.kvs, self.rows)  # type: ignore[arg-type]


def rows_of(widths: list[int], all_rows: list[bool]) -> list[int]:
    """The rows of a batched step whose logits are wanted: every token of a session with `all_rows`, else
    its last."""
    rows, start = [], 0
    for w, f in zip(widths, all_rows, strict=True):
        rows += list(range(start, start + w)) if f else [start + w - 1]
        start += w
    return rows


def graphable(widths: list[int]) -> bool:
    """Whether a step of sessions taking these numbers of tokens can be replayed from a graph."""
    return 0 < len(widths) <= MAX_GRAPH_BATCH and all(0 < w <= MAX_GRAPH_TOKENS for w in widths)


class DecodeGraphs:
    def __init__(self, model: CausalLM, capture: bool) -> None:
        self.model, self.capture = model, capture
        self._entries: dict[tuple, _Entry] = {}
        self._policies: OrderedDict[PolicyKey, int] = OrderedDict()  # admitted policy -> last run, LRU first
        self.runs = 0  # graphable steps seen (served from graphs, or refused for their policies)
        self.created = 0  # entries built: graphs captured, or on a CPU what would have been captured

    @property
    def captured(self) -> int:
        return sum(1 for e in self._entries.values() if e.graph is not None)

    def entry_keys(self) -> list[tuple]:
        """The cached entries' keys (group 0's bucket, widths, all_rows, policy keys, the other groups' buckets),
        least recently used first."""
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
                for key in [k for k in self._entries if old in k[3]]:
                    del self._entries[key]
        for p in policies:
            self._policies[p] = self.runs
            self._policies.move_to_end(p)
        return True

    def run(self, kvs: list[PagedSessionKV], ids: list[list[int]], all_rows: list[bool]) -> torch.Tensor | None:
        """The logits of a planned step (after `kv.begin`) of the sessions `kvs` over `ids` (`graphable`
        widths): [R, V], for each session its last token, or all its tokens where `all_rows` (draft
        verification); None when the step's window policies are not served from graphs (run it eagerly).
        The caller commits or aborts each session's step."""
        widths = tuple(len(i) for i in ids)
        assert graphable(list(widths))
        policies = tuple(policy_key(kv.policy) for kv in kvs)
        self.runs += 1  # every graphable step counts, served or not: admitted policies nobody uses age out
        if not self._admit(set(policies)):
            return None
        buckets = tuple(bucket_for(max(kv.groups[g].k_pos.shape[0] for kv in kvs)) for g in range(len(kvs[0].groups)))
        key = (buckets[0], widths, tuple(all_rows), policies, buckets[1:])
        entry = self._entries.pop(key, None)  # re-inserted below: the dict's order is the LRU order
        if entry is None:
            if len(self._entries) >= MAX_GRAPHS:
                self._entries.pop(next(iter(self._entries)))
            self.created += 1
            dev = kvs[0].pool.device
            entry = _Entry([StaticStepKV(kv, buckets, w) for kv, w in zip(kvs, widths, strict=True)],
                           torch.zeros(sum(widths), dtype=torch.long, device=dev),
                           None if all(all_rows) else torch.tensor(rows_of(list(widths), all_rows), device=dev))
        self._entries[key] = entry
        for static, kv in zip(entry.kvs, kvs, strict=True):
            static.load(kv)
        entry.ids.copy_(torch.tensor([t for i in ids for t in i], dtype=torch.long))
        if not self.capture or entry.failed:
            return entry.forward(self.model)
        if entry.graph is None:
            try:
                self._capture(entry)
            except Exception as e:  # e.g. an op that syncs to the host: run this shape eagerly for good
                log.warning("CUDA graph capture failed for %s, running it eagerly: %s", key[:3], e)
                entry.failed, entry.graph = True, None
                for static, kv in zip(entry.kvs, kvs, strict=True):
                    static.load(kv)  # the failed capture may have left the buffers half-written
                return entry.forward(self.model)
        assert entry.graph is not None and entry.logits is not None
        entry.graph.replay()
        return entry.logits.clone()

    def _capture(self, entry: _Entry) -> None:
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
