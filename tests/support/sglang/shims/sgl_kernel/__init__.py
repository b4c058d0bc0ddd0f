"""Test scaffolding: a pure-torch stand-in for the few ``sgl_kernel`` CPU ops that SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``) imports by name.

The real ``sgl_kernel`` CPU build (SGLang's sgl-kernel/csrc/cpu, for Xeons with AMX) is not on the package index,
and the ``sglang-kernel`` wheel there is CUDA-only. SGLang treats the AMX kernels as optional: it probes
``torch.ops.sgl_kernel.convert_weight_packed`` and, when that is absent (as here: this module registers no torch
ops), takes its ``forward_native`` torch paths for norms, activations, RoPE, linear layers and attention
(``--attention-backend torch_native``). What it still imports by name is below: the two ops a plain decoder-only
model runs, in plain torch, and the rest as importable names that raise when called. A name this module lacks
raises ImportError at import, so a code path that needs another kernel fails loudly instead of running a guess.

Nothing here is part of streamserve.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NoReturn

import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """Write each request's new KV slots into its row of the request-to-token table (what SGLang's Triton kernel
    ``assign_req_to_token_pool`` does on GPUs).

    req_pool_indices [B]: request b's row in req_to_token [rows, pool_len]; start_offset, end_offset [B]: request
    b's new positions are start..end-1; out_cache_loc [sum(end - start)]: the slots, request by request in batch
    order.
    """
    del pool_len  # the row length is req_to_token.shape[1]; the argument is kept for the kernel's signature
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + n].to(req_to_token.dtype)
        taken += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """Copy KV rows src_loc[i] -> tgt_loc[i] inside every layer's buffer (SGLang's KV moves).

    data_ptrs [L]: each buffer's address; strides [L]: its bytes per row; tgt_loc, src_loc [N]: row indices.
    All of a buffer's rows are read before any is written, as the Triton kernel does, so overlapping moves are safe.
    """
    srcs, tgts = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for s in srcs]
        for t, row in zip(tgts, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


def _not_shimmed(name: str) -> Callable[..., NoReturn]:
    """A kernel SGLang's CPU engine imports at module load but calls only on paths these tests do not take
    (speculative decoding, linear-attention models): importable, and raises if it is ever called."""

    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in in streamserve's SGLang test shims")

    kernel.__name__ = name
    return kernel


# Speculative decoding (EAGLE) kernels: sglang.srt.speculative.* and sglang.kernels.ops.speculative import them
# whenever the CPU engine is on, because the scheduler imports those modules.
assign_draft_cache_locs_contiguous_cpu = _not_shimmed("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _not_shimmed("assign_extend_cache_locs_cpu")
build_draft_decode_metadata_cpu = _not_shimmed("build_draft_decode_metadata_cpu")
build_tree_kernel_efficient_cpu = _not_shimmed("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _not_shimmed("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_shimmed("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _not_shimmed("rotate_input_ids_cpu")
verify_tree_greedy_cpu = _not_shimmed("verify_tree_greedy_cpu")
