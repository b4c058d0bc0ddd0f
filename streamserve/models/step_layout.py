"""How one forward's tokens split into sessions, shared by every layer: each session's RoPE rotations and, for the
sessions of a step that run only a few tokens, their reads batched into one attention call (absolute positions:
`AttentionBatch`; rolling positions: `RollingBatch`; the Triton block-table kernel: `BlockBatch`). Planned once per
forward by `LayoutPlanner.plan` (CausalLM.forward_batch)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, NamedTuple

import torch

from streamserve.kernels.reference import AttentionBatch, RollingRope
from streamserve.kernels.rolling_batch import RollingBatch
from streamserve.models.batched_reads import block_reads, padded_reads, rolling_reads
from streamserve.models.config import ModelConfig
from streamserve.models.layer_kv import LayerKV
from streamserve.models.ops import Ops

if TYPE_CHECKING:  # the block-table kernel's module imports triton: only the Triton backend loads it
    from streamserve.kernels.batch_attention import BlockBatch

NO_POSITION = 1 << 62  # a key position past every query (padding), and "no window"
BATCH_MAX_QUERIES = 16  # sessions running at most this many tokens share one padded attention call


class Rope(NamedTuple):
    cos: torch.Tensor  # [T, hd] for this step's absolute positions (absolute mode)
    sin: torch.Tensor
    rolling: list[RollingRope | None] | None  # rolling mode: per layer group, its keys' rotations inside the cache


class StepRopes(NamedTuple):
    """One RoPE kind's rotations of a step, shared by every layer of that kind."""

    sessions: list[Rope]  # per session
    joint: Rope | None  # cos/sin [N, hd] when every session numbers absolute positions: one rotation for all


class StepLayout(NamedTuple):
    """How one forward's N tokens split into sessions, shared by every layer."""

    ropes: list[StepRopes]  # per RoPE kind (`ModelConfig.ropes`; a layer reads `ropes[cfg.rope_kind(layer)]`)
    starts: list[int]  # [sessions + 1] token offsets
    batched: list[int]  # absolute-position sessions of few tokens: their attention runs in one `attention_batch` call
    batch: list[AttentionBatch] | None  # per layer group: the batched sessions' padded queries and keys
    blocked: tuple[int, ...] = ()  # sessions of few tokens (absolute or rolling) in one `attention_blocks` launch
    blocks: list[BlockBatch] | None = None  # per layer group: their block tables, lengths, windows and sinks
    rope_tables: tuple[tuple[torch.Tensor, float], ...] = ()  # per RoPE kind: (inv_freq [hd/2] fp32, scaling)
    rolled: tuple[int, ...] = ()  # rolling-position sessions of few tokens: one `attention_rolling_batch` call
    rolling: list[list[RollingBatch | None]] | None = None  # per RoPE kind, per layer group (None: no layer there)


