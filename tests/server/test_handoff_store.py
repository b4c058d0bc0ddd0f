"""The hand-off snapshot store (server/service/handoff.py): atomic, private puts; a claim checks the token before it
takes anything and two claimers get one record; ids are checked before they become file names; damaged and foreign
records are typed errors that leave the store consistent; records past their expiry go."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import default_engine

from streamserve.engine import Engine
from streamserve.engine.snapshot import Snapshot
from streamserve.errors import SessionNotFoundError, SnapshotError
from streamserve.server.service.handoff import (
    BadSessionIdError,
    DamagedRecordError,
    DirectoryStore,
    ForeignModelError,
    HandoffRecord,
    token_hash,
)
from streamserve.server.service.registry import ResumeTokenError

TOKEN = "the-right-token"


@pytest.fixture(scope="module")
def snap() -> Iterator[Snapshot]:
    engine: Engine = default_engine()
    try:
        with engine.open_session() as s:
            s.append(text="In the beginning God created the heaven and the earth.")
            yield s.snapshot()  # type: ignore[misc]
    finally:
        engine.shutdown()


def record(snap: Snapshot, sid: str = "abcDEF123_-x", ttl: float = 60.0, **kw: object) -> HandoffRecord:
    return HandoffRecord(sid, token_hash(TOKEN), snap, time.time() + ttl, {"temperature": 0.0, "stop": ["\n"]},
                         7, 0.25, **kw)  # type: ignore[arg-type]


def files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_a_put_is_private_and_whole_and_a_claim_gives_it_back(tmp_path: Path, snap: Snapshot) -> None:
    store = DirectoryStore(tmp_path / "store")
    chat = {"messages": {"rows": [{"role": "user", "content": "hi"}], "gap": None}}
    store.put(record(snap, chat=chat, recent=[{"session": "abcDEF123_-x", "seq": 0, "capture_time": None}]))
    root = tmp_path / "store"
    assert files(root) == ["abcDEF123_-x.rec"]  # no temporary file left
    assert stat.S_IMODE(os.stat(root / "abcDEF123_-x.rec").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert TOKEN.encode() not in (root / "abcDEF123_-x.rec").read_bytes()  # its hash only
    claim = store.claim("abcDEF123_-x", TOKEN, snap.model)
    r = claim.record
    assert r.snapshot.token_ids.kept() == snap.token_ids.kept() and r.snapshot.kv_length == snap.kv_length
    assert r.sampling == {"temperature": 0.0, "stop": ["\n"]} and r.reserved_pages == 7 and r.chunk_budget == 0.25
    assert r.chat == chat and r.recent[0]["seq"] == 0
    assert files(root) != ["abcDEF123_-x.rec"]  # claimed: under a name of its own
    with pytest.raises(SessionNotFoundError):  # nobody else can take it meanwhile
        store.claim("abcDEF123_-x", TOKEN, snap.model)
    claim.commit()
    assert files(root) == []


def test_a_wrong_token_takes_nothing_and_the_right_one_still_resumes(tmp_path: Path, snap: Snapshot) -> None:
    store = DirectoryStore(tmp_path)
    store.put(record(snap))
    for wrong in ("", "x" * 43, TOKEN + "x"):
        with pytest.raises(ResumeTokenError):
            store.claim("abcDEF123_-x", wrong, snap.model)
    assert files(tmp_path) == ["abcDEF123_-x.rec"]
    store.claim("abcDEF123_-x", TOKEN, snap.model).commit()


def test_two_claimers_at_once_get_one_record(tmp_path: Path, snap: Snapshot) -> None:
    store = DirectoryStore(tmp_path)
    for round_ in range(8):
        sid = f"race{round_}"
        store.put(record(snap, sid))
        start = threading.Barrier(2)
        won: list[object] = []
        lost: list[BaseException] = []

        def claim(sid: str = sid, start: threading.Barrier = start, won: list[object] = won,
                  lost: list[BaseException] = lost) -> None:
            start.wait()
            try:
                won.append(store.claim(sid, TOKEN, snap.model))
            except SessionNotFoundError as e:
                lost.append(e)

        threads = [threading.Thread(target=claim) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1 and len(lost) == 1, (won, lost)


@pytest.mark.parametrize("bad", ["../escape", "a/b", "", ".", "..", "x" * 129, "id with space", "ä", "a.rec"])
def test_session_ids_outside_the_engines_alphabet_never_become_file_names(tmp_path: Path, snap: Snapshot,
                                                                          bad: str) -> None:
    store = DirectoryStore(tmp_path / "store")
    with pytest.raises(BadSessionIdError):
        store.put(record(snap, bad))
    with pytest.raises(BadSessionIdError) as info:
        store.claim(bad, TOKEN, snap.model)
    assert info.value.code == "unknown_session"
    with pytest.raises(BadSessionIdError):
        store.discard(bad)
    assert files(tmp_path) == ["store"] and files(tmp_path / "store") == []


def test_damaged_records_are_typed_errors_and_removed_and_the_rest_stays_usable(tmp_path: Path,
                                                                               snap: Snapshot) -> None:
    store = DirectoryStore(tmp_path)
    store.put(record(snap, "good"))
    store.put(record(snap, "cut"))
    whole = (tmp_path / "cut.rec").read_bytes()
    (tmp_path / "cut.rec").write_bytes(whole[:len(whole) // 2])  # a truncated payload
    (tmp_path / "junk.rec").write_bytes(b"not a header\n" + whole)
    header = whole.split(b"\n", 1)[0]
    (tmp_path / "tampered.rec").write_bytes(header.replace(b'"session"', b'"sessionx"') + b"\n" + b"\0" * 64)
    for sid in ("cut", "junk", "tampered"):
        with pytest.raises(DamagedRecordError) as info:
            store.claim(sid, TOKEN, snap.model)
        assert info.value.code == "unknown_session"
    assert files(tmp_path) == ["good.rec"]
    store.claim("good", TOKEN, snap.model).commit()


def test_a_record_of_another_model_stays_for_an_instance_that_serves_it(tmp_path: Path, snap: Snapshot) -> None:
    store = DirectoryStore(tmp_path)
    store.put(record(snap))
    with pytest.raises(ForeignModelError):
        store.claim("abcDEF123_-x", TOKEN, "another-model-fingerprint")
    assert files(tmp_path) == ["abcDEF123_-x.rec"]
    claim = store.claim("abcDEF123_-x", TOKEN, snap.model)
    claim.release()  # not restored here (no room): back for another try
    assert files(tmp_path) == ["abcDEF123_-x.rec"]


def test_records_past_the_resume_ttl_are_discarded(tmp_path: Path, snap: Snapshot) -> None:
    store = DirectoryStore(tmp_path)
    store.put(record(snap, "old", ttl=-1.0))
    store.put(record(snap, "older", ttl=-5.0))
    store.put(record(snap, "fresh", ttl=60.0))
    with pytest.raises(SessionNotFoundError):
        store.claim("old", TOKEN, snap.model)
    assert files(tmp_path) == ["fresh.rec", "older.rec"]
    (tmp_path / "left.rec.claimed-0123").write_bytes(b"x")  # an instance died mid-restore
    (tmp_path / ".left.0123.tmp").write_bytes(b"x")  # ... or mid-put
    assert store.expire() == 1 and files(tmp_path) == [".left.0123.tmp", "fresh.rec", "left.rec.claimed-0123"]
    assert store.expire(now=time.time() + 2 * 3600) == 3 and files(tmp_path) == []
    store.put(record(snap, "fresh"))
    assert store.discard("fresh") and not store.discard("fresh")


def test_a_store_that_cannot_be_made_fails_each_put_typed(tmp_path: Path, snap: Snapshot) -> None:
    (tmp_path / "file").write_text("not a directory")
    store = DirectoryStore(tmp_path / "file" / "store")  # said in the log; the server still starts
    with pytest.raises(SnapshotError):
        store.put(record(snap))
    with pytest.raises(SessionNotFoundError):
        store.claim("abcDEF123_-x", TOKEN, snap.model)
    assert store.expire() == 0
