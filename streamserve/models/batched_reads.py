"""The reads of a step's batched sessions, built once per step and shared by every layer of a layer group:
`block_reads` (block tables, lengths, windows and sinks for the Triton block-table kernel), `padded_reads`
(padded query rows and key slots for the torch reference's batched attention) and `rolling_reads` (the same for
rolling sessions, with their rotations)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from streamserve.kernels.reference import AttentionBatch
from streamserve.kernels.rolling_batch import RollingBatch, rolling_batch_rope
from streamserve.models.layer_kv import LayerKV

if TYPE_CHECKING:
    from streamserve.kernels.batch_attention import BlockBatch


def block_reads(kvs: list[LayerKV], starts: list[int], group: int) -> BlockBatch:
    """The block tables, lengths, windows and sinks of a few sessions' reads of layer group `group` (built once
    per step from the page tables `GroupKV.plan` read; kernels/batch_attention.py)."""
    from streamserve.kernels.batch_attention import block_batch

    reads = [kv.groups[group] for kv in kvs]
    pool = reads[0].pool  # type: ignore[attr-defined]
    return block_batch([r.table for r in reads], [r.end for r in reads],  # type: ignore[attr-defined]
                       [r.first for r in reads], [r.sinks for r in reads],  # type: ignore[attr-defined]
                       [kv.policy.window for kv in kvs], [kv.rolling for kv in kvs],
                       [kv.q_pos.shape[0] for kv in kvs], pool.page_size, base=reads[0].base,  # type: ignore
                       q_starts=starts, device=kvs[0].q_pos.device)

def padded_reads(kvs: list[LayerKV], starts: list[int], group: int, no_position: int) -> AttentionBatch:
    """The padded query and key lists of a few sessions' steps, shared by every layer of `group` (keys past the
    end at `no_position`, masked as future keys)."""
    reads = [kv.groups[group] for kv in kvs]
    dev = reads[0].k_pos.device
    widths = [kv.q_pos.shape[0] for kv in kvs]
    tq, longest = max(widths), max(r.k_pos.shape[0] for r in reads)
    q_rows = torch.tensor([[a + min(j, w - 1) for j in range(tq)] for a, w in zip(starts, widths, strict=True)],
                          dtype=torch.long, device=dev)
    out_rows = torch.tensor([i * tq + j for i, w in enumerate(widths) for j in range(w)], device=dev)
    q_pos = torch.stack([kv.q_pos[torch.arange(tq, device=dev).clamp(max=w - 1)]
                         for kv, w in zip(kvs, widths, strict=True)])
    slots = torch.zeros(len(kvs), longest, dtype=torch.long, device=dev)
    k_pos = torch.full((len(kvs), longest), no_position, dtype=torch.long, device=dev)
    for i, r in enumerate(reads):
        n = r.k_pos.shape[0]
        slots[i, :n], k_pos[i, :n] = r.read_slots, r.k_pos
    pols = [kv.policy for kv in kvs]
    return AttentionBatch(q_rows, q_pos, slots, k_pos, torch.tensor([p.sinks for p in pols], device=dev),
                          torch.tensor([no_position if p.window is None else p.window for p in pols], device=dev),
                          out_rows)


def rolling_reads(kvs: list[LayerKV], starts: list[int], group: int, inv_freq: torch.Tensor, scaling: float,
                  dtype: torch.dtype, no_position: int) -> RollingBatch:
    """The padded queries, keys and rotations of a few rolling sessions' steps for layer group `group` and one
    RoPE kind (`inv_freq` [hd/2], `scaling`), shared by every layer of both (kernels/rolling_batch.py)."""
    plain = padded_reads(kvs, starts, group, no_position)
    windows = torch.tensor([kv.policy.window for kv in kvs], device=plain.k_pos.device)
    rot = rolling_batch_rope(plain.q_pos, plain.k_pos, plain.sinks, windows, inv_freq, scaling, dtype, no_position)
    return RollingBatch(plain.q_rows, plain.q_pos, plain.slots, plain.k_pos, plain.sinks, windows, plain.out_rows,
                        *rot)
