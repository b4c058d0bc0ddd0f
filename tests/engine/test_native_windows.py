"""Native interleaved sliding windows: a model's local layers (Gemma 3, Qwen3 with windowed layers) keep only
their window plus the engine's rewind reach of a session, whatever its policy, in pages of their own layer
group, while the global layers keep everything. Checked against transformers and against fresh sessions:
long chunked sessions, flat local pages, rewinds within and past the reach, capacity errors, leak checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import greedy, make_checkpoint, random_ids
from transformers import GenerationConfig

from streamserve import Engine
from streamserve.errors import CapacityError, InvalidInputError, RewindError

REACH = 8  # the engines' rewind reach: small, so that local pages leave within a short test
WINDOW = 16  # the checkpoints' native window of their local layers
PAGE = 16


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Any]) -> dict[str, tuple[Path, Any]]:
    """Tiny random checkpoints with local and global layers: Qwen3 (None, 16, 16) and Gemma 3 (16, 16, None, 16)."""
    root = tmp_path_factory.mktemp("mixed")
    qwen = make_checkpoint(root / "qwen3", "qwen3", use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=1)
    return {"qwen3": (root / "qwen3", qwen), "gemma3": checkpoints["gemma3"]}


@pytest.fixture(scope="module")
def windowed(mixed: dict[str, tuple[Path, Any]]) -> dict[str, Engine]:
    return {arch: Engine.from_pretrained(path, device="cpu", kv_memory="16MiB", rewind_reach=REACH)
            for arch, (path, _) in mixed.items()}


def local_groups(engine: Engine) -> list[int]:
    return [g for g, grp in enumerate(engine.pool.groups) if grp.window is not None]


def held(s: Any, groups: list[int]) -> list[int]:
    return [s.kv.held_in(g) for g in groups]


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_long_chunked_session_matches_transformers_with_flat_local_pages(arch, mixed, windowed) -> None:
    """120 tokens (7.5 windows) in chunks of 13, then 30 greedy tokens: logits after every chunk and the reply
    equal transformers'; the local layers' pages stay flat while the global layers' grow with the session."""
    engine, (_, hf) = windowed[arch], mixed[arch]
    assert [g.window for g in engine.pool.groups] == [None, WINDOW]
    ids = random_ids(120, seed=61)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [120, V]
        gen = hf.generate(torch.tensor([ids]), generation_config=GenerationConfig(
            max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0))[0, len(ids):].tolist()
    local = local_groups(engine)
    with engine.open_session() as s:  # absolute positions, no session window: the model exactly
        assert s.policy.window is None
        held_local = []
        for i in range(0, 120, 13):
            s.append(token_ids=ids[i:i + 13])
            end = min(i + 13, 120)
            assert (s.core.logits - ref[end - 1]).abs().max().item() <= 1e-4, end
            held_local.append(held(s, local))
            assert s.kv.held_in(0) == -(-end // PAGE)  # the global layers keep every page
        # after a commit a local group keeps its last window + reach tokens: at most 3 pages of 16
        assert max(max(h) for h in held_local) <= -(-(WINDOW + REACH) // PAGE) + 1
        assert s.generate(max_tokens=30, stop_token_ids=()) == gen
        assert max(held(s, local)) <= -(-(WINDOW + REACH) // PAGE) + 1
    engine.check_integrity()
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_pages_held_by_a_long_session_stay_flat_for_local_layers(arch, windowed) -> None:
    """The issue's test: 480 tokens appended 24 at a time; the local group's pages are the same after every
    chunk once past the window, the stats report them per group, and a session's bytes follow its pages."""
    engine = windowed[arch]
    local = local_groups(engine)
    with engine.open_session() as s:
        counts = []
        for i in range(0, 480, 24):
            s.append(token_ids=random_ids(24, seed=i))
            counts.append(held(s, local))
        assert len({tuple(c) for c in counts[2:]}) <= 2 and max(max(c) for c in counts) <= 3, counts
        st = engine.stats()
        groups = st["kv_groups"]
        assert [g["window"] for g in groups] == [None, WINDOW] and groups[1]["keep_tokens"] == WINDOW + REACH
        assert groups[0]["pages_used"] == s.kv.held_in(0) == 30 and groups[1]["pages_used"] == counts[-1][0]
        expected = sum(s.kv.held_in(g) * engine.pool.group_page_bytes(g) for g in range(2))
        assert st["kv_session_bytes_max"] == s.kv.held_bytes == expected == st["kv_bytes"]
        assert s.pages_held == sum(s.kv.held_in(g) for g in range(2))
        text = engine.metrics.exposition().decode()
        assert f'streamserve_kv_group_pages_used{{group="1"}} {float(counts[-1][0])}' in text
        assert 'streamserve_kv_group_pages_used{group="0"} 30.0' in text
    engine.check_integrity()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_rewind_within_the_reach_equals_a_fresh_run_and_past_it_is_typed(arch, windowed) -> None:
    engine = windowed[arch]
    ids, extra = random_ids(90, seed=62), random_ids(5, seed=63)
    with engine.open_session() as s:
        s.append(token_ids=ids[:60], seq=0)
        s.append(token_ids=ids[60:66], seq=1)  # a last turn of 6 tokens: within the reach of 8
        assert s.rewind(to_seq=0) == 60
        s.append(token_ids=extra)
        assert s.generate(max_tokens=8, stop_token_ids=()) == greedy(engine, ids[:60] + extra)
        before = (list(s.token_ids), s.kv.length, s.kv.page_table)
        with pytest.raises(RewindError, match="rewind_reach"):
            s.rewind(to=30)  # the local layers gave back what a query at 30 reads
        assert (list(s.token_ids), s.kv.length, s.kv.page_table) == before  # a refused rewind changes nothing
        reply = s.generate(max_tokens=6, stop_token_ids=())
        s.rewind(to=len(s) - 6)  # the last reply: 6 tokens back
        assert s.generate(max_tokens=6, stop_token_ids=()) == reply
    engine.check_integrity()


def test_rewind_reach_zero_frees_at_once_and_changes_no_output(mixed) -> None:
    path = mixed["gemma3"][0]
    engines = [Engine.from_pretrained(path, device="cpu", kv_memory="16MiB", rewind_reach=r) for r in (0, 40)]
    ids = random_ids(100, seed=64)
    outs, peak = [], []
    for engine in engines:
        with engine.open_session() as s:
            local = []
            for i in range(0, 100, 10):
                s.append(token_ids=ids[i:i + 10])
                local.append(s.kv.held_in(1))
            outs.append(s.generate(max_tokens=12, stop_token_ids=()))
            peak.append(max(local[-3:]))
            if engine.pool.groups[1].reach == 0:
                with pytest.raises(RewindError, match="rewind_reach"):
                    s.rewind(to=len(s) - PAGE - 1)  # past the window's page: the keys are gone
        engine.check_integrity()
    assert outs[0] == outs[1] and peak[0] < peak[1] and peak[0] <= 2
    with pytest.raises(InvalidInputError, match="rewind_reach"):
        Engine.from_pretrained(path, device="cpu", kv_memory="16MiB", rewind_reach=-1)


def test_a_model_without_per_layer_windows_keeps_one_group(engines) -> None:
    """Every layer in one group, the whole budget in it: the layout and page counts of before."""
    engine = engines["llama"]
    assert len(engine.pool.groups) == 1 and engine.pool.groups[0].window is None
    per_page = 2 * engine.config.num_layers * PAGE * engine.config.num_kv_heads * engine.config.head_dim * 4
    assert engine.pool.num_pages == (64 << 20) // per_page
    with engine.open_session() as s:
        s.append(token_ids=random_ids(40, seed=65))
        assert s.pages_held == 3 and s.kv.page_table.keys() == {(0, 0), (0, 1), (0, 2)}


def test_a_step_the_local_group_cannot_hold_takes_nothing(mixed) -> None:
    """Capacity errors take nothing: a session whose chunk needs more pages of a group than the pool has
    fails with CapacityError, having taken no page of any group, and the engine goes on."""
    path = mixed["qwen3"][0]
    engine = Engine.from_pretrained(path, device="cpu", kv_memory=200_000, rewind_reach=REACH)
    pages = engine.pool.allocator.group_pages
    with engine.open_session() as s:
        s.append(token_ids=random_ids(20, seed=66))
        used = engine.stats()["kv_pages_used"]
        with pytest.raises(CapacityError, match="layer group"):
            engine.forward(s.kv, random_ids(PAGE * (max(pages) + 1), seed=67))
        assert engine.stats()["kv_pages_used"] == used and len(s) == 20 and s.kv.length == 20
        engine.check_integrity()
        s.append(token_ids=random_ids(10, seed=68))  # the session goes on
        assert len(s.generate(max_tokens=3, stop_token_ids=())) == 3
    engine.check_integrity()
    assert engine.stats()["kv_pages_used"] == 0


def test_pool_pressure_parks_idle_sessions_and_both_go_on_identically(mixed) -> None:
    """A pool that holds one long session: a second one's steps park the first (its pages of both groups go to
    host memory), and each session's reply equals its run on a roomy engine."""
    path = mixed["gemma3"][0]
    roomy = Engine.from_pretrained(path, device="cpu", kv_memory="16MiB", rewind_reach=REACH)
    tight = Engine.from_pretrained(path, device="cpu", kv_memory=200_000, rewind_reach=REACH)
    pages = tight.pool.allocator.group_pages
    assert 12 <= pages[0] < 20 and pages[1] >= 7  # global layers: one session; local: one 64-token step's peak
    prompts = [random_ids(180, seed=69), random_ids(150, seed=70)]
    expected = [greedy(roomy, ids) for ids in prompts]
    a, b = tight.open_session(), tight.open_session()
    a.append(token_ids=prompts[0])
    b.append(token_ids=prompts[1])  # needs pages a holds: a is parked
    assert a.kv.parked is not None and tight.stats()["sessions_parked_total"] >= 1
    assert b.generate(max_tokens=8, stop_token_ids=()) == expected[1]
    b.park()
    assert a.generate(max_tokens=8, stop_token_ids=()) == expected[0]
    a.close()
    b.close()
    tight.check_integrity()
    assert tight.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_rewind_of_exactly_the_reach_works_at_every_page_alignment(arch, windowed) -> None:
    """A user's rewind runs the last kept token again, so a rewind of `rewind_reach` tokens reads one key more
    than the next query does: the local group must keep window + reach tokens (not one fewer), whatever page
    boundary the oldest kept key falls on (lengths 40..56 put it at every offset of a 16-token page)."""
    engine = windowed[arch]
    for n in range(40, 40 + PAGE + 1):
        ids, turn = random_ids(n, seed=80 + n), random_ids(REACH, seed=81)
        with engine.open_session() as s:
            s.append(token_ids=ids, seq=0)
            s.append(token_ids=turn, seq=1)  # a last turn of exactly the reach
            assert s.rewind(to_seq=0) == n, n
            if n in (40, 47):  # 47: the alignment that lost the key
                assert s.generate(max_tokens=4, stop_token_ids=()) == greedy(engine, ids, max_tokens=4), n
    engine.check_integrity()


def test_a_chunk_failing_past_the_reach_says_the_sliding_window_layers_keep_its_start(mixed) -> None:
    """A long chunk runs in 16-token steps; the global layers run out of pages after the local layers already
    gave back its first tokens (past window + reach): it cannot be taken out again, and the error says why
    in terms of the model's sliding-window layers and rewind_reach (the session has no window of its own)."""
    from streamserve.config import SchedulerConfig

    engine = Engine.from_pretrained(mixed["gemma3"][0], device="cpu", kv_memory=200_000, rewind_reach=REACH,
                                    scheduler=SchedulerConfig(step_tokens=16, min_append_tokens=16))
    with engine.open_session() as s:
        s.append(token_ids=random_ids(6, seed=82))
        with pytest.raises(CapacityError, match=r"entered the session and stay.*sliding-window layers.*rewind_reach"):
            s.append(token_ids=random_ids(PAGE * (engine.pool.allocator.group_pages[0] + 1), seed=83))
        assert len(s) > 6 + WINDOW + REACH  # what ran stays
        s.append(token_ids=[7, 8])  # and the session goes on
    engine.check_integrity()
