"""A fixed-shape decode step as a module of plain tensor inputs, for `torch.export` and AOTInductor: what the compile
worker (engine/compile_worker.py, a child process) compiles and the engine's compiled steps (engine/compiled.py)
call with the static buffers of one step shape (engine/static_step.py).

The inputs, in `step_inputs` order: ids [S*W], rows [S] (None: every row), then per part its [B, W] query positions
and source rows and, per layer group, its [B, keys] key positions and read slots and [B, W] write slots, then the
pool's K and V pages per layer (written in place by the step). The key count of each (part, group) is dynamic, so
one compiled step serves every key bucket of its shape."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streamserve.engine.static_step import Entry, StaticReads
from streamserve.models import CausalLM
from streamserve.sessions import KVPool, WindowPolicy
from streamserve.sessions.groups import LayerGroup

StepInputs = tuple[Any, ...]


@dataclass(frozen=True)
class ModelRecipe:
    """How the compile worker loads the engine's model again: its file or folder, dtype and quantize mode, and the
    fingerprint (engine/loading.py) that names its compiled steps in the cache."""

    path: str
    dtype: str  # "float32", "bfloat16", ...
    quantize: str
    fingerprint: str


def step_inputs(entry: Entry) -> StepInputs:
    """The tensors of `entry` (over its pool) in the exported step's argument order."""
    pool = entry.kvs[0].pool
    parts = entry.parts
    return (entry.ids, entry.rows, [p.q_pos for p in parts], [p.src for p in parts], [list(p.k_pos) for p in parts],
            [list(p.read_slots) for p in parts], [list(p.write) for p in parts], list(pool.k), list(pool.v))


def flat_inputs(entry: Entry) -> list[torch.Tensor]:
    """`step_inputs(entry)` as the compiled library takes them: its tensors in pytree order, kept on the entry (its
    buffers are loaded in place, so the list never changes). A None (rows of a step that keeps every row's logits)
    is a leaf to pytree but a constant to `torch.export`, so it is no input of the library."""
    if entry.flat_inputs is None:
        from torch.utils._pytree import tree_flatten

        entry.flat_inputs = [t for t in tree_flatten(step_inputs(entry))[0] if t is not None]
    return entry.flat_inputs


def load_step_library(path: Path) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """The compiled step in an AOTInductor library (the `.so` of a package, weights inside) -> a function of
    `flat_inputs` that returns the logits. Loading it holds Python's GIL for ~0.1 s (SmolLM2-135M)."""
    from torch._C._aoti import AOTIModelContainerRunnerCpu

    runner = AOTIModelContainerRunnerCpu(str(path), 1)

    def step(inputs: list[torch.Tensor]) -> torch.Tensor:
        return runner.run(inputs)[0]

    return step


def dynamic_shapes(entry: Entry) -> tuple[Any, ...]:
    """`torch.export`'s dynamic shapes for `step_inputs(entry)`: the key count of each (part, group), one symbol
    each (their example sizes must differ: equal sizes would be unified)."""
    from torch.export import Dim

    keys = [[Dim(f"keys_{i}_{g}", min=2, max=1 << 24) for g in range(len(p.k_pos))] for i, p in enumerate(entry.parts)]
    pool = entry.kvs[0].pool
    return (None, None, [None] * len(entry.parts), [None] * len(entry.parts),
            [[{1: d} for d in part] for part in keys], [[{1: d} for d in part] for part in keys],
            [[None] * len(p.write) for p in entry.parts], [None] * len(pool.k), [None] * len(pool.v))


class ExportedStep(torch.nn.Module):
    """`model.forward_batch` over an entry's buffers passed as plain tensors: the entry (built over a scratch pool)
    gives the structure (slots, policies, layer groups), the inputs its tensors."""

    def __init__(self, model: CausalLM, entry: Entry) -> None:
        super().__init__()
        self.model, self.entry = model, entry

    def forward(self, ids: torch.Tensor, rows: torch.Tensor | None, q_pos: list[torch.Tensor],
                src: list[torch.Tensor], k_pos: list[list[torch.Tensor]], read_slots: list[list[torch.Tensor]],
                write: list[list[torch.Tensor]], ks: list[torch.Tensor], vs: list[torch.Tensor]) -> torch.Tensor:
        pool = copy.copy(self.entry.kvs[0].pool)
        pool.k, pool.v = list(ks), list(vs)
        kvs = []
        for i, part in enumerate(self.entry.parts):
            for j, slot in enumerate(part.slots):
                kv = copy.copy(slot)
                kv.pool, kv.q_pos, kv.src = pool, q_pos[i][j], src[i][j]
                kv.groups = [StaticReads(k[j], r[j], w[j])
                             for k, r, w in zip(k_pos[i], read_slots[i], write[i], strict=True)]
                kvs.append(kv)
        return CausalLM.forward_batch.__wrapped__(self.model, ids, kvs, rows)  # type: ignore[attr-defined]


def pool_spec(pool: KVPool) -> dict[str, Any]:
    """What the compile worker needs to make a pool of the same tensor shapes (JSON)."""
    return {"num_layers": pool.num_layers, "num_kv_heads": pool.num_kv_heads, "head_dim": pool.head_dim,
            "group_pages": list(pool.allocator.group_pages), "page_size": pool.page_size,
            "dtype": str(pool.dtype).removeprefix("torch."),
            "groups": [dataclasses.asdict(g) for g in pool.groups]}


def pool_from_spec(spec: dict[str, Any]) -> KVPool:
    """A pool of `spec`'s tensor shapes whose pages are uninitialized (the system maps only what is touched) but for
    page 0, which a scratch step writes and reads (zeroed: fresh memory may hold NaNs)."""
    groups = [LayerGroup(tuple(g["layers"]), g["window"], g["reach"]) for g in spec["groups"]]
    dtype = getattr(torch, spec["dtype"])
    pool = KVPool(spec["num_layers"], spec["num_kv_heads"], spec["head_dim"], [1] * len(groups), spec["page_size"],
                  dtype, "cpu", groups)
    shapes = [(n, spec["page_size"], spec["num_kv_heads"], spec["head_dim"]) for n in spec["group_pages"]]
    pool.k = [torch.empty(shapes[g], dtype=dtype) for g in pool.layer_group]
    pool.v = [torch.empty(shapes[g], dtype=dtype) for g in pool.layer_group]
    for t in (*pool.k, *pool.v):
        t[0].zero_()
    pool.k_slots = [t.view(-1, pool.num_kv_heads, pool.head_dim) for t in pool.k]
    pool.v_slots = [t.view(-1, pool.num_kv_heads, pool.head_dim) for t in pool.v]
    return pool


def policy_spec(policy: WindowPolicy) -> dict[str, Any]:
    return dataclasses.asdict(policy)


def policy_from_spec(spec: dict[str, Any]) -> WindowPolicy:
    return WindowPolicy(**spec)
