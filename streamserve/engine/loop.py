"""The engine loop: one thread that serves every session, step after step.

    plan = scheduler.schedule()      # which sessions run how many tokens (pure Python)
    out = runner.execute(plan)       # one batched forward + sampling
    events = scheduler.update(plan, out)
    deliver(events)                  # acks to futures, deltas to outboxes: never blocking

Callers (the sync API, asyncio front ends) only `submit` work and `cancel`; both take the loop's lock
briefly and never wait for a step. A step holds the between-steps guard from schedule to update, so
out-of-band operations (rewind, snapshot, park, close) always see a session between steps. The loop
sleeps when there is no work and checks idle sessions' TTL about once a second.

Exceptions in a step fail that step's sessions and the thread goes on. Something that escapes even that (a
BaseException raised inside a step, such as SystemExit or GeneratorExit, or an extension's fatal error surfacing
as one) ends the thread; it is then recorded (`died`), every queued chunk fails and every reply ends with
`EngineDiedError`, new work is refused with it (the thread is never silently restarted with sessions half-stepped),
and the `on_death` callbacks run, so that a server can report unhealthy and exit.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

from streamserve.engine.guard import BetweenSteps
from streamserve.engine.metrics import EngineMetrics
from streamserve.engine.openmp import release_openmp_threads
from streamserve.engine.runner import Runner
from streamserve.engine.scheduler import Scheduler
from streamserve.engine.streams import Delta, End
from streamserve.engine.work import (
    Chunk,
    ChunkAcked,
    ChunkFailed,
    Event,
    ItemResult,
    Plan,
    Response,
    ResponseDone,
    ResponseFailed,
    SessionFailed,
    StepOutput,
    TokenProduced,
)
from streamserve.errors import EngineDiedError, ResponseInProgressError, SessionClosedError, StepError

log = logging.getLogger("streamserve")

IDLE_CHECK_SECONDS = 1.0


class LoopOwner(Protocol):
    """What the loop asks of the engine that owns it, between steps."""

    def free_orphans(self, wait: bool = True) -> None:
        """Give back the pages of sessions collected without close()."""
        ...

    def expire_idle(self, now: float | None = None) -> int:
        """Close the sessions idle past the TTL."""
        ...

    def session_failed(self, session_id: str, error: BaseException) -> None:
        """A fault in the session's step: close it (its queue was already taken by the scheduler)."""
        ...


