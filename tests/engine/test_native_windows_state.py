"""Native interleaved sliding windows with everything that moves a session's pages: snapshots (on the host
and in a file), parking, speculative drafting, fixed-shape (CUDA-graph) decode steps, several sessions in
one batched step, rolling positions. Each compares with a session that never moved, then checks leaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import make_checkpoint, random_ids

from streamserve import Engine
from streamserve.errors import SnapshotError

REACH = 8


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Any]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixed_state")
    make_checkpoint(root / "qwen3", "qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    return {"qwen3": root / "qwen3", "gemma3": checkpoints["gemma3"][0]}


@pytest.fixture(scope="module")
def engine(paths: dict[str, Path]) -> Engine:
    return Engine.from_pretrained(paths["gemma3"], device="cpu", kv_memory="16MiB", rewind_reach=REACH)


def fed(engine: Engine, ids: list[int], chunk: int = 11, **kw: Any) -> Any:
    s = engine.open_session(**kw)
    for i in range(0, len(ids), chunk):
        s.append(token_ids=ids[i:i + chunk])
    return s


@pytest.mark.parametrize("kw", [{}, {"window": 40, "sinks": 4}, {"window": 40, "sinks": 4, "positions": "absolute"}])
def test_snapshot_and_restore_mid_stream_continue_identically(engine, kw, tmp_path) -> None:
    ids, more = random_ids(95, seed=71), random_ids(23, seed=72)
    with fed(engine, ids, **kw) as s:
        s.generate(max_tokens=4, stop_token_ids=())
        snap = s.snapshot()
        # local pages: window + reach (and the sink page with a session window)
        assert len(snap.pages.logical) == 2 and len(snap.pages.logical[1]) <= 3 + ("sinks" in kw)
        path = s.snapshot(tmp_path / "s.pt")
        s.append(token_ids=more)
        expected = s.generate(max_tokens=10, stop_token_ids=())
    for source in (snap, path):
        with engine.restore(source) as r:
            assert [r.kv.held_in(g) for g in range(2)] == [len(x) for x in snap.pages.logical]
            r.append(token_ids=more)
            assert r.generate(max_tokens=10, stop_token_ids=()) == expected
    engine.check_integrity()
    snap.pages.logical[1].append(99)  # a page number for which no keys were saved
    used = engine.stats()["kv_pages_used"]
    with pytest.raises(SnapshotError, match="damaged"):
        engine.restore(snap)
    assert engine.stats()["kv_pages_used"] == used
    engine.check_integrity()


def test_park_and_unpark_mid_stream_continue_identically(engine) -> None:
    ids, more = random_ids(80, seed=73), random_ids(9, seed=74)
    with fed(engine, ids) as twin:
        twin.generate(max_tokens=5, stop_token_ids=())
        twin.append(token_ids=more)
        expected = twin.generate(max_tokens=10, stop_token_ids=())
    with fed(engine, ids) as s:
        s.generate(max_tokens=5, stop_token_ids=())
        groups = [s.kv.held_in(g) for g in range(2)]
        s.park()
        assert s.pages_held == 0 and s.kv.parked is not None and s.kv.parked.count == sum(groups)
        engine.check_integrity()
        s.append(token_ids=more)  # brings it back
        assert s.kv.parked is None
        assert s.generate(max_tokens=10, stop_token_ids=()) == expected
        s.park()
        s.rewind(to=len(s) - 5)  # checked on the parked copy, then brought back
        assert s.generate(max_tokens=5, stop_token_ids=()) == expected[-5:]
    engine.check_integrity()
    assert engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_ngram_drafting_is_greedy_identical_past_the_windows(paths, arch) -> None:
    """A repetitive stream (drafts get accepted and rejected) far past the 16-token windows: verification
    truncates rejected drafts in every group, then the local pages outside window + reach go back."""
    engine = Engine.from_pretrained(paths[arch], device="cpu", kv_memory="16MiB", rewind_reach=REACH)
    ids = (random_ids(12, seed=75) * 7)[:80]
    outs = []
    for drafter in ("none", "ngram"):
        with fed(engine, ids, drafter=drafter) as s:
            outs.append(s.generate(max_tokens=48, stop_token_ids=()))
            assert s.kv.held_in(1) <= 3
        engine.check_integrity()
    assert outs[0] == outs[1]
    assert engine.stats()["speculative"] and engine.stats()["kv_pages_used"] == 0


@pytest.mark.parametrize("kw", [{}, {"window": 40, "sinks": 4}])
def test_fixed_shape_steps_and_batched_sessions_equal_eager_solo_runs(paths, kw) -> None:
    """cuda_graphs="on" runs decode steps in fixed-size buffers (a bucket per layer group) on a CPU; three
    sessions replying at once share batched steps (batched attention per group). Each equals its solo run."""
    eager = Engine.from_pretrained(paths["gemma3"], device="cpu", kv_memory="16MiB", rewind_reach=REACH)
    graphed = Engine.from_pretrained(paths["gemma3"], device="cpu", kv_memory="16MiB", rewind_reach=REACH,
                                     cuda_graphs="on")
    prompts = [random_ids(n, seed=76 + n) for n in (30, 57, 84)]
    expected = []
    for ids in prompts:
        with fed(eager, ids, **kw) as s:
            expected.append(s.generate(max_tokens=20, stop_token_ids=()))
    sessions = [fed(graphed, ids, **kw) for ids in prompts]
    streams = [s.stream(max_tokens=20, stop_token_ids=()) for s in sessions]
    got = [[t for d in st for t in d.token_ids] for st in streams]
    assert got == expected
    assert graphed.graphs is not None and graphed.graphs.created > 0
    assert any(len(p.keys) == 2 for k in graphed.graphs.entry_keys() for p in k[2])  # a bucket per layer group
    for s in sessions:
        s.close()
    graphed.check_integrity()
    assert graphed.stats()["kv_pages_used"] == 0


def test_rolling_sessions_do_not_depend_on_chunking_or_the_reach(paths) -> None:
    """Rolling positions rotate each group's keys from its own oldest window key: the same stream whatever
    the chunking, and the same as an engine that keeps every local page far longer (reach 200)."""
    ids = random_ids(150, seed=77)
    outs = []
    for reach, chunk in ((REACH, 1), (REACH, 17), (200, 17)):
        engine = Engine.from_pretrained(paths["qwen3"], device="cpu", kv_memory="16MiB", rewind_reach=reach)
        s = engine.open_session(window=48, sinks=4)
        s.append(token_ids=ids[:40])
        for i in range(40, 150, chunk):
            s.append(token_ids=ids[i:i + chunk])
        outs.append(s.generate(max_tokens=12, stop_token_ids=()))
        assert s.kv.held_in(1) <= 1 + -(-(min(48, 16 + reach) + 16) // 16)
        s.close()
        engine.check_integrity()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kw", [{}, {"window": 40, "sinks": 4}])
def test_a_draft_model_on_a_grouped_target_is_greedy_identical(paths, tmp_path, kw) -> None:
    """A Gemma 3 draft model (another random seed: drafts accepted and rejected) for a Gemma 3 target far past
    the 16-token windows: the reply equals plain decoding, the target's local pages stay within window + reach,
    and neither pool leaks."""
    make_checkpoint(tmp_path / "draft", "gemma3", seed=5)
    engine = Engine.from_pretrained(paths["gemma3"], device="cpu", kv_memory="16MiB", rewind_reach=REACH)
    ids = (random_ids(12, seed=78) * 7)[:80]
    outs, draft = [], f"draft:{tmp_path / 'draft'}"
    for drafter in ("none", draft):
        with fed(engine, ids, drafter=drafter, **kw) as s:
            outs.append(s.generate(max_tokens=40, stop_token_ids=()))
            assert s.kv.held_in(1) <= -(-(16 + REACH) // 16) + 1 + (1 if kw else 0)  # (+ the sinks' page)
        engine.check_integrity()
    assert outs[0] == outs[1]
    assert engine.stats()["speculative"] and engine.stats()["kv_pages_used"] == 0
    draft_pool = engine.drafters.make(draft)[0].pool
    assert draft_pool.allocator.used_count == 0
    assert [g.window for g in draft_pool.groups] == [None, 16]  # the draft frees its local pages too
    assert draft_pool.groups[1].reach == REACH


def test_a_snapshot_file_from_before_layer_groups_restores_on_a_grouped_model(paths, tmp_path) -> None:
    """Format version 1 before layer groups: one flat list of page numbers, every layer's keys [n, P, KVH, hd]
    following it (a Qwen3 model with windowed layers kept every page of every layer). The same model, now in
    two groups, restores it and continues exactly; then the local group gives back what it no longer keeps."""
    import torch

    from streamserve.engine.snapshot import Snapshot

    keep_all = Engine.from_pretrained(paths["qwen3"], device="cpu", kv_memory="16MiB", rewind_reach=10**9)
    ids, more = random_ids(70, seed=79), random_ids(9, seed=80)
    with fed(keep_all, ids) as s:  # every layer holds every page: what a build without groups wrote
        s.generate(max_tokens=3, stop_token_ids=())
        d = s.snapshot().to_dict()
        s.append(token_ids=more)
        expected = s.generate(max_tokens=8, stop_token_ids=())
    assert d["logical_pages"][0] == d["logical_pages"][1]
    d["logical_pages"] = d["logical_pages"][0]  # the old file's flat list
    torch.save(d, tmp_path / "old.pt")
    engine = Engine.from_pretrained(paths["qwen3"], device="cpu", kv_memory="16MiB", rewind_reach=REACH)
    assert len(Snapshot.load(tmp_path / "old.pt").pages.logical) == 1
    with engine.restore(tmp_path / "old.pt") as r:
        r.append(token_ids=more)
        assert r.generate(max_tokens=8, stop_token_ids=()) == expected
        assert r.kv.held_in(1) <= 3 < r.kv.held_in(0)
    engine.check_integrity()
    assert engine.stats()["kv_pages_used"] == 0
