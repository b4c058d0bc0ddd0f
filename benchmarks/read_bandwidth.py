"""What batch-1 CPU decode is bound by: the machine's read rate and the bytes of weights one token reads.

benchmarks/cpu_decode.py gives each contender as tok/s and as the fraction of `ReadRate` it uses:
`weight_bytes_per_token` (a torch model: the engine's or transformers') or `gguf_bytes_per_token` (llama.cpp on a
GGUF file) x tok/s / the read rate measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from streamserve.models.gguf import open_gguf
from streamserve.models.quant import QuantLinear


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class ReadRate:
    """The machine's read rate, GB/s (1e9 bytes) on torch's threads, from plain passes over a `mib` MiB fp32
    tensor, sampled before the models and between their rep rounds: it sees the same load as the decodes do.

    copy (the figure the fractions use): dst.copy_(src), counted as the source's bytes read over the copy's time;
    the destination's writes (and the reads a write-allocate cache makes of it) are not counted, so it is the read
    rate of a stream that writes as much as it reads, below what reads alone reach (a decode only reads weights).
    sum: src.sum(), a read-only pass (one float add per 4 bytes, far below the compute), for reference."""

    def __init__(self, mib: int) -> None:
        self.src = torch.ones(mib * 2**20 // 4)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src), self.src.sum()  # first touch of dst's pages; warm-up of both
        self.copy_s: list[float] = []
        self.sum_s: list[float] = []

    def sample(self, reps: int) -> None:
        for _ in range(reps):
            self.copy_s.append(timed(lambda: self.dst.copy_(self.src)))
            self.sum_s.append(timed(lambda: self.src.sum()))

    def figures(self, since: int = 0) -> dict[str, Any]:
        """Medians of the samples from number `since` on."""
        gb = self.src.nbytes / 1e9
        return {"copy_read_gb_s": round(gb / statistics.median(self.copy_s[since:]), 2),
                "sum_read_gb_s": round(gb / statistics.median(self.sum_s[since:]), 2),
                "samples": len(self.copy_s) - since, "tensor_mib": round(self.src.nbytes / 2**20)}


def _read_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors a module's forward reads: its own parameters and buffers; for a quantized linear once packed
    for the CPU kernel (`cpu_weight`, `cpu_scales`: the kernel's weight and bfloat16 scales, made on its first call),
    those instead of its canonical buffers, which the CPU path no longer reads (a compiled step reads a copy of the
    same bytes that Inductor reblocked)."""
    if isinstance(module, QuantLinear) and module.cpu_weight is not None and module.cpu_scales is not None:
        read = [("cpu_weight", module.cpu_weight), ("cpu_scales", module.cpu_scales)]
        return read + ([("bias", module.bias)] if module.bias is not None else [])
    return [*module.named_parameters(recurse=False, remove_duplicate=False),
            *module.named_buffers(recurse=False, remove_duplicate=False)]


def weight_bytes_per_token(model: nn.Module, expert_fraction: float = 1.0) -> int:
    """Bytes of parameters and buffers one batch-1 decode token reads from a torch model (the engine's or
    transformers'): every tensor once (tied ones once: keyed by storage), except
    - an embedding table (`nn.Embedding`, or a module named embed_tokens): one row, unless the same tensor is also
      an output projection's weight (a tied float lm_head: then read whole, and the row too);
    - MoE expert weights (a name part starting with "experts", or inside a module whose class is named *Experts*:
      the engine's quantized `QuantExperts`, transformers' fused experts): `expert_fraction` (top_k / experts) of
      them, the share of experts one token runs through at batch 1."""
    whole: dict[tuple[int, int], float] = {}  # (data_ptr, nbytes) -> bytes read of that tensor
    rows = 0
    expert_modules = [n for n, m in model.named_modules() if "Experts" in type(m).__name__]
    for mname, module in model.named_modules(remove_duplicate=False):
        embedding = isinstance(module, nn.Embedding) or mname.rsplit(".", 1)[-1] == "embed_tokens"
        expert_module = any(mname == e or mname.startswith(f"{e}.") for e in expert_modules)
        for tname, t in _read_tensors(module):
            if t is None or t.numel() == 0:
                continue
            if embedding and t.dim() >= 2:
                rows += t.nbytes // t.shape[0]  # one token's row of a [vocab, ...] table
                continue
            expert = expert_module or any(p.startswith("experts") for p in f"{mname}.{tname}".split("."))
            whole[(t.data_ptr(), t.nbytes)] = t.nbytes * (expert_fraction if expert else 1.0)
    return rows + round(sum(whole.values()))


def gguf_bytes_per_token(path: Path, expert_fraction: float = 1.0) -> int:
    """Bytes of a GGUF file's tensors llama.cpp reads per decode token: all of them as stored (quantized blocks
    included), token_embd one row only unless the file has no output.weight (tied: it is the output projection
    too, read whole), MoE expert tensors (`_exps.` in the name) by `expert_fraction`."""
    f = open_gguf(path)
    total = 0.0
    for name, t in f.tensors.items():
        if name == "token_embd.weight":
            total += t.nbytes // t.shape[0] + (0 if "output.weight" in f.tensors else t.nbytes)
        else:
            total += t.nbytes * (expert_fraction if "_exps." in name else 1.0)
    return round(total)
