"""Layer groups on their own: grouping by native window, the budget split, an allocator of grouped pages, and a
session's page tables per group (what each keeps, what a step reads, capacity errors, host copies)."""

from __future__ import annotations

import pytest
import torch

from streamserve.errors import CapacityError, InvalidInputError, PageCapError, RewindError
from streamserve.sessions import KVPool, PageAllocator, PagedSessionKV, WindowPolicy, layer_groups, split_pages

P = 4


def test_layers_group_by_native_window_global_first() -> None:
    groups = layer_groups([8, 8, None, 4, 8, None], rewind_reach=3)
    assert [(g.window, g.layers, g.keep) for g in groups] == [(None, (2, 5), None), (8, (0, 1, 4), 11), (4, (3,), 7)]
    assert [(g.window, g.keep) for g in layer_groups([None, None])] == [(None, None)]
    assert layer_groups([16, 16], rewind_reach=0)[0].keep == 16
    with pytest.raises(InvalidInputError, match="rewind_reach"):
        layer_groups([16, None], rewind_reach=-1)


def test_one_group_gets_the_whole_budget_and_several_get_their_largest_share() -> None:
    one = layer_groups([None] * 4)
    assert split_pages(one, 10_000, 8, P, 512) == [10_000 // (4 * P * 8)]
    groups = layer_groups([512, 512, 512, 512, 512, None], rewind_reach=256)  # 5 local : 1 global
    pages = split_pages(groups, 1 << 24, 8, 16, 32768)
    tokens = [n * 16 for n in pages]  # tokens each group can hold (for each of its layers)
    # at every session length the pool holds at least 1 / (sum of the largest shares) of the sessions an
    # ideal split for that length would; here the shares are 5/6 (short sessions) and ~0.9 (long ones)
    for x in (1, 100, 768, 5000, 32768):
        fits = min(t // min(x, g.keep or x) for t, g in zip(tokens, groups, strict=True))
        ideal = (1 << 24) // (8 * sum(len(g.layers) * min(x, g.keep or x) for g in groups))
        assert fits >= 0.5 * ideal, x
    small = layer_groups([None, 16, 16], rewind_reach=8)  # a budget of 12 global + 5 local pages' bytes
    assert split_pages(small, 12 * 128 + 5 * 256, 8, 16, 512)[1] < 7
    assert split_pages(small, 12 * 128 + 5 * 256, 8, 16, 512, step_tokens=64)[1] >= -(-(24 + 64) // 16) + 1 == 7
    with pytest.raises(InvalidInputError, match="one page of each layer group"):
        split_pages(groups, 500, 8, 16, 32768)


def test_grouped_allocator_counts_every_page_of_every_group() -> None:
    a = PageAllocator([3, 2])
    assert a.bases == (0, 3) and a.num_pages == 5
    x, y = a.alloc(2, group=0), a.alloc(2, group=1)
    assert set(x) <= {0, 1, 2} and set(y) == {3, 4} and a.free_in(0) == 1 and a.free_in(1) == 0
    with pytest.raises(CapacityError, match="layer group 1"):
        a.alloc(1, group=1)
    a.check([x, y])
    a.release(y)
    assert a.free_in(1) == 2 and a.used_count == 2 and [a.group_of(p) for p in (0, 2, 3, 4)] == [0, 0, 1, 1]
    with pytest.raises(AssertionError, match="reference counts"):
        a.check([y])


def pool(local_pages: int = 8) -> KVPool:
    """Layer 0 global, layers 1 and 2 local with a 6-token window and a reach of 2 (keep 8)."""
    return KVPool(3, 1, 2, [32, local_pages], P, torch.float32, "cpu", layer_groups([None, 6, 6], rewind_reach=2))


def step(kv: PagedSessionKV, n: int, seed: int) -> None:
    """One step of n tokens writing keys = values = position numbers (so reads can be checked)."""
    kv.begin(n)
    for layer in range(3):
        x = kv.q_pos.float()[:, None, None].expand(n, 1, 2) + seed
        paged = kv.update(layer, x, x)
        g = kv.layer_group[layer]
        assert torch.equal(paged.k_pos, kv.groups[g].k_pos)
        assert torch.equal(paged.k_pool.index_select(0, paged.slots)[-n:, 0, 0], kv.q_pos.float() + seed)
    kv.commit()


def test_a_local_group_keeps_window_plus_reach_and_reads_its_window() -> None:
    p = pool()
    kv = PagedSessionKV(p, WindowPolicy(), 1000)
    for i in range(10):
        step(kv, 5, seed=0)
        assert kv.held_in(0) == -(-kv.length // P)  # global: every page
        kept = sorted(kv.groups[1].table)
        assert kept[0] * P <= max(0, kv.length - 8) and kv.held_in(1) <= -(-8 // P) + 1, i
        # a session's rewind of the reach (2 tokens) truncates the KV to length - 3: its query's window is kept
        assert kv.can_rewind(max(0, kv.length - 3)), i
    kv.begin(3)  # the step reads [length - 5, length + 3) in the local group, everything in the global one
    assert kv.groups[1].k_pos.tolist() == list(range(kv.length - 5, kv.length + 3))
    assert kv.groups[0].k_pos.tolist() == list(range(kv.length + 3))
    kv.abort()
    kv.check_rewind(kv.length - 2)  # within the reach
    with pytest.raises(RewindError, match="rewind_reach"):
        kv.check_rewind(kv.length - 8)  # (the page granularity may give a little more than the reach)
    p.allocator.check([kv.held_pages])
    kv.release()
    assert p.allocator.used_count == 0


def test_a_step_one_group_cannot_hold_takes_nothing_from_any_group() -> None:
    p = pool(local_pages=3)
    kv = PagedSessionKV(p, WindowPolicy(), 1000)
    step(kv, 6, seed=0)
    before = (kv.page_table, p.allocator.used_count)
    with pytest.raises(CapacityError):
        kv.begin(16)  # 4 more pages of the local group: it has 1 free
    assert (kv.page_table, p.allocator.used_count) == before
    capped = PagedSessionKV(p, WindowPolicy(), 1000, page_cap=2)
    with pytest.raises(PageCapError, match="layer group"):
        capped.begin(9)
    assert capped.held_count == 0 and p.allocator.used_count == before[1]
    p.allocator.check([kv.held_pages])


def test_host_copies_carry_every_group() -> None:
    p = pool()
    kv = PagedSessionKV(p, WindowPolicy(window=12, sinks=2), 1000)
    for _ in range(5):
        step(kv, 5, seed=1)
    host = kv.to_host()
    assert len(host.logical) == 2 and host.count == kv.held_count
    assert [t.shape[0] for t in host.k] == [len(host.logical[g]) for g in kv.layer_group]
    copy = PagedSessionKV(p, kv.policy, 1000)
    copy.load_host(host)
    copy.length = kv.length
    assert [sorted(g.table) for g in copy.groups] == host.logical
    kv.begin(2)
    copy.begin(2)
    for a, b in zip(kv.groups, copy.groups, strict=True):  # the same keys at the same positions
        assert torch.equal(a.k_pos, b.k_pos)
        assert torch.equal(p.k[a.group.layers[0]].view(-1, 1, 2)[a.read_slots[:-2]],
                           p.k[b.group.layers[0]].view(-1, 1, 2)[b.read_slots[:-2]])
    kv.abort()
    copy.abort()
    host.logical[1].append(99)
    with pytest.raises(ValueError, match="layer 1"):
        copy.check_host(host)
    kv.release()
    copy.release()
    p.allocator.check([])