class EngineLoop:
    def __init__(self, runner: Runner, scheduler: Scheduler, guard: BetweenSteps, metrics: EngineMetrics,
                 owner: LoopOwner) -> None:
        self.runner, self.scheduler, self.guard, self.metrics = runner, scheduler, guard, metrics
        # weak: the engine owns the loop, whose thread must not keep the engine alive
        self._owner: weakref.ref[LoopOwner] = weakref.ref(owner)
        self.cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_idle_check = time.monotonic()
        self.steps = 0
        self.died: BaseException | None = None  # what ended the engine thread, if a fault did
        # set while the engine thread has no work (cleared by submit()): background work that shares the CPUs (the
        # compile worker, engine/compiled.py) runs freely only then
        self.quiet = Quiet()
        self._death_callbacks: list[Callable[[BaseException], None]] = []

    # ---- called from any thread -----------------------------------------------------------------------
    def submit(self, work: Chunk | Response) -> None:
        """Queue a chunk or a response (typed errors if the session's queue is full or, for a response,
        one is already open). Never waits for the engine."""
        with self.cv:
            if self.died is not None:
                raise EngineDiedError(f"the engine thread died ({type(self.died).__name__}); nothing more can run "
                                      "on this engine: restart the server")
            if self._stopping:
                raise SessionClosedError("the engine is shut down")
            if isinstance(work, Response) and self.scheduler.open_response(work.session_id) is not None:
                raise ResponseInProgressError(f"session {work.session_id} already has a reply running or queued; "
                                              "cancel it first (session.cancel()) or wait for it to end")
            self.scheduler.add(work)
            self.quiet.clear()
            self._ensure_thread()
            self.cv.notify()

    def cancel(self, session_id: str) -> int:
        with self.cv:
            n = self.scheduler.cancel(session_id)
            self.cv.notify()
        return n

    def drop_session(self, session_id: str, error: BaseException | None = None) -> None:
        """Fail or end everything queued on a session (it is being closed). Caller holds the guard."""
        with self.cv:
            events = self.scheduler.drop_session(session_id, error)
        self._deliver(events)

    @property
    def thread(self) -> threading.Thread | None:
        """The engine thread (None before the first submission; it ends when the loop stops or is collected)."""
        return self._thread

    def in_engine_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            # the thread holds the loop only weakly between iterations: an engine nobody uses any more is
            # garbage-collected (with its KV pool), and its thread ends within a second
            self._thread = threading.Thread(target=_thread_main, args=(weakref.ref(self), self.cv, self.quiet),
                                            name="streamserve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop: everything still queued is ended ("closed") or failed; the thread exits."""
        with self.cv:
            self._stopping = True
            self.cv.notify()
        if self._thread is not None and not self.in_engine_thread():
            self._thread.join(timeout)
        with self.guard, self.cv:
            events = [e for sid in list(self.scheduler.busy_sessions()) for e in self.scheduler.drop_session(sid)]
        self._deliver(events)

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(fault)` (from the dying engine thread) if the thread dies; at once if it already has."""
        with self.cv:
            self._death_callbacks.append(callback)
            died = self.died
        if died is not None:
            callback(died)

    def thread_died(self, fault: BaseException) -> None:
        """The engine thread is ending on `fault` (called from it): refuse new work, fail what is queued (the
        step in flight included: its work is still at the head of its queues), tell the callbacks."""
        log.critical("streamserve: the engine thread died; no more work can run on this engine", exc_info=fault)
        with self.cv:
            self.died, self._stopping = fault, True
            callbacks = list(self._death_callbacks)
        error = EngineDiedError(f"the engine thread died ({type(fault).__name__}); restart the server")
        with self.guard, self.cv:
            events = [e for sid in list(self.scheduler.busy_sessions())
                      for e in self.scheduler.drop_session(sid, error)]
        self._deliver(events)
        for callback in callbacks:
            try:
                callback(fault)
            except Exception:
                log.exception("streamserve: an engine death callback failed")

    # ---- the engine thread ----------------------------------------------------------------------------
    def idle(self) -> bool:
        """No work queued and not stopping (the engine thread sleeps)."""
        with self.cv:
            return not self.scheduler.has_work() and not self._stopping

    def iteration(self) -> bool:
        """Run a step (and the idle-TTL check when due); -> False when the loop is stopping."""
        with self.cv:
            if self._stopping:
                return False
        if time.monotonic() - self._last_idle_check >= IDLE_CHECK_SECONDS:
            self._last_idle_check = time.monotonic()
            owner = self._owner()
            if owner is not None:
                self._guarded(owner.expire_idle)
        self._guarded(self.step)
        self.guard.pause_for_waiters()  # a close or rewind waiting for the guard goes before the next step
        return True

    def _guarded(self, fn: object) -> None:
        try:
            fn()  # type: ignore[operator]
        except Exception:  # a bug must not kill the thread that serves every session
            log.exception("streamserve engine loop: unexpected error")

    def step(self) -> list[Event]:
        """One engine step (normally run by the loop thread)."""
        with self.guard:
            owner = self._owner()
            if owner is not None:
                owner.free_orphans()
            with self.cv:
                plan = self.scheduler.schedule()
            if plan.empty:
                return []
            try:
                out = self.runner.execute(plan)
            except Exception as e:  # a bug in the runner: fail this step's sessions, keep serving the rest
                log.exception("streamserve: a step failed")
                now = time.monotonic()
                err = StepError(f"internal error in the engine step: {e!r}")
                out = StepOutput({i.session_id: ItemResult(error=err, fatal=True) for i in plan.items}, now, now)
            with self.cv:
                events = self.scheduler.update(plan, out)
            self.steps += 1
            self._after_step(plan, out, events)
            self._deliver(events)
        return events

    def _after_step(self, plan: Plan, out: StepOutput, events: list[Event]) -> None:
        with self.cv:
            depths = self.scheduler.depths()
        self.metrics.observe_step(plan, out, events, depths)
        owner = self._owner()
        for e in events:
            if isinstance(e, SessionFailed):  # a faulted session is closed: its pages come back
                log.warning("session %s failed and was closed: %s", e.session_id, e.error)
                if owner is not None:
                    owner.session_failed(e.session_id, e.error)

    def _deliver(self, events: list[Event]) -> None:
        for e in events:
            try:
                self._deliver_one(e)
            except Exception:  # one bad delivery must not cost the others theirs
                log.exception("streamserve: delivering %s failed", type(e).__name__)

    def _deliver_one(self, e: Event) -> None:
        if isinstance(e, ChunkAcked):
            _resolve(e.chunk, e.ack, None)
        elif isinstance(e, ChunkFailed):
            _resolve(e.chunk, None, e.error)
        elif isinstance(e, TokenProduced):
            e.response.outbox.put(Delta(e.text, [e.token]))
        elif isinstance(e, ResponseDone):
            if e.text:
                e.response.outbox.put(Delta(e.text, []))
            e.response.outbox.put(End(e.reason))
        elif isinstance(e, ResponseFailed):
            e.response.outbox.put(End("error", e.error))


class Quiet(threading.Event):
    """An Event that tells its listeners each time it changes (on the thread that changed it: under the loop's
    lock, so a listener must be quick and must not raise)."""

    def __init__(self) -> None:
        super().__init__()
        super().set()
        self._listeners: list[Callable[[bool], None]] = []

    def listen(self, fn: Callable[[bool], None]) -> None:
        self._listeners.append(fn)

    def unlisten(self, fn: Callable[[bool], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def set(self) -> None:
        if not self.is_set():
            super().set()
            for fn in list(self._listeners):
                fn(True)

    def clear(self) -> None:
        if self.is_set():
            super().clear()
            for fn in list(self._listeners):
                fn(False)


def _thread_main(ref: weakref.ref[EngineLoop], cv: threading.Condition, quiet: threading.Event) -> None:
    """The engine thread. It holds the loop strongly only while it checks for work or runs a step, never
    while it sleeps, so an engine nobody uses any more can be collected. `quiet` is set while it sleeps."""
    worked = False  # an iteration ran since the thread last fell idle
    while True:
        with cv:  # checked and waited under one hold of the lock: a submit() cannot slip in between
            loop = ref()
            if loop is None:
                return
            idle = loop.idle()
            del loop
            if idle and not worked:
                quiet.set()  # submit() clears it
                cv.wait(IDLE_CHECK_SECONDS)  # submit() and stop() notify
        if idle and worked:  # fallen idle: its OpenMP workers go (engine/openmp.py), then it checks again
            release_openmp_threads()
            worked = False
            continue
        worked = True
        loop = ref()
        if loop is None:
            return
        try:
            if not loop.iteration():
                return
        except BaseException as fault:  # Exceptions are handled inside the step: this is the thread's end
            loop.thread_died(fault)
            return
        del loop


def _resolve(chunk: Chunk, ack: object, error: BaseException | None) -> None:
    fut = chunk.ticket
    if fut is None or fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(ack)
