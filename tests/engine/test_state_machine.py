"""A seeded random walk of 1,200 operations over sessions on a small pool, checking every page after each.

Operations: open (with and without windows), append, generate, rewind, snapshot, restore, park, close,
drop without closing, a step that fails inside the model, and pool exhaustion (the pool holds 40 pages
of 4 tokens, far less than the sessions want). Every user error must be typed; after every operation
the allocator's counts must match the pages the live sessions hold.
"""

from __future__ import annotations

import gc
import random

import pytest

from streamserve import Engine
from streamserve.errors import StepError, StreamserveError
from streamserve.sessions import KVPool


class InjectedFault(RuntimeError):
    pass


@pytest.mark.parametrize("seed", [0, 1])
def test_random_operations_keep_the_pool_exact(checkpoints, seed: int) -> None:
    path = checkpoints["qwen3_moe"][0]
    probe = Engine.from_pretrained(path, device="cpu", page_size=4)
    cfg = probe.config
    per_page = KVPool.bytes_per_page(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, probe.dtype)
    engine = Engine.from_pretrained(path, device="cpu", kv_memory=40 * per_page, page_size=4)
    model_forward = type(engine.model).forward_batch
    fail_next = {"on": False}

    def forward(self, ids, kvs, rows=None):
        if fail_next["on"]:
            fail_next["on"] = False
            raise InjectedFault("a step failed inside the model")
        return model_forward(self, ids, kvs, rows)

    type(engine.model).forward_batch = forward
    rng = random.Random(seed)
    sessions, snaps = [], []
    counts: dict[str, int] = {}
    try:
        for _ in range(600):
            op = rng.choice(["open", "append", "append", "append", "generate", "rewind", "snapshot", "restore",
                             "park", "close", "drop", "fault"])
            counts[op] = counts.get(op, 0) + 1
            s = rng.choice(sessions) if sessions else None
            try:
                if op == "open" or s is None:
                    w = rng.choice([None, 1, 8, 12])
                    sessions.append(engine.open_session(window=w, sinks=rng.choice([0, 2]) if w else 4,
                                                        positions=rng.choice([None, "absolute"]) if w else None,
                                                        page_cap=rng.choice([None, None, 6]),
                                                        drafter=rng.choice(["none", "ngram"])))
                elif op in ("append", "fault"):
                    fail_next["on"] = op == "fault"
                    before = (list(s.token_ids), s.kv.length)
                    try:
                        s.append(token_ids=[rng.randrange(300) for _ in range(rng.randint(1, 12))])
                    except StepError as e:  # a fault fails the session: it is closed, its pages are back
                        assert isinstance(e.__cause__, InjectedFault) and s.closed and not s.kv.page_table
                        assert (s.token_ids, s.kv.length) == before
                        sessions.remove(s)
                elif op == "generate" and s.token_ids:  # long enough for drafting to start
                    s.generate(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]), stop_token_ids=())
                elif op == "rewind":
                    s.rewind(to=rng.randint(0, len(s.token_ids)))
                elif op == "snapshot":
                    snaps.append(s.snapshot())
                    snaps[:] = snaps[-3:]
                elif op == "restore" and snaps:
                    sessions.append(engine.restore(rng.choice(snaps)))
                elif op == "park":
                    s.park()
                elif op == "close":
                    s.close()
                    sessions.remove(s)
                elif op == "drop":
                    sessions.remove(s)
                    del s
                    gc.collect()
            except StreamserveError:
                counts["typed_error"] = counts.get("typed_error", 0) + 1
            finally:
                fail_next["on"] = False
            engine.check_integrity()
            for x in sessions:
                if not x.closed and x.kv.parked is None:
                    assert x.kv.length <= len(x.token_ids) <= x.kv.length + 1
                    assert x.kv.page_cap is None or len(x.kv.page_table) <= x.kv.page_cap
    finally:
        type(engine.model).forward_batch = model_forward
    for x in sessions:
        x.close()
    gc.collect()
    engine.check_integrity()
    assert engine.stats()["kv_pages_used"] == 0
    assert counts.get("typed_error", 0) > 10 and counts["fault"] > 10  # the walk did hit the hard cases
