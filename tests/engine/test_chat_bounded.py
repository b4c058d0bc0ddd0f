"""An endless (windowed) chat session holds a bounded host state (issue 17): the transcript forgets the messages
whose tokens the session forgot, each turn renders a bounded conversation, the Python heap does not grow over
thousands of messages; a rewind to a forgotten message is refused typed, to a kept one works; forgetting changes
no output (engine/chat.py `_forget`, engine/chat_log.py)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from chat_checkpoints import IM_END, NL, SPACE, TAB, chat_checkpoint, scripted, write_chat_tokenizer
from helpers import make_checkpoint

from streamserve import Engine
from streamserve.engine.chat import ChatTranscript, ForgottenMessagesError
from streamserve.engine.chat_log import GapList
from streamserve.engine.token_log import ForgottenTokensError
from streamserve.errors import RewindError

WINDOW, SINKS = 64, 4
USERS, WARM = 2_000, 400  # user messages sent (a reply after every fourth: 2,500 messages); measured from WARM on
HEAP_GROWTH = 256 << 10  # bytes the Python heap may grow after warm-up (keeping every message grew it by ~0.7 MiB)
KINDS = {"chatml-hi": ("chatml", [NL, SPACE, *scripted("hi"), TAB, IM_END]), "chatml": ("chatml", None),
         "gemma": ("gemma", None)}


def printable_checkpoint(folder: Path, kind: str) -> Path:
    """A random chat checkpoint whose greedy replies are printable ASCII but space (0x21..0x7e: the other output
    rows are zero): text no template trims, each byte a whole character, so a reply is never cut back when it is
    recorded (a session window reaches less than a page back, where such a cut can fail)."""
    model = make_checkpoint(folder, "qwen3")
    with torch.no_grad():
        other = torch.ones(model.lm_head.weight.shape[0], dtype=torch.bool)
        other[0x21:0x7F] = False
        model.lm_head.weight[other] = 0.0
    model.save_pretrained(folder)
    write_chat_tokenizer(folder, kind, "<|im_end|>" if kind == "chatml" else "<|endoftext|>")
    return folder


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    root = tmp_path_factory.mktemp("chat-bounded")
    out = {name: Engine.from_pretrained(chat_checkpoint(root / name, kind, script) if script else
                                        printable_checkpoint(root / name, kind), device="cpu", kv_memory="64MiB")
           for name, (kind, script) in KINDS.items()}
    yield out
    for e in out.values():
        e.shutdown()


class RenderCounter:
    """Counts the renderings of the chat template and the most messages one was given (since `reset`), in two
    ints: a list of every call would itself grow the heap measured."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = self.most = 0
        render = ChatTranscript.render

        def counted(chat: ChatTranscript, messages: Any, generation_prompt: bool = False) -> str:
            messages = list(messages)
            self.calls, self.most = self.calls + 1, max(self.most, len(messages))
            return render(chat, messages, generation_prompt)

        monkeypatch.setattr(ChatTranscript, "render", counted)

    def reset(self) -> None:
        self.calls = self.most = 0


def _turn(chat: ChatTranscript, i: int) -> None:
    chat.add({"role": "user", "content": f"question {i}"})
    if i % 4 == 3:
        assert chat.reply(max_tokens=8).wait() == " hi\t"


def _held(chat: ChatTranscript) -> tuple[int, int, int, int]:
    """What the transcript holds: messages, starts, offsets, characters of rendering."""
    return chat.messages.stored, chat.starts.stored, chat.offsets.stored, len(chat.rendered)


