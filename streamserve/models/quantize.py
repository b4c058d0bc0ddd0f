"""Quantizing a loaded `CausalLM` in place: which weights, to what, and the MoE experts.

Modes (`EngineConfig.quantize`):
    auto  a GGUF file keeps what it stores: Q4_0/Q4_1/Q4_K projections become 4-bit with the file's own codes,
          other quantized types (Q8_0, Q5, Q6) int8 per channel, float tensors stay float; a safetensors
          checkpoint stays as stored
    none  every weight dequantized to the model dtype (transformers' numbers: the parity tests' mode)
    int8  every projection, the experts and the LM head int8 per output channel
    int4  the same in 4-bit groups of 32 (int8 where the input width is not a multiple of 32)

What stays float in every mode: embeddings (a lookup reads one row a token), norms, the MoE router (tiny, and
routing flips are what quantization noise hurts most). The LM head is quantized on its own copy of a tied
embedding table.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamserve.errors import InvalidInputError
from streamserve.models.quant import GROUP, QuantLinear, QuantWeight, quantize_int4, quantize_int8, quantize_linear

log = logging.getLogger("streamserve")

QUANTIZE_MODES = ("auto", "none", "int8", "int4")
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
GRID_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
Grid = tuple[torch.Tensor, torch.Tensor]
# (bits, grid) per quantizable weight, or None: keep float
Choice = tuple[int, Grid | None] | None


class QuantExperts(nn.Module):
    """E experts' gate|up [E, 2I, D] and down [E, D, I] quantized per expert (canonical forms stacked on dim 0).

    forward(x [T, D], weights [T, k] fp32, ids [T, k]) -> [T, D]: on a CUDA device with int8 and at most 16
    tokens, the MoE gemv kernel's int8 path; elsewhere each hit expert once over its tokens through
    `QuantLinear` (one host sync for the ids, as the CPU reference's grouped path)."""

    def __init__(self, gate_up: list[QuantWeight], down: list[QuantWeight]) -> None:
        super().__init__()
        self.bits = gate_up[0].bits
        self.gate_up = nn.ModuleList(QuantLinear(q) for q in gate_up)
        self.down = nn.ModuleList(QuantLinear(q) for q in down)
        self._stacked: tuple[torch.Tensor, ...] | None = None

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        self._stacked = None
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self.bits == 8 and x.shape[0] <= 16 and all(m.bits == 8 for m in self.down):
            from streamserve.kernels.moe_gemv import moe_gemv

            if self._stacked is None:  # [E, 2I, D], [E, D, I] int8 and [E, N] scales, built once per device
                gu, dn = list(self.gate_up), list(self.down)
                self._stacked = (torch.stack([m.qweight for m in gu]), torch.stack([m.qweight for m in dn]),
                                 torch.stack([m.scale[:, 0] for m in gu]), torch.stack([m.scale[:, 0] for m in dn]))
            wgu, wd, sgu, sd = self._stacked
            return moe_gemv(x, weights, ids.to(torch.int32), wgu, wd, scale_gate_up=sgu, scale_down=sd)
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.gate_up)).tolist()
        token_of = order // k
        xs = x.index_select(0, token_of)  # [T*k, D]
        y = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gu = self.gate_up[e](xs[start:start + n])  # [n, 2I]
                g, u = gu.chunk(2, dim=-1)
                y[start:start + n] = self.down[e](F.silu(g) * u)
                start += n
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of, y.float() * weights.reshape(-1)[order, None])
        return out.to(x.dtype)


def check_mode(mode: str) -> str:
    if mode not in QUANTIZE_MODES:
        raise InvalidInputError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}; got {mode!r}")
    return mode


def choose(mode: str, stored: Sequence[str] | None, grids: Sequence[Grid | None]) -> Choice:
    """What one weight becomes. `stored`: the GGUF types of the tensors it is made of (None: safetensors);
    `grids`: their 4-bit grids (gguf/grids.py), in the order they are concatenated."""
    exact = stored is not None and bool(stored) and all(t in GRID_TYPES for t in stored) and \
        all(g is not None for g in grids)
    grid = (torch.cat([g[0] for g in grids]), torch.cat([g[1] for g in grids])) if exact else None  # type: ignore[index]
    if mode == "int8":
        return 8, None
    if mode == "int4":
        return 4, grid
    if mode == "auto" and stored is not None:
        if exact:
            return 4, grid
        if any(t not in FLOAT_TYPES for t in stored):
            return 8, None
    return None


