"""`streamserve chat`: a conversation in the terminal on one persistent session, rendered by the model's
chat template (`engine.chat.ChatTranscript`: each turn appends only its own tokens).

Lines typed (or piped in: stdin need not be a terminal) are user messages; the reply streams back. Ctrl-C
stops a reply (what it said stays, as the assistant's message), Ctrl-D (end of input) quits.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from streamserve.cli.args import add_config_args, config_from_args, load_engine
from streamserve.config import EngineConfig, SamplingConfig, SessionConfig
from streamserve.errors import StreamserveError

if TYPE_CHECKING:  # the engine (and torch) load only when the command runs, not for `streamserve --help`
    from streamserve.engine.chat import ChatTranscript
    from streamserve.engine.work import Ack

HELP = """commands:
  /rewind   undo the last exchange (your last message and the reply to it)
  /reset    start a new conversation (the session's KV pages go back)
  /stats    tokens in the session, KV pages and bytes held, the last reply's speed, the decode step
  /help     this text
Ctrl-C stops a reply (what it said so far stays); Ctrl-D quits."""


def register(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this sub-command with `add_parser` (argparse's `add_subparsers().add_parser`)."""
    p = add_parser("chat", help="talk to an instruct model in the terminal (its chat template, one persistent session)",
                   description="A conversation on one persistent session: each message is rendered with the\n"
                               "model's chat template and only its own tokens are appended; replies stream back.\n"
                               "Reads lines from standard input (a terminal or a pipe).\n\n" + HELP,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, EngineConfig)
    add_config_args(p, SessionConfig)
    add_config_args(p, SamplingConfig)
    p.add_argument("--system", help="a system prompt: the conversation's first message")
    p.set_defaults(run=cmd_chat)


class Terminal:
    """The conversation, its session and what `/stats` reports."""

    def __init__(self, engine: Any, args: argparse.Namespace) -> None:
        self.engine, self.system = engine, args.system
        self.sc: SessionConfig = config_from_args(SessionConfig, args)
        self.sampling: SamplingConfig = config_from_args(SamplingConfig, args)
        self.last: dict[str, float] = {}  # the last reply's tokens, seconds to the first token, tokens/s
        self.chat = self._open()

    def _open(self) -> ChatTranscript:
        from streamserve.engine.chat import ChatTranscript

        sc = self.sc
        session = self.engine.open_session(window=sc.window, sinks=sc.sinks, positions=sc.positions,
                                           seed=self.sampling.seed, page_cap=sc.page_cap)
        try:
            return ChatTranscript(session)  # refuses a model without a chat template
        except BaseException:
            session.close()
            raise

    def close(self) -> None:
        self.chat.session.close()

    def say(self, line: str, out: Any) -> None:
        """One exchange: the user's line, then the streamed reply (Ctrl-C stops it)."""
        from streamserve.engine.chat import ChatReply

        t0 = time.perf_counter()
        chat, sp = self.chat, self.sampling
        message = {"role": "user", "content": line}
        # the system prompt goes in with the first message: templates that fold it into the first user turn
        # (Gemma's) render it alone otherwise than followed by one
        turn = chat.plan_message([{"role": "system", "content": self.system}, message]
                                 if self.system and not chat.messages else message)
        stopped = _wait(chat.session.submit_chunk(token_ids=turn.ids))
        chat.commit(turn)
        first = reply = None
        if stopped:  # Ctrl-C before the reply began: the message goes too (and a system prompt with it)
            chat.rewind(len(chat.messages) - 1)
        else:
            try:
                prompt = chat.plan_prompt()
                stopped = _wait(chat.session.submit_chunk(token_ids=prompt.ids)) if prompt.ids else False
                chat.commit(prompt)
                reply = ChatReply(chat, chat.start_stream(max_tokens=sp.max_tokens, temperature=sp.temperature,
                                                          top_p=sp.top_p, top_k=sp.top_k))
                if stopped:
                    raise KeyboardInterrupt
                for delta in reply:
                    if delta.token_ids and first is None:
                        first = time.perf_counter()
                    out.write(delta.text)
                    out.flush()
            except KeyboardInterrupt:
                stopped = True
                if reply is not None:  # the reply ends within one step; what it produced is recorded
                    reply.stream.cancel()
                    reply.wait()
            except StreamserveError:  # no reply (e.g. its generation prompt would pass the context): the turn
                if reply is None:  # is refused whole, or the next message would follow an unanswered one
                    chat.rewind(len(chat.messages) - 1)
                raise
        if stopped:
            out.write(" [stopped]")
        end = time.perf_counter()
        out.write("\n")
        out.flush()
        tokens = len(reply.stream.token_ids) if reply is not None else 0
        after_first = end - first if first is not None else 0.0
        self.last = {"tokens": tokens, "ttft_s": (first or end) - t0,
                     "tokens_per_s": (tokens - 1) / after_first if tokens > 1 and after_first > 0 else 0.0}

    def rewind(self) -> str:
        users = [i for i, m in self.chat.messages.items() if m["role"] == "user"]  # numbers: some may be forgotten
        if not users:
            return "nothing to undo"
        self.chat.rewind(users[-1])
        return f"undone: the conversation has {len(self.chat.messages)} message(s), {len(self.chat.session)} tokens"

    def reset(self) -> str:
        self.close()
        self.chat = self._open()
        self.last = {}  # /stats speaks of this conversation's replies only
        return "new conversation"

    def stats(self) -> str:
        s, e = self.chat.session, self.engine
        per_page = e.stats()["kv_bytes"] / max(1, e.stats()["kv_pages_used"])
        lines = [f"session tokens: {len(s)}", f"messages: {len(self.chat.messages)}",
                 f"kv pages held: {s.pages_held} ({s.pages_held * per_page / 2**20:.2f} MiB)"]
        if self.last:
            lines += [f"last reply: {self.last['tokens']:.0f} tokens, first token after "
                      f"{self.last['ttft_s'] * 1e3:.0f} ms, {self.last['tokens_per_s']:.1f} tokens/s"]
        return "\n".join([*lines, f"decode step: {decode_step(e.stats()['compiled_step'])}"])


def decode_step(compiled: dict[str, Any] | None) -> str:
    """/stats' line on the compiled decode step (engine stats' `compiled_step`)."""
    if compiled is None:
        return "eager (--cpu-compile off, or not a CPU with torch kernels)"
    if compiled["state"] == "active":
        return f"compiled ({compiled['steps_compiled']} steps so far, {compiled['steps_eager']} eager)"
    if compiled["state"] == "compiling":
        return "compiling in the background (eager until ready)"
    return "eager (its compile failed: run with --verbose to see why)"


def _wait(ack: Future[Ack]) -> bool:
    """Wait for a chunk's ack through Ctrl-C (the engine takes the chunk whatever happens, and the transcript must
    count it); -> whether Ctrl-C was pressed meanwhile. A refused chunk raises its error."""
    stopped = False
    while True:
        try:
            ack.result()
            return stopped
        except KeyboardInterrupt:
            stopped = True


def cmd_chat(args: argparse.Namespace) -> int:
    notes: queue.SimpleQueue[str] = queue.SimpleQueue()  # e.g. "the compiled decode step serves": between replies
    engine = load_engine(args, tell=notes.put)
    term = Terminal(engine, args)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chat with {engine.name}. /help for commands; Ctrl-C stops a reply, Ctrl-D quits.", file=sys.stderr)
    commands = {"/rewind": term.rewind, "/reset": term.reset, "/stats": term.stats, "/help": lambda: HELP}
    try:
        while True:
            while not notes.empty():
                print(notes.get(), file=sys.stderr)
            try:
                line = input("> " if interactive else "")
            except EOFError:
                return 0
            except KeyboardInterrupt:  # at the prompt: a fresh line, nothing else
                print(file=sys.stderr)
                continue
            line = line.strip()
            if not line:
                continue
            if line.startswith("/"):
                command = commands.get(line.split()[0])
                try:
                    print(command() if command is not None else f"unknown command {line.split()[0]}; /help lists them")
                except StreamserveError as e:  # e.g. a /rewind past what sliding-window layers keep: the chat goes on
                    print(f"streamserve: error: {e}", file=sys.stderr)
                sys.stdout.flush()
                continue
            try:
                term.say(line, sys.stdout)
            except StreamserveError as e:  # this turn is refused (e.g. the context is full); the chat goes on
                print(f"streamserve: error: {e}", file=sys.stderr)
    finally:
        term.close()
        engine.shutdown()
