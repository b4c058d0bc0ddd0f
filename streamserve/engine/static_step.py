"""The static buffers of a fixed-shape decode step (engine/graphs.py): a step's sessions padded to bucketed
shapes, loaded into fixed-size tensors that a captured CUDA graph (or, on a CPU, a compiled step,
engine/compiled.py) reads in place. `build_entry` makes the buffers of one step shape (a `GraphKey`) over a pool:
the graphs' own over the engine's pool, or a compile's scratch copy over a scratch pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamserve.kernels.reference import PagedKeys
from streamserve.models import CausalLM
from streamserve.sessions import KVPool, PagedSessionKV, WindowPolicy
from streamserve.sessions.group_kv import GroupKV

PAD_POSITION = 1 << 62  # a key position no query reaches: masked as a future key

PolicyKey = tuple[str | None, int | None, int]

@dataclass(frozen=True)
class Part:
    """The sessions of one window policy in a step: their slots (a batch bucket) and key buckets (per group)."""

    policy: PolicyKey
    batch: int
    keys: tuple[int, ...]


GraphKey = tuple[int, bool, tuple[Part, ...]]  # (width W, any all-rows session, the parts in policy order)

class StaticReads:
    """The keys one layer group reads in a step, in fixed-size buffers (rows of its part's): positions and
    slots [bucket], and the slots [W] the step writes."""

    def __init__(self, k_pos: torch.Tensor, read_slots: torch.Tensor, write: torch.Tensor) -> None:
        self.k_pos, self.read_slots, self.write = k_pos, read_slots, write

    def load(self, grp: GroupKV, w: int) -> None:
        n = grp.k_pos.shape[0]
        self.k_pos[:n].copy_(grp.k_pos)
        self.k_pos[n:].fill_(PAD_POSITION)
        self.read_slots[:n].copy_(grp.read_slots)
        self.read_slots[n:].zero_()
        self.write[:w].copy_(grp.write)
        if w < self.write.shape[0]:  # padding rows write their copy of the last row to the last row's slot
            self.write[w:].copy_(grp.write[w - 1:w].expand(self.write.shape[0] - w))


class StaticStepKV:
    """A W-token step of some session of one policy, in fixed-size buffers (the `LayerKV` the model reads)."""

    def __init__(self, pool: KVPool, policy: WindowPolicy, srcs: torch.Tensor, q_pos: torch.Tensor,
                 src: torch.Tensor, groups: list[StaticReads]) -> None:
        self.pool, self.policy, self.rolling = pool, policy, policy.rolling
        self.layer_group = pool.layer_group
        self.tokens, self.srcs = q_pos.shape[0], srcs  # srcs [W, W]: row w-1 maps each row to its source row
        self.q_pos, self.src, self.groups = q_pos, src, groups  # [W], [W], per layer group

    @property
    def k_pos(self) -> torch.Tensor:
        return self.groups[0].k_pos

    def load(self, kv: PagedSessionKV, w: int) -> None:
        """Copy a planned step of w tokens (after `kv.begin(w)`) into the buffers; the rest stays padding."""
        self.q_pos[:w].copy_(kv.q_pos)
        if w < self.tokens:  # padding rows sit at the last token's position
            self.q_pos[w:].copy_(kv.q_pos[w - 1:w].expand(self.tokens - w))
        if self.tokens > 1:
            self.src.copy_(self.srcs[w - 1])
        for static, grp in zip(self.groups, kv.groups, strict=True):
            static.load(grp, w)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> PagedKeys:
        grp = self.groups[self.layer_group[layer]]
        kf = self.pool.k[layer].view(-1, self.pool.num_kv_heads, self.pool.head_dim)
        vf = self.pool.v[layer].view(-1, self.pool.num_kv_heads, self.pool.head_dim)
        if self.tokens > 1:  # padding rows take the last real row's key/value: duplicate writes are identical
            k, v = k.index_select(0, self.src), v.index_select(0, self.src)
        kf.index_copy_(0, grp.write, k.to(kf.dtype))
        vf.index_copy_(0, grp.write, v.to(vf.dtype))
        return PagedKeys(kf, vf, grp.read_slots, grp.k_pos)


class StaticPart:
    """The buffers of one part's B slots, each field one [B, ...] tensor (a slot's are its rows), so that the
    padding slots copy the first real one with one copy per field."""

    def __init__(self, pool: KVPool, policy: WindowPolicy, part: Part, width: int, srcs: torch.Tensor) -> None:
        dev, b = pool.device, part.batch
        self.q_pos = torch.zeros(b, width, dtype=torch.long, device=dev)
        self.src = srcs[width - 1].repeat(b, 1)  # [B, W] the row each row's key/value is written from
        self.k_pos = [torch.full((b, n), PAD_POSITION, dtype=torch.long, device=dev) for n in part.keys]
        for k_pos in self.k_pos:  # warm-up (no session loaded): read the key the step writes to slot 0, not none
            k_pos[:, 0] = 0
        self.read_slots = [torch.zeros(b, n, dtype=torch.long, device=dev) for n in part.keys]
        self.write = [torch.zeros(b, width, dtype=torch.long, device=dev) for _ in part.keys]
        self.slots = [StaticStepKV(pool, policy, srcs, self.q_pos[j], self.src[j],
                                   [StaticReads(k[j], r[j], w[j])
                                    for k, r, w in zip(self.k_pos, self.read_slots, self.write, strict=True)])
                      for j in range(b)]

    def pad(self, n: int) -> None:
        """Slots [0, n) become copies of slot n (a loaded real session)."""
        for t in (self.q_pos, self.src, *self.k_pos, *self.read_slots, *self.write):
            t[:n].copy_(t[n:n + 1].expand(n, -1))


@dataclass
class Entry:
    parts: list[StaticPart]
    kvs: list[StaticStepKV]  # [S] the slots, part after part
    ids: torch.Tensor  # [S * W] the slots' tokens, concatenated
    rows: torch.Tensor | None  # [S] the row whose logits each slot wants (None: every row)
    logits: torch.Tensor | None = None  # [S, V] or [S * W, V], written by each replay
    graph: torch.cuda.CUDAGraph | None = None
    failed: bool = False  # capture failed once: this step shape runs eagerly from now on
    flat_inputs: list[torch.Tensor] | None = None  # its tensors as a compiled CPU step takes them (exported_step.py)

    def forward(self, model: CausalLM) -> torch.Tensor:
        return model.forward_batch(self.ids, self.kvs, self.rows)  # type: ignore[arg-type]




def build_entry(key: GraphKey, pool: KVPool, policies: dict[PolicyKey, WindowPolicy]) -> Entry:
    """The buffers of step shape `key` over `pool` (`policies`: the WindowPolicy of each part's policy key)."""
    width, all_logits, parts = key
    dev = pool.device
    srcs = torch.tensor([[min(j, w) for j in range(width)] for w in range(width)], device=dev)  # [W, W]
    statics = [StaticPart(pool, policies[p.policy], p, width, srcs) for p in parts]
    kvs = [slot for part in statics for slot in part.slots]
    return Entry(statics, kvs, torch.zeros(len(kvs) * width, dtype=torch.long, device=dev),
                 None if all_logits else torch.arange(len(kvs), device=dev) * width + width - 1)
