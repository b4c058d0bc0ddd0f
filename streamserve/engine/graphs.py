"""CUDA-graph decode: small steps (1 to 8 tokens: decode and draft-verification widths) replayed from
captured graphs over fixed-size buffers.

A step's shapes change with the session (how many keys it reads), so each step is padded to a bucket:
the key list to the next power of two (at least 64) with padding positions past any query (masked as
"future" keys) and slot 0. Per (bucket, tokens, all-logits, window policy) one graph is captured the
first time and replayed after: the step's ids, positions and slots are copied into the static buffers,
the graph runs, the logits are copied out. Nothing in a captured step syncs to the host (top-k ids,
the rolling base and the split-KV merge all stay on the device).

On a CPU there is nothing to capture: with `cuda_graphs="on"` the same static-buffer steps run
eagerly, which is how the tests check that padding and fixed shapes change no result.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from streamserve.kernels.reference import PagedKeys
from streamserve.models import CausalLM
from streamserve.sessions import PagedSessionKV, WindowPolicy

log = logging.getLogger("streamserve")

MIN_BUCKET = 64
MAX_GRAPH_TOKENS = 8  # the widest step replayed from a graph (a draft of 7 plus the bonus token)
PAD_POSITION = 1 << 62  # a key position no query reaches: masked as a future key


def bucket_for(n_keys: int) -> int:
    return max(MIN_BUCKET, 1 << (n_keys - 1).bit_length())


class StaticStepKV:
    """A T-token step of some session, in fixed-size buffers (the `LayerKV` the model reads)."""

    def __init__(self, kv: PagedSessionKV, bucket: int, tokens: int) -> None:
        dev = kv.pool.device
        self.pool, self.policy, self.rolling = kv.pool, kv.policy, kv.policy.rolling
        self.q_pos = torch.zeros(tokens, dtype=torch.long, device=dev)
        self.k_pos = torch.full((bucket,), PAD_POSITION, dtype=torch.long, device=dev)
        self.gather = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.write = torch.zeros(tokens, dtype=torch.long, device=dev)

    def load(self, kv: PagedSessionKV) -> None:
        """Copy a planned step (after `kv.begin(T)`) into the buffers; the rest stays padding."""
        n = kv.k_pos.shape[0]
        self.q_pos.copy_(kv.q_pos)
        self.k_pos[:n].copy_(kv.k_pos)
        self.k_pos[n:].fill_(PAD_POSITION)
        self.gather[:n].copy_(kv._gather)
        self.gather[n:].zero_()
        self.write.copy_(kv._write)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> PagedKeys:
        kf = self.pool.k[layer].view(-1, self.pool.num_kv_heads, self.pool.head_dim)
        vf = self.pool.v[layer].view(-1, self.pool.num_kv_heads, self.pool.head_dim)
        kf.index_copy_(0, self.write, k.to(kf.dtype))
        vf.index_copy_(0, self.write, v.to(vf.dtype))
        return PagedKeys(kf, vf, self.gather, self.k_pos)


MAX_GRAPHS = 64  # captured graphs kept (least recently used dropped first): clients choose windows freely


@dataclass
class _Entry:
    kv: StaticStepKV
    ids: torch.Tensor  # [T]
    all_logits: bool
    logits: torch.Tensor | None = None  # [V] or [T, V], written by each replay
    graph: torch.cuda.CUDAGraph | None = None
    failed: bool = False  # capture failed once: this step shape runs eagerly from now on


class DecodeGraphs:
    def __init__(self, model: CausalLM, capture: bool) -> None:
        self.model, self.capture = model, capture
        self._entries: dict[tuple[int, int, bool, WindowPolicy], _Entry] = {}

    @property
    def captured(self) -> int:
        return sum(1 for e in self._entries.values() if e.graph is not None)

    def run(self, kv: PagedSessionKV, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """The logits ([V], or [T, V] with `all_logits`) of a planned step of `kv` over `ids`
        (1 <= T <= MAX_GRAPH_TOKENS); the caller commits or aborts it."""
        key = (bucket_for(kv.k_pos.shape[0]), len(ids), all_logits, kv.policy)
        entry = self._entries.pop(key, None)  # re-inserted below: the dict's order is the LRU order
        if entry is None:
            if len(self._entries) >= MAX_GRAPHS:
                self._entries.pop(next(iter(self._entries)))
            entry = _Entry(StaticStepKV(kv, key[0], len(ids)),
                                                torch.zeros(len(ids), dtype=torch.long, device=kv.pool.device),
                                                all_logits)
        self._entries[key] = entry
        entry.kv.load(kv)
        entry.ids.copy_(torch.tensor(ids, dtype=torch.long))
        if not self.capture or entry.failed:
            return self.model(entry.ids, entry.kv, all_logits)
        if entry.graph is None:
            try:
                self._capture(entry)
            except Exception as e:  # e.g. an op that syncs to the host: run this shape eagerly for good
                log.warning("CUDA graph capture failed for %s, running it eagerly: %s", key[:3], e)
                entry.failed, entry.graph = True, None
                entry.kv.load(kv)  # the failed capture may have left the buffers half-written
                return self.model(entry.ids, entry.kv, all_logits)
        assert entry.graph is not None and entry.logits is not None
        entry.graph.replay()
        return entry.logits.clone()

    def _capture(self, entry: _Entry) -> None:
        # warm up on a side stream (Triton compiles, allocator settles), then capture; the warm-up writes
        # this step's own key/value slot, which the replay writes again
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(entry.ids, entry.kv, entry.all_logits)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads may run eagerly
            entry.logits = self.model(entry.ids, entry.kv, entry.all_logits)
        entry.graph = graph