def quantize_model(model: nn.Module, mode: str, source: Callable[[str], tuple[Sequence[str] | None,
                                                                              Sequence[Grid | None]]]) -> str:
    """Quantize `model` (a CausalLM) in place. `source(param_name)` -> (stored types, grids) of the checkpoint
    tensors that filled that parameter (see `choose`). -> a one-line summary of what was done (logged)."""
    check_mode(mode)
    done: Counter[str] = Counter()
    if mode == "none":
        return "weights not quantized"
    for name, module in list(model.named_modules()):
        for attr in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(module, attr, None)
            if isinstance(lin, nn.Linear):
                choice = choose(mode, *source(f"{name}.{attr}.weight"))
                if choice is not None:
                    setattr(module, attr, _linear(lin, choice, done))
        if hasattr(module, "experts_gate_up") and getattr(module, "experts_gate_up", None) is not None:
            choice = choose(mode, *source(f"{name}.experts_gate_up"))
            if choice is not None:
                _experts(module, choice[0], done)
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    if isinstance(head, nn.Linear):
        tied = embed is not None and head.weight is embed.weight
        choice = choose(mode, *source("embed_tokens.weight" if tied else "lm_head.weight"))
        if choice is not None:
            model.lm_head = _linear(head, choice, done)  # a tied table stays float for the lookups
    summary = ", ".join(f"{n} {kind}" for kind, n in sorted(done.items())) or "nothing to quantize"
    if done:
        model.quantization = mode  # what `quantized_mode` reports (stats, the snapshot fingerprint)
    log.info("quantized (%s): %s", mode, summary)
    return summary


def _linear(lin: nn.Linear, choice: tuple[int, Grid | None], done: Counter[str]) -> QuantLinear:
    bits, grid = choice
    q = quantize_linear(lin, bits, grid)  # int8 where the input width does not split into int4 groups
    done[f"int{q.bits}{' (file codes)' if grid is not None and q.bits == 4 else ''}"] += 1
    return q


def _experts(moe: Any, bits: int, done: Counter[str]) -> None:
    gu, dn = moe.experts_gate_up.detach(), moe.experts_down.detach()  # [E, 2I, D], [E, D, I]
    b_gu = 4 if bits == 4 and gu.shape[2] % GROUP == 0 else 8
    b_dn = 4 if bits == 4 and dn.shape[2] % GROUP == 0 else 8
    def q(w: torch.Tensor, b: int) -> QuantWeight:
        return quantize_int4(w) if b == 4 else quantize_int8(w)
    moe.quant = QuantExperts([q(w, b_gu) for w in gu], [q(w, b_dn) for w in dn])
    moe.experts_gate_up = None  # the float copies go: the experts are read only through `quant`
    moe.experts_down = None
    done[f"int{min(b_gu, b_dn)} expert sets"] += 1


def quantized_mode(model: nn.Module) -> str:
    """The mode that quantized `model`'s weights ("none": all float)."""
    return str(getattr(model, "quantization", "none"))


def parameter_count(model: nn.Module) -> int:
    """Float parameters plus the weights held quantized (each counted once, whatever its bits)."""
    tied = getattr(getattr(model, "cfg", None), "tie_word_embeddings", False)
    head = getattr(model, "lm_head", None) if tied else None  # a tied head's copy: its table is counted already
    quantized = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantLinear)
                    and m is not head)
    return sum(p.numel() for p in model.parameters()) + quantized


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the weights a decode token reads: {"quantized": codes and scales, "float": float matrices
    (embedding tables excluded: a token reads one row)}."""
    out = {"quantized": 0, "float": 0}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            out["quantized"] += module.weight_bytes
        elif isinstance(module, nn.Linear):
            out["float"] += module.weight.numel() * module.weight.element_size()
        for name in ("experts_gate_up", "experts_down"):  # float MoE experts (a token reads k of E: counted whole)
            w = getattr(module, name, None)
            if isinstance(w, torch.Tensor):
                out["float"] += w.numel() * w.element_size()
    return out


def sources_from(checkpoint: Any, layouts: Mapping[str, Sequence[Any]]) -> Callable[
        [str], tuple[Sequence[str] | None, Sequence[Grid | None]]]:
    """`quantize_model`'s `source` for a loaded checkpoint: `layouts` {param name: pieces} from the loader."""
    def source(param: str) -> tuple[Sequence[str] | None, Sequence[Grid | None]]:
        pieces = layouts.get(param, [])
        if not hasattr(checkpoint, "stored_types") or not pieces:
            return None, []
        types = [t.name for p in pieces for t in checkpoint.stored_types(p.name)]
        return types, [checkpoint.grid(p.name) for p in pieces]
    return source
