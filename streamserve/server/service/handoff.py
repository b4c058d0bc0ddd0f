"""The snapshot store of a live hand-off: where a draining instance leaves its sessions for the instance that
receives their resume (docs/protocol.md, Drain and hand-off; server/service/lifecycle.py drains and restores).

A `HandoffRecord` is one session: the engine's `Snapshot` (engine/snapshot.py) and what the session service keeps
for it: the sha256 of its resume token (never the token), its sampling defaults, its reserved KV pages, its chunk
budget, its chat transcript's state (engine/chat.py `export_state`) when it was opened with `chat`, the results of
its latest chunks (for the client that resumes it), and the wall-clock time after which nobody may resume it.

`SnapshotStore` is the interface (put / claim / discard / expire); `DirectoryStore` keeps one file per session in
a directory that every instance behind one proxy mounts. Its rules:
- a session id becomes a file name only after it is checked against the engine's id alphabet (urlsafe base64);
- a put writes a temporary file (mode 0600, in the same directory) and renames it over `<id>.rec`: a reader never
  sees half a record;
- a file is a JSON header line (format, session, token hash, model fingerprint, expiry) then the payload
  (`torch.save` of plain data, loaded with `weights_only=True`: a file can carry no code). A claim reads the header
  only, checks the token against the hash in constant time (a wrong token changes nothing: the record stays for
  the right client) and the model, then renames the file to a name of its own: of two instances claiming one
  session, one rename succeeds, the other finds nothing;
- a damaged record is a typed error (`DamagedRecordError`) and is removed; a record of another model is a typed
  error (`ForeignModelError`) and stays, for an instance that serves that model; a record past its expiry is
  removed and reads as absent.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from streamserve.engine.snapshot import Snapshot
from streamserve.errors import InvalidInputError, SessionNotFoundError, SnapshotError
from streamserve.server.service.registry import ResumeTokenError

log = logging.getLogger("streamserve.server")

FORMAT = "streamserve.handoff"
VERSION = 1
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")  # the engine's ids: secrets.token_urlsafe (engine/session.py)
MAX_HEADER_BYTES = 4096
SUFFIX = ".rec"
STALE_S = 3600.0  # a claimed or temporary file this old was left by an instance that died mid-way: removed


class DamagedRecordError(SnapshotError):
    """A hand-off record that cannot be read (truncated, foreign, tampered with): it is removed from the store. The
    client learns that its session is gone (`unknown_session`)."""

    code = "unknown_session"


class ForeignModelError(SnapshotError):
    """A hand-off record taken on another model (or engine configuration): it stays in the store for an instance
    that serves that model. The client learns that this server cannot resume it (`unknown_session`)."""

    code = "unknown_session"


class BadSessionIdError(InvalidInputError):
    """A session id outside the engine's alphabet: it never becomes a file name."""

    code = "unknown_session"


def check_id(session_id: str) -> str:
    if not isinstance(session_id, str) or SESSION_ID.fullmatch(session_id) is None:
        raise BadSessionIdError(f"no session {str(session_id)[:40]!r} to resume: not a session id of this server")
    return session_id


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class HandoffRecord:
    session_id: str
    token_sha256: str  # hex sha256 of the resume token
    snapshot: Snapshot
    expires_at: float  # wall clock (time.time()): no resume after it
    sampling: dict[str, Any] = field(default_factory=dict)
    reserved_pages: int = 0
    chunk_budget: float | None = None  # seconds
    chat: dict[str, Any] | None = None  # engine/chat.py ChatTranscript.export_state()
    recent: list[dict[str, Any]] = field(default_factory=list)  # latest chunk results (results.py fields)

    def token_matches(self, token: str) -> bool:
        return hmac.compare_digest(self.token_sha256.encode(), token_hash(token).encode())

    def header(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "session": self.session_id, "token_sha256": self.token_sha256,
                "model": self.snapshot.model, "model_name": self.snapshot.model_name, "expires_at": self.expires_at,
                "reserved_pages": self.reserved_pages}

    def payload(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot.to_dict(), "sampling": dict(self.sampling), "chunk_budget": self.chunk_budget,
                "chat": self.chat, "recent": list(self.recent)}

    def encode(self) -> bytes:
        buf = io.BytesIO()
        torch.save(self.payload(), buf)
        return json.dumps(self.header()).encode() + b"\n" + buf.getvalue()

    @classmethod
    def decode(cls, data: bytes) -> HandoffRecord:
        head, sep, body = data.partition(b"\n")
        h = read_header(head if sep else b"")
        try:
            d = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
            snap = Snapshot.from_dict(d["snapshot"])
            return cls(h["session"], h["token_sha256"], snap, float(h["expires_at"]), dict(d["sampling"]),
                       int(h["reserved_pages"]), d["chunk_budget"], d["chat"], list(d["recent"]))
        except SnapshotError as e:
            raise DamagedRecordError(f"damaged hand-off record: {e}") from None
        except Exception as e:  # a truncated payload: whatever torch raised
            raise DamagedRecordError(f"damaged hand-off record: {type(e).__name__}: {e}") from None


def read_header(line: bytes) -> dict[str, Any]:
    try:
        h = json.loads(line)
        ok = (isinstance(h, dict) and h.get("format") == FORMAT and h.get("version") == VERSION
              and isinstance(h.get("token_sha256"), str) and isinstance(h.get("model"), str)
              and isinstance(h.get("expires_at"), (int, float)) and isinstance(h.get("reserved_pages"), int)
              and isinstance(h.get("session"), str))
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise DamagedRecordError("damaged hand-off record: its header is not a streamserve hand-off header")
    return h


