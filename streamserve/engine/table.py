"""`SessionTable`: the engine's open sessions by id, held weakly, and the reclaim of dropped ones.

A handle (`session.Session`) dropped without close() is garbage-collected; its finalizer queues its
`SessionState` here (no lock: the collector may run on any thread, mid-anything), and the engine frees
its pages and drafter state between steps (`take_orphans`). Lookups and registration take a small lock of
their own: callers open and close sessions while the engine thread admits and steps.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Protocol

from streamserve.engine.state import SessionState


class SessionHandle(Protocol):
    """What the table knows of a handle: its id and the state it holds."""

    @property
    def id(self) -> str: ...

    @property
    def core(self) -> SessionState: ...


class SessionTable:
    def __init__(self) -> None:
        self._handles: weakref.WeakValueDictionary[str, SessionHandle] = weakref.WeakValueDictionary()
        self._finalizers: dict[str, weakref.finalize] = {}
        self._lock = threading.Lock()
        self._orphans: queue.SimpleQueue[SessionState] = queue.SimpleQueue()  # states of collected handles

    def add(self, handle: SessionHandle) -> None:
        # the finalizer holds the state (not the handle): when the handle is collected the state is queued
        fin = weakref.finalize(handle, self._orphans.put, handle.core)
        with self._lock:
            self._handles[handle.id] = handle
            self._finalizers[handle.id] = fin

    def remove(self, session_id: str) -> None:
        """A handle closed: forget it (its own close freed its state)."""
        with self._lock:
            self._handles.pop(session_id, None)
            fin = self._finalizers.pop(session_id, None)
        if fin is not None:
            fin.detach()

    def get(self, session_id: str) -> SessionHandle | None:
        with self._lock:
            return self._handles.get(session_id) if isinstance(session_id, str) else None

    def state_of(self, session_id: str) -> SessionState | None:
        """The state of the open session with this id (None: closed, collected or unknown)."""
        h = self.get(session_id)
        st = h.core if h is not None else None
        return st if st is not None and not st.closed else None

    def handles(self) -> list[SessionHandle]:
        with self._lock:
            return list(self._handles.values())

    def states(self) -> list[SessionState]:
        return [h.core for h in self.handles()]

    def take_orphans(self) -> list[SessionState]:
        """The states of sessions collected without close() since the last call (their finalizers ran)."""
        out = []
        while True:
            try:
                out.append(self._orphans.get_nowait())
            except queue.Empty:
                break
        if out:
            with self._lock:  # their finalizers ran: drop them
                for sid in [sid for sid, f in self._finalizers.items() if not f.alive]:
                    del self._finalizers[sid]
        return out
