"""The actions a robot executes, one per control step, from the chunks a policy server sends: continuous under delay.

    queue = ActionQueue(blend="latest")              # or "average", or a weight for the newer chunk, e.g. 0.7
    queue.add(reply["actions"], reply["valid_from_step"])   # fresh and stale replies alike
    row = queue.pop(step)                            # the action for this step, or None: nothing is due
    prefix = queue.rows(step, k)                     # real-time chunking: the next k rows, sent as action_prefix

A reply's row r is for control step `valid_from_step + r`. While the next chunk is computed the robot goes on with
the rows of the last one that are still ahead (openpi's ActionChunkBroker steps through one chunk the same way), and
a stale reply (the server's deadline passed) carries exactly those rows, so adding it keeps them. Where a newer chunk
overlaps rows still queued, `blend` says what the robot does (LeRobot's asynchronous inference calls it the
aggregate function): "latest" takes the newer chunk's row, "average" the mean of every chunk's row for that step, a
number w in (0, 1] the weighted average w * newer + (1 - w) * queued. Rows for steps already popped are dropped, so
the queue holds at most the rows still ahead.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from streamserve_client.errors import InvalidInputError

BLENDS = ("latest", "average")


class ActionQueue:
    def __init__(self, blend: str | float = "latest", max_rows: int = 4096) -> None:
        if isinstance(blend, bool) or not (blend in BLENDS or (isinstance(blend, (int, float)) and 0 < blend <= 1)):
            raise InvalidInputError(f"blend is one of {list(BLENDS)} or a weight in (0, 1] for the newer chunk, "
                                    f"not {blend!r}")
        self.blend, self.max_rows = blend, max_rows
        self._rows: dict[int, tuple[np.ndarray, int]] = {}  # step -> (row [D], chunks blended into it)
        self.next_step = 0  # steps before this one were popped: their rows are dropped

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, actions: Any, valid_from_step: int) -> int:
        """Queue a chunk [H, D] whose first row is for `valid_from_step` -> rows queued (those already due but
        not popped yet count; rows for steps already popped are dropped)."""
        rows = np.asarray(actions, dtype=np.float64)
        if rows.ndim != 2 or not np.isfinite(rows).all():
            raise InvalidInputError(f"a chunk of actions is a finite [H, D] array, got shape {rows.shape}")
        if isinstance(valid_from_step, bool) or not isinstance(valid_from_step, (int, np.integer)):
            raise InvalidInputError(f"valid_from_step is an integer step, not {valid_from_step!r}")
        steps = [(int(valid_from_step) + r, row) for r, row in enumerate(rows)
                 if int(valid_from_step) + r >= self.next_step]
        if len(self._rows) + sum(s not in self._rows for s, _ in steps) > self.max_rows:  # nothing added then
            raise InvalidInputError(f"more than {self.max_rows} actions queued ahead: pop them as they are due")
        for step, row in steps:
            held = self._rows.get(step)
            self._rows[step] = (row.copy(), 1) if held is None else (self._merge(held[0], row, held[1]), held[1] + 1)
        return len(steps)

    def _merge(self, queued: np.ndarray, newer: np.ndarray, count: int) -> np.ndarray:
        if self.blend == "latest":
            return newer.copy()
        if self.blend == "average":  # the running mean over every chunk that had a row for this step
            return queued + (newer - queued) / (count + 1)
        w = float(self.blend)
        return w * newer + (1.0 - w) * queued

    def pop(self, step: int) -> np.ndarray | None:
        """The action for control step `step` (None when no chunk has a row for it); it and every earlier step's
        rows leave the queue."""
        row = self._rows.pop(step, (None, 0))[0]
        self.next_step = max(self.next_step, step + 1)
        for s in [s for s in self._rows if s < self.next_step]:
            del self._rows[s]
        return row

    def ahead(self, step: int) -> int:
        """How many consecutive steps from `step` on have a row queued (ask for the next chunk before it runs out)."""
        n = 0
        while step + n in self._rows:
            n += 1
        return n

    def rows(self, step: int, n: int) -> np.ndarray:
        """The queued rows for steps `step` .. `step + n - 1`, up to the first step with none: [k, D], k <= n (the
        `action_prefix` of real-time chunking: what the robot executes while its next chunk is computed)."""
        out = []
        while len(out) < n and step + len(out) in self._rows:
            out.append(self._rows[step + len(out)][0])
        return np.stack(out) if out else np.zeros((0, 0))

    def clear(self) -> None:
        """Forget every queued row (a new episode)."""
        self._rows.clear()