def test_an_endless_chat_keeps_a_bounded_transcript(engines: dict[str, Engine], monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    engine = engines["chatml-hi"]
    counter = RenderCounter(monkeypatch)
    # after warm-up, running maxima (lists would grow the heap): what the transcript holds (messages, starts,
    # offsets, characters of rendering), renderings in one turn, messages one rendering was given (in each half)
    held, calls, rendered = (0, 0, 0, 0), 0, [0, 0]
    gc.collect()
    tracemalloc.start()
    try:
        with engine.open_session(window=WINDOW, sinks=SINKS) as s:
            chat = ChatTranscript(s)
            for i in range(WARM):
                _turn(chat, i)
            gc.collect()
            heap0 = tracemalloc.get_traced_memory()[0]
            for i in range(WARM, USERS):
                counter.reset()
                _turn(chat, i)
                held = tuple(max(a, b) for a, b in zip(held, _held(chat), strict=True))
                calls, half = max(calls, counter.calls), int(i >= (WARM + USERS) // 2)
                rendered[half] = max(rendered[half], counter.most)
            gc.collect()
            heap1 = tracemalloc.get_traced_memory()[0]
            assert len(chat.messages) == USERS + USERS // 4 and chat.messages.gap is not None
            assert chat.messages[-2:] == [{"role": "user", "content": f"question {USERS - 1}"},
                                          {"role": "assistant", "content": " hi\t"}]
            assert chat.messages[0] == {"role": "user", "content": "question 0"}  # the head: for ever
            # the session stands for the rendering of the messages kept, the forgotten ones' text cut out
            k = next(k for k, at in chat.starts.items() if at >= s.token_ids.base)
            assert chat.template.decode(s.token_ids[chat.starts[k]:]) + chat.pending == chat.rendered[chat.offsets[k]:]
    finally:
        tracemalloc.stop()
    print(f"\nafter warm-up ({WARM} user messages) to {USERS}: Python heap {heap0 / 2**20:.2f} -> "
          f"{heap1 / 2**20:.2f} MiB; most held (messages, starts, offsets, rendered chars): {held}; most "
          f"renderings in a turn {calls}, most messages rendered (each half) {rendered}")
    assert heap1 - heap0 < HEAP_GROWTH, f"the Python heap grew by {(heap1 - heap0) / 2**10:.0f} KiB"
    # the session keeps ~100 tokens (sinks, window, a page or two): a few messages of ~13 tokens (a reply's
    # exchange ~30), plus the head, a batch not yet forgotten and the last exchange
    assert held[0] == held[1] == held[2] <= 24 and held[3] <= 24 * 60
    # the work of a turn does not grow with the conversation: a message's and a reply's renderings and at most
    # one check of a forgetting each; what one rendering is given is bounded, and no more in the second half
    assert calls <= 5 and rendered[0] <= 25 and rendered[1] <= rendered[0]


def _forgotten_chat(engine: Engine, s: Any) -> ChatTranscript:
    chat = ChatTranscript(s)
    i = 0
    while chat.messages.gap is None or chat.messages.gap[1] < 40:
        _turn(chat, i)
        i += 1
    return chat


def test_a_rewind_to_a_forgotten_message_is_refused_and_to_a_kept_one_works(engines: dict[str, Engine]) -> None:
    engine = engines["chatml-hi"]
    with engine.open_session(window=WINDOW, sinks=SINKS) as s, engine.open_session(window=WINDOW, sinks=SINKS) as f:
        chat = _forgotten_chat(engine, s)
        lo, hi = chat.messages.gap
        begun, resumed = chat.forgot
        state = (list(s.token_ids), chat.messages.kept(), chat.rendered, len(chat.messages))
        for k in (lo, (lo + hi) // 2, hi - 1):
            with pytest.raises(ForgottenMessagesError, match=f"message {k} of this chat was forgotten") as e:
                chat.rewind(k)
            assert e.value.code == "tokens_forgotten"
            assert isinstance(e.value, ForgottenTokensError) and isinstance(e.value, RewindError)
        with pytest.raises(ForgottenMessagesError, match="forgotten"):
            chat.messages[lo]
        with pytest.raises(ForgottenMessagesError, match="which the endless session forgot"):
            chat.messages_within(to=(begun + resumed) // 2)
        assert (list(s.token_ids), chat.messages.kept(), chat.rendered, len(chat.messages)) == state  # unchanged
        assert chat.messages_within(to=resumed) == hi and chat.messages_within(to=chat.length) == len(chat.messages)
        assert chat.messages_within(to=begun - 1) == lo - 1
        # the latest message, once the window lets the session go back to its start: a window gives its pages
        # back as soon as no query needs them, so a rewind reaches less than a page back (a short message, 9 tokens)
        for i in range(32):
            chat.add({"role": "user", "content": f"{i % 10}"})
            if s.core.kv.can_rewind(chat.starts[-1] - 1):
                break
        n, at = len(chat.messages), chat.starts[-1]
        assert chat.rewind(n - 1) == at == len(s.token_ids) and len(chat.messages) == n - 1
        assert chat.messages[-1]["content"] == f"{(i - 1) % 10}" and chat.messages.gap[0] == lo
        chat.add({"role": "user", "content": "again"})
        assert chat.reply(max_tokens=8).wait() == " hi\t"
        # into the sinks (the head): the chat is then exactly its first messages, as a fresh one fed them
        assert chat.rewind(0) == 0 and chat.messages == [] and chat.messages.gap is None and chat.forgot is None
        assert chat.rendered == "" and len(s.token_ids) == 0
        fresh = ChatTranscript(f)
        for c in (chat, fresh):
            c.add({"role": "user", "content": "from the start"})
            c.reply(max_tokens=8).wait()
        assert s.token_ids == f.token_ids and chat.messages == fresh.messages and chat.rendered == fresh.rendered


def _script(engine: Engine, kind: str) -> tuple[list[Any], ChatTranscript]:
    """A conversation on a windowed session: messages added, streamed in, appended together; greedy replies."""
    out: list[Any] = []
    s = engine.open_session(window=WINDOW, sinks=SINKS)
    chat = ChatTranscript(s)
    if kind == "gemma":  # a system prompt folded into the first user turn: the two go in together
        chat.add([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"}])
    else:
        chat.add({"role": "user", "content": "first"})
    out.append(chat.reply(max_tokens=6, temperature=0.0).wait())
    for i in range(60):
        if i % 3 == 1:
            chat.begin_message("user")
            for piece in (" streamed", f" {i} ", "words "):
                chat.extend_message(piece)
            out.append(chat.end_message())
        else:
            chat.add({"role": "user", "content": f"turn {i}"})
        out.append(chat.reply(max_tokens=6 + i % 5, temperature=0.0).wait())
    chat.settle()
    out += [list(s.token_ids), chat.messages.kept()[-6:], len(chat.messages)]
    return out, chat


@pytest.mark.parametrize("kind", ["chatml", "gemma"])
def test_forgetting_messages_changes_no_output(engines: dict[str, Engine], monkeypatch: pytest.MonkeyPatch,
                                               kind: str) -> None:
    """The same conversation with every message kept (the code before bounding it) gives the same replies and
    tokens; Gemma's alternating roles are kept (an even number of messages goes)."""
    engine = engines[kind]
    bounded, chat = _script(engine, kind)
    assert chat.messages.gap is not None and chat.messages.stored < len(chat.messages) // 3
    assert chat.rendered.startswith(chat.render(chat.messages[:chat.messages.gap[0]]))
    chat.session.close()
    monkeypatch.setattr(ChatTranscript, "_forget", lambda self: None)
    whole, full = _script(engine, kind)
    assert full.messages.gap is None
    assert bounded == whole
    # what the bounded transcript renders is the whole one's rendering, the forgotten messages' text cut out
    (lo, hi), offsets = chat.messages.gap, full.offsets
    assert kind != "gemma" or (hi - lo) % 2 == 0  # its roles alternate: an even number of messages went
    assert chat.rendered == full.rendered[:offsets[lo]] + full.rendered[offsets[hi]:]
    full.session.close()


def test_a_template_that_numbers_turns_keeps_every_message(engines: dict[str, Engine], monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Without the earlier messages the later ones would render otherwise: nothing is forgotten (as before)."""
    engine = engines["chatml-hi"]
    monkeypatch.setattr(engine.tokenizer, "chat_template",
                        "{% for m in messages %}{{ loop.index }} <|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}{{ messages | length + 1 }} "
                        "<|im_start|>assistant\n{% endif %}")
    with engine.open_session(window=WINDOW, sinks=SINKS) as s:
        chat = ChatTranscript(s)
        for i in range(60):
            _turn(chat, i)
        assert s.token_ids.gap is not None and not chat._forgets and "keeps every message" in caplog.text
        assert chat.messages.gap is None and chat.messages.stored == len(chat.messages) == 75
        assert chat.rendered == chat.render(chat.messages)


def test_a_gap_list_reads_as_the_list_it_keeps() -> None:
    ref = list(range(30))
    rows: GapList[int] = GapList(ref)
    assert rows == ref and rows[3:7] == ref[3:7] and rows[-1] == 29
    rows.forget(2, 10)
    rows.forget(2, 14)  # widens the gap at its end
    assert len(rows) == 30 and rows.gap == (2, 14) and rows.stored == 18 and list(rows) == ref[:2] + ref[14:]
    assert list(rows.items()) == [(i, i) for i in (*ref[:2], *ref[14:])]
    assert rows[14:20] == ref[14:20] and rows[-3:] == ref[-3:] and rows[:2] == ref[:2]
    for key in (2, 13, slice(1, 3), slice(10, 20)):
        with pytest.raises(ForgottenMessagesError):
            rows[key]
    with pytest.raises(ForgottenMessagesError):
        del rows[5:]
    del rows[20:]
    assert len(rows) == 20 and rows.gap == (2, 14) and rows[19] == 19
    assert rows == GapList(rows.kept(), rows.gap) and rows != GapList(rows.kept())
    del rows[1:]  # into the head: the gap goes with the rest
    assert rows == [0] and rows.gap is None and len(rows) == 1
