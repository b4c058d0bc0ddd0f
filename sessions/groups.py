"""Layer groups: the layers of a model that share one model-native attention window share page tables.

A model such as Gemma 3 mixes GLOBAL layers (full attention) with LOCAL layers (attention to the last
`sliding_window` tokens only). A local layer never reads a key older than its window again, so its pages
can go back to the pool as soon as they fall out of it, whatever the session's own policy, while the global
layers keep everything. Each group has storage for its own layers only (pages of a group hold that group's
layers), one page table per session, and its own share of the pool.

`rewind_reach`: a local group keeps `window + rewind_reach` tokens (not just `window`), so a rewind of up
to `rewind_reach` tokens (a user's `/rewind` of the last turn, a rejected draft) still finds every key a
query at the rewound position reads; past it the rewind is refused with a RewindError. 0 frees at once.

Budget split (`split_pages`): a session of X tokens holds up to `L_g * min(X, keep_g + step)` token-layers
in group g (L_g layers, keep_g = window + reach, or X for global layers; a step of `step` tokens takes its
pages before the oldest go back). An ideal split for sessions of X tokens gives each group that share of the
bytes; the share a group needs varies with X (local groups need the most for short sessions, global groups
for long ones). Each group gets bytes in proportion to the LARGEST share it needs at any session length up
to the model's context, so at every session length the pool holds at least 1 / (sum of those largest
shares) of the sessions an ideal split for that length would (Gemma 3 270M with the default reach: about
58%), and neither kind of layer runs out long before the other. Before that, a local group gets the pages
of one session's step at its peak when the budget allows (a small pool must still run a full step). One
group (every model without per-layer windows) gets the whole budget, as before groups existed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamserve.errors import InvalidInputError

DEFAULT_REWIND_REACH = 256  # tokens a local group keeps past its window for rewinds


@dataclass(frozen=True)
class LayerGroup:
    layers: tuple[int, ...]  # the model's layer indices in this group, ascending
    window: int | None = None  # the layers' native window (None: full attention)
    reach: int = 0  # tokens kept past the window so rewinds of up to this many tokens work (local groups)

    @property
    def keep(self) -> int | None:
        """Tokens a session keeps in this group (None: all of them)."""
        return None if self.window is None else self.window + self.reach


def check_reach(rewind_reach: int) -> int:
    if isinstance(rewind_reach, bool) or not isinstance(rewind_reach, int) or rewind_reach < 0:
        raise InvalidInputError(f"rewind_reach must be an integer number of tokens >= 0, got {rewind_reach!r}")
    return rewind_reach


def layer_groups(windows: Sequence[int | None], rewind_reach: int = DEFAULT_REWIND_REACH) -> list[LayerGroup]:
    """Per-layer native windows -> the groups: full attention first, then the local windows, widest first
    (group 0 reads the most keys). A model whose layers all share one window has one group."""
    check_reach(rewind_reach)
    order = sorted(set(windows), key=lambda w: (w is not None, -(w or 0)))
    return [LayerGroup(tuple(i for i, x in enumerate(windows) if x == w), w, 0 if w is None else rewind_reach)
            for w in order]


def split_pages(groups: Sequence[LayerGroup], kv_bytes: int, bytes_per_token_layer: int, page_size: int,
                context: int, step_tokens: int = 0) -> list[int]:
    """The pages of each group for a budget of `kv_bytes` (see the module's docstring for the rule).
    `bytes_per_token_layer`: keys + values of one token in one layer; `step_tokens`: the most tokens of one
    engine step. InvalidInputError when the budget cannot give every group one page."""
    page_bytes = [len(g.layers) * page_size * bytes_per_token_layer for g in groups]
    if kv_bytes < sum(page_bytes):
        raise InvalidInputError(f"kv_memory of {kv_bytes} bytes is less than one page of each layer group "
                                f"({sum(page_bytes)} bytes); raise kv_memory")
    if len(groups) == 1:
        return [kv_bytes // page_bytes[0]]

    def held(g: LayerGroup, x: int) -> int:  # token-layers a session of x tokens holds in group g
        return len(g.layers) * (x if g.keep is None else min(x, g.keep + step_tokens))

    # a group's share of a session changes monotonically between these lengths: its largest is at one of them
    lengths = {1, context} | {min(g.keep + step_tokens, context) for g in groups if g.keep is not None}
    need = [max(held(g, x) / sum(held(h, x) for h in groups) for x in lengths) for g in groups]
    # every group first gets one page (a local group, budget allowing, the pages one session's step needs at
    # its peak: its kept tokens, a step, one page for alignment), then the rest in proportion to its largest share
    floor = [1 if g.keep is None else -(-(g.keep + step_tokens) // page_size) + 1 for g in groups]
    if kv_bytes < sum(f * b for f, b in zip(floor, page_bytes, strict=True)):
        floor = [1] * len(groups)
    rest = kv_bytes - sum(f * b for f, b in zip(floor, page_bytes, strict=True))
    return [f + int(rest * n / sum(need)) // b for f, n, b in zip(floor, need, page_bytes, strict=True)]