class LayoutPlanner:
    """Plans each forward's `StepLayout` for one model (it caches which layer groups each RoPE kind has)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self._groups_of_kind: dict[tuple[int, tuple[int, ...]], list[int]] = {}

    def plan(self, kvs: list[LayerKV], dtype: torch.dtype, ops: Ops, rope_inv_freq: torch.Tensor,
             rope_scalings: tuple[float, ...]) -> StepLayout:
        """The layout of one forward over `kvs` (each session's q_pos planned): its rotations and batched reads.
        `rope_inv_freq` [kinds, hd/2] fp32 and `rope_scalings` per RoPE kind (the model's, on its device)."""
        return _Planning(self, ops, rope_inv_freq, rope_scalings).layout(kvs, dtype)

    def kind_groups(self, kind: int, layer_group: tuple[int, ...]) -> list[int]:
        """The layer groups that have layers of RoPE kind `kind` (rolling rotations are made for those only)."""
        key = (kind, layer_group)
        if key not in self._groups_of_kind:
            self._groups_of_kind[key] = sorted({g for layer, g in enumerate(layer_group)
                                                if self.cfg.rope_kind(layer) == kind})
        return self._groups_of_kind[key]


class _Planning:
    """One forward's planning (no state kept: the compile thread and the engine thread may plan at once)."""

    def __init__(self, planner: LayoutPlanner, ops: Ops, rope_inv_freq: torch.Tensor,
                 rope_scalings: tuple[float, ...]) -> None:
        self.planner, self.ops, self.rope_inv_freq, self.rope_scalings = planner, ops, rope_inv_freq, rope_scalings

    def layout(self, kvs: list[LayerKV], dtype: torch.dtype) -> StepLayout:
        starts = [0, *itertools.accumulate(kv.q_pos.shape[0] for kv in kvs)]
        joint = len(kvs) > 1 and not any(kv.rolling for kv in kvs)
        rolled: tuple[int, ...] = ()
        if self.ops.attention_rolling_batch is not None and self.ops.attention_blocks is None:
            rolled = tuple(i for i, kv in enumerate(kvs) if kv.rolling and kv.q_pos.shape[0] <= BATCH_MAX_QUERIES)
            rolled = rolled if len(rolled) > 1 else ()
        ropes = [self._step_ropes(kind, kvs, dtype, joint, set(rolled)) for kind in range(len(self.rope_scalings))]
        rolling = self._rolling_reads(kvs, starts, rolled, dtype) if rolled else None
        if self.ops.attention_blocks is not None:
            blocked = [i for i, kv in enumerate(kvs) if kv.q_pos.shape[0] <= BATCH_MAX_QUERIES]
            # graph replays hand in static buffers without page tables: they keep the per-session kernels
            if blocked and all(hasattr(g, "table") for i in blocked for g in kvs[i].groups):
                part, at = [kvs[i] for i in blocked], [starts[i] for i in blocked]
                tables = tuple((self.rope_inv_freq[kind], scaling) for kind, scaling in enumerate(self.rope_scalings))
                return StepLayout(ropes, starts, [], None, tuple(blocked),
                                  [block_reads(part, at, g) for g in range(len(kvs[0].groups))], tables)
        if len(kvs) == 1:
            return StepLayout(ropes, starts, [], None)
        batched = [i for i, kv in enumerate(kvs) if not kv.rolling and kv.q_pos.shape[0] <= BATCH_MAX_QUERIES]
        if self.ops.attention_batch is None or len(batched) < 2:
            return StepLayout(ropes, starts, [], None, rolled=rolled, rolling=rolling)
        part, at = [kvs[i] for i in batched], [starts[i] for i in batched]
        return StepLayout(ropes, starts, batched,
                          [padded_reads(part, at, g, NO_POSITION) for g in range(len(kvs[0].groups))],
                          rolled=rolled, rolling=rolling)

    def _rolling_reads(self, kvs: list[LayerKV], starts: list[int], rolled: tuple[int, ...], dtype: torch.dtype
                       ) -> list[list[RollingBatch | None]]:
        """The rolled sessions' batched reads and rotations, per RoPE kind and layer group (where that kind has
        layers in that group)."""
        part, at = [kvs[i] for i in rolled], [starts[i] for i in rolled]
        out: list[list[RollingBatch | None]] = []
        for kind, scaling in enumerate(self.rope_scalings):
            groups = set(self.planner.kind_groups(kind, kvs[0].layer_group))
            out.append([rolling_reads(part, at, g, self.rope_inv_freq[kind], scaling, dtype, NO_POSITION)
                        if g in groups else None for g in range(len(kvs[0].groups))])
        return out

    def _step_ropes(self, kind: int, kvs: list[LayerKV], dtype: torch.dtype, joint: bool,
                    rolled: set[int] | None = None) -> StepRopes:
        """RoPE kind `kind`'s rotations of every session of the step (and their concatenation if `joint`); the
        `rolled` sessions' come with their batched reads instead (`_rolling_reads`)."""
        groups = self.planner.kind_groups(kind, kvs[0].layer_group)
        ropes = [self._rope(kind, kv, dtype, [] if rolled and i in rolled else groups) for i, kv in enumerate(kvs)]
        if not joint:
            return StepRopes(ropes, None)
        return StepRopes(ropes, Rope(torch.cat([r.cos for r in ropes]), torch.cat([r.sin for r in ropes]), None))

    def _rope(self, kind: int, kv: LayerKV, dtype: torch.dtype, groups: list[int]) -> Rope:
        """The rotations of one session's step with RoPE kind `kind`, shared by every layer of that kind
        (rolling: per layer group in `groups`, each over the keys that group reads)."""
        ops = self.ops
        inv_freq, scaling = self.rope_inv_freq[kind], self.rope_scalings[kind]  # [hd/2] fp32
        if kv.rolling:  # rotations happen inside attention
            assert kv.policy.window is not None
            empty = torch.empty(0, dtype=dtype, device=kv.q_pos.device)
            rolling: list[RollingRope | None] = [None] * len(kv.groups)
            for g in groups:
                rolling[g] = ops.rolling_rope(kv.q_pos, kv.groups[g].k_pos, inv_freq, scaling, kv.policy.sinks,
                                              kv.policy.window, dtype)
            return Rope(empty, empty, rolling)
        cos, sin = ops.rope_cos_sin(kv.q_pos, inv_freq, scaling, dtype)  # [T, hd]
        return Rope(cos, sin, None)
