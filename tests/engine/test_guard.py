"""The between-steps guard is fair: an out-of-band operation (close, rewind, snapshot, park) waiting for it gets in
after the step in flight, however busy the engine loop is. (Python's locks are not fair: the loop thread used to
take the guard again right after releasing it, and a close could wait for seconds behind a flood of chunks.)"""

from __future__ import annotations

import threading
import time

from streamserve import Engine
from streamserve.config import SchedulerConfig
from streamserve.engine.guard import BetweenSteps


def test_a_thread_waiting_for_the_guard_gets_in_after_the_step_in_flight() -> None:
    engine = Engine.from_pretrained("default", device="cpu", kv_memory="64MiB",
                                    scheduler=SchedulerConfig(step_tokens=16, min_append_tokens=16))
    flood = engine.open_session(window=256)
    futures = [flood.submit_chunk(token_ids=[7 + i % 50] * 1000) for i in range(4)]  # 250 steps of 16 tokens
    while engine.loop.steps < 5:  # the loop is busy with the flood
        time.sleep(0.001)
    waits: list[int] = []
    for _ in range(20):
        time.sleep(0.005)
        before = engine.loop.steps
        with engine.guard:
            waits.append(engine.loop.steps - before)
    flood.close()
    for f in futures:
        f.exception(timeout=60)  # done one way or the other (the close fails what is still queued)
    engine.check_integrity()
    engine.shutdown()
    # steps that ran while this thread waited: the one in flight and at most one that started as it asked
    assert max(waits) <= 2, waits


def test_the_loop_waits_only_while_someone_waits() -> None:
    guard = BetweenSteps()
    guard.pause_for_waiters()  # nobody waits: returns at once
    inside = threading.Event()
    with guard:
        t = threading.Thread(target=lambda: (guard.acquire(), inside.set(), guard.release()))
        t.start()
        while not guard.waiting:
            pass
    guard.pause_for_waiters()  # returns once the waiter has had its turn
    assert inside.wait(10)
    t.join(10)
    assert guard.waiting == 0
