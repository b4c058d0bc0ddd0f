"""Replies of several sessions decoded in the same engine steps: what the batch-invariance benchmark, the
GPU check and the graph tests compare against each session alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from streamserve.engine import Engine


def replies_together(engine: Engine, prompts: Sequence[list[int]], max_tokens: int,
                     session_kws: Sequence[dict[str, Any]] | None = None) -> list[list[int]]:
    """Open a session per prompt, append it, then queue every reply before the first step (between
    steps), so they decode batched from the start; -> each session's greedy tokens."""
    kws = session_kws or [{}] * len(prompts)
    sessions = [engine.open_session(**kw) for kw in kws]
    try:
        for s, p in zip(sessions, prompts, strict=True):
            s.append(token_ids=p)
        with engine.guard:  # between steps: every reply is queued before the first step runs
            streams = [s.stream(max_tokens=max_tokens, stop_token_ids=()) for s in sessions]
        for st in streams:
            st.wait()
        return [st.token_ids for st in streams]
    finally:
        for s in sessions:
            s.close()
