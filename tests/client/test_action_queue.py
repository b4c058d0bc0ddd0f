"""streamserve-client's ActionQueue (a robot's actions by control step from the chunks a policy server sends): rows
already due are dropped, rows still ahead keep running while the next chunk is computed, overlapping chunks blend
as asked, and bad input gets a typed error."""

from __future__ import annotations

import numpy as np
import pytest

from streamserve_client import ActionQueue, InvalidInputError


def chunk(value: float, rows: int = 4, dims: int = 2) -> np.ndarray:
    return np.full((rows, dims), value) + np.arange(rows)[:, None] * 0.01


def test_rows_run_by_step_and_the_last_chunk_continues_until_it_runs_out() -> None:
    q = ActionQueue()
    assert q.add(chunk(1.0), valid_from_step=3) == 4
    assert q.pop(2) is None  # nothing for step 2
    assert np.allclose(q.pop(3), [1.0, 1.0]) and q.ahead(4) == 3
    # the next chunk is late: the rows of this one still run
    assert np.allclose(q.pop(4), [1.01, 1.01]) and np.allclose(q.pop(5), [1.02, 1.02])
    # it arrives valid from step 5 (already popped: that row is dropped), the rest queued
    assert q.add(chunk(2.0), valid_from_step=5) == 3
    assert np.allclose(q.pop(6), [2.01, 2.01])  # latest: the newer chunk's row
    assert np.allclose(q.pop(8), [2.03, 2.03])  # its last row (step 7 skipped: dropped with the pop of 8)
    assert q.pop(9) is None and len(q) == 0  # every earlier step's rows left with the pops


@pytest.mark.parametrize(("blend", "want"), [("latest", 2.0), ("average", 1.5), (0.75, 1.75)])
def test_overlapping_chunks_blend(blend: str | float, want: float) -> None:
    q = ActionQueue(blend)
    q.add(np.ones((3, 2)), 0)
    q.add(np.full((3, 2), 2.0), 1)  # steps 1, 2 overlap; step 3 is the newer chunk's alone
    assert np.allclose(q.pop(0), 1.0) and np.allclose(q.pop(1), want) and np.allclose(q.pop(3), 2.0)
    if blend == "average":  # a third chunk: the mean of all three
        q.add(np.ones((2, 2)), 4)
        q.add(np.full((2, 2), 2.0), 4)
        q.add(np.full((2, 2), 6.0), 4)
        assert np.allclose(q.pop(4), 3.0)


def test_a_stale_reply_with_no_rows_changes_nothing_and_bad_input_is_refused() -> None:
    q = ActionQueue()
    q.add(chunk(1.0), 0)
    assert q.add(np.zeros((0, 2)), 7) == 0 and q.ahead(0) == 4
    q.clear()
    assert len(q) == 0
    for bad in ("newest", 0.0, 1.5, True):
        with pytest.raises(InvalidInputError):
            ActionQueue(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        q.add(np.array([1.0, np.nan]).reshape(1, 2), 0)
    with pytest.raises(InvalidInputError):
        q.add(np.ones(3), 0)
    with pytest.raises(InvalidInputError):
        q.add(np.ones((2, 2)), 1.5)  # type: ignore[arg-type]
    small = ActionQueue(max_rows=3)
    with pytest.raises(InvalidInputError, match="pop them"):
        small.add(np.ones((4, 2)), 0)
    assert len(small) == 0  # refused whole


def test_rows_are_the_queued_actions_ahead_up_to_the_first_gap() -> None:
    q = ActionQueue()
    q.add(chunk(1.0), valid_from_step=3)  # steps 3..6
    assert np.allclose(q.rows(4, 2), [[1.01, 1.01], [1.02, 1.02]])  # the real-time chunking prefix
    assert q.rows(5, 9).shape == (2, 2) and len(q) == 4  # up to the last queued step; nothing leaves the queue
    assert q.rows(7, 2).shape[0] == 0 and q.rows(2, 3).shape[0] == 0  # nothing queued there (step 2: a gap first)
    q.pop(5)
    assert np.allclose(q.rows(6, 4), [[1.03, 1.03]])