class Claim(Protocol):
    record: HandoffRecord

    def commit(self) -> None:
        """The session was restored: the record goes."""

    def release(self) -> None:
        """The session could not be restored here (no room): the record goes back for another try."""


class SnapshotStore(Protocol):
    def put(self, record: HandoffRecord) -> None:
        """Keep the record (replacing one of the same session); atomic."""

    def claim(self, session_id: str, token: str, model: str) -> Claim:
        """Take the session's record for a resume: SessionNotFoundError (none, expired, or another instance took
        it), ResumeTokenError (kept for the right token), ForeignModelError (kept), DamagedRecordError (removed)."""

    def discard(self, session_id: str) -> bool:
        """Remove the session's record; -> whether there was one."""

    def expire(self, now: float | None = None) -> int:
        """Remove records past their expiry (and leftovers of instances that died mid-way); -> how many."""


class DirectoryClaim:
    def __init__(self, store: DirectoryStore, path: Path, record: HandoffRecord) -> None:
        self.store, self.path, self.record = store, path, record

    def commit(self) -> None:
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        target = self.store.path_of(self.record.session_id)
        try:
            os.link(self.path, target)  # never over a newer record of the same session
        except FileExistsError:
            pass
        except OSError as e:
            log.warning("streamserve: cannot put hand-off record %s back: %s", target.name, e)
            return
        self.path.unlink(missing_ok=True)


class DirectoryStore:
    """One file per session in `path` (created 0700 if missing); see the module's docstring."""

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path)
        try:  # a store that cannot be made is said in the log; each put then fails typed (the session closes)
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.root.stat().st_mode & 0o077:
                log.warning("streamserve: the snapshot store %s is readable or writable by other users than its "
                            "owner (chmod 700 it): its records hold whole conversations", self.root)
        except OSError as e:
            log.error("streamserve: cannot use the snapshot store %s (%s): a drain cannot hand sessions over",
                      self.root, e.strerror or e)

    def path_of(self, session_id: str) -> Path:
        return self.root / (check_id(session_id) + SUFFIX)

    def put(self, record: HandoffRecord) -> None:
        target = self.path_of(record.session_id)
        tmp = self.root / f".{record.session_id}.{secrets.token_hex(6)}.tmp"
        data = record.encode()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise SnapshotError(f"cannot write hand-off record {target.name} to {self.root}: {e.strerror or e}") \
                from None

    def claim(self, session_id: str, token: str, model: str) -> DirectoryClaim:
        path = self.path_of(session_id)
        try:
            with open(path, "rb") as f:
                line = f.readline(MAX_HEADER_BYTES)
        except OSError as e:  # none; or a store this server cannot read (the log says why)
            if not isinstance(e, FileNotFoundError):
                log.error("streamserve: cannot read the snapshot store %s: %s", self.root, e.strerror or e)
            raise SessionNotFoundError(f"no session {session_id!r} to resume: it was closed, expired, or never "
                                       "existed; open a new one") from None
        try:
            h = read_header(line)
        except DamagedRecordError:
            path.unlink(missing_ok=True)
            raise
        if not hmac.compare_digest(h["token_sha256"].encode(), token_hash(token).encode()):
            raise ResumeTokenError("the resume token does not match this session")
        if h["model"] != model:
            raise ForeignModelError(f"session {session_id!r} was handed over from model {h.get('model_name')!r} "
                                    f"(fingerprint {h['model']}); this server serves another model")
        if h["expires_at"] < time.time():
            path.unlink(missing_ok=True)
            raise SessionNotFoundError(f"no session {session_id!r} to resume: it expired")
        claimed = path.with_name(f"{path.name}.claimed-{secrets.token_hex(6)}")
        try:
            os.rename(path, claimed)  # atomic: of two claimers, one takes it
        except FileNotFoundError:
            raise SessionNotFoundError(f"no session {session_id!r} to resume: another connection resumed it") \
                from None
        try:
            record = HandoffRecord.decode(claimed.read_bytes())
        except DamagedRecordError:
            claimed.unlink(missing_ok=True)
            raise
        claim = DirectoryClaim(self, claimed, record)
        if record.session_id != session_id or not record.token_matches(token):  # replaced between read and rename
            claim.release()
            raise SessionNotFoundError(f"no session {session_id!r} to resume: its record changed; retry")
        return claim

    def discard(self, session_id: str) -> bool:
        try:
            self.path_of(session_id).unlink()
            return True
        except FileNotFoundError:
            return False

    def expire(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        gone = 0
        try:
            paths = list(self.root.iterdir())
        except OSError:  # a store that cannot be read: said at start, and at each claim
            return 0
        for p in paths:
            try:
                if p.name.endswith(SUFFIX):
                    with open(p, "rb") as f:
                        try:
                            stale = read_header(f.readline(MAX_HEADER_BYTES))["expires_at"] < now
                        except DamagedRecordError:
                            stale = True
                elif ".claimed-" in p.name or p.name.endswith(".tmp"):
                    stale = p.stat().st_mtime < now - STALE_S
                else:
                    continue
                if stale:
                    p.unlink(missing_ok=True)
                    gone += 1
            except OSError:  # claimed or replaced meanwhile (or unreadable: left alone)
                continue
        return gone
