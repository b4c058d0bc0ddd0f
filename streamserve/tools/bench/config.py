"""The bench's settings: one frozen dataclass, the single source of the `streamserve bench` flags and defaults
(streamserve/cli/args.py generates the flags from it), and the check that keeps the load on loopback.

No import of the client SDK here: the CLI imports this module to build its parser on every `streamserve` run.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from streamserve.errors import InvalidInputError

PROBE_TIMEOUT_S = 15.0  # connecting and the first answer of a probe (pages, policy metadata, voice settings)


@dataclass(frozen=True)
class BenchConfig:
    url: str = field(default="ws://127.0.0.1:8000", metadata={
        "help": "the server to load (`streamserve serve`); only loopback addresses unless --allow-remote"})
    policy_url: str | None = field(default=None, metadata={
        "help": "the server whose /v1/policy the policy sessions use, when another server serves the policy model "
                "(`streamserve serve --model default-policy`); default: --url"})
    key: str | None = field(default=None, metadata={
        "help": "the server's API key (default: $STREAMSERVE_API_KEY); without it the server's stats are not "
                "sampled on a server that has a key"})
    text: int = field(default=0, metadata={"help": "native text sessions (client SDK) at once"})
    voice: int = field(default=0, metadata={"help": "/v1/realtime voice sessions (synthesised speech) at once"})
    policy: int = field(default=0, metadata={"help": "robot policy loops (at --policy-hz, /v1/policy) at once"})
    duration: float = field(default=30.0, metadata={"help": "seconds each session runs"})
    chunk_ms: int = field(default=200, metadata={
        "help": "text sessions append one chunk every CHUNK_MS; an append acked later than that (after the chunk's "
                "scheduled time) is a missed deadline"})
    reply_every: int = field(default=10, metadata={
        "help": "a text session asks for a reply every REPLY_EVERY chunks (0: never)"})
    reply_tokens: int = field(default=16, metadata={"help": "tokens of each text reply (greedy)"})
    window: int = field(default=512, metadata={
        "help": "the text sessions' KV window (4 sinks), so that long runs stay in bounded memory; 0: the "
                "server's default"})
    voice_reply_tokens: int = field(default=24, metadata={"help": "max_output_tokens of each voice reply"})
    voice_turn_ms: float = field(default=5000.0, metadata={
        "help": "a voice turn answered later than this (end of speech -> first reply audio) is a missed deadline "
                "(5 s suits the voice models on a CPU; set what your users can bear)"})
    policy_hz: float = field(default=50.0, metadata={
        "help": "the policy loops' control rate: every tick is a deadline for an action (default 50 Hz)"})
    policy_replan: int | None = field(default=None, metadata={
        "help": "control ticks between a policy loop's observations (default: half the policy's action chunk)"})
    turn_timeout: float = field(default=30.0, metadata={
        "help": "seconds a reply, a voice turn or any call may take before it counts as an error (`timeout`)"})
    report: str | None = field(default=None, metadata={"help": "also write the JSON report to this file"})
    server_pid: int | None = field(default=None, metadata={
        "help": "the server's process id, for its RSS (default: found from the listening port in /proc)"})
    allow_remote: bool = field(default=False, metadata={
        "help": "allow a URL that is not a loopback address (load only servers you operate)"})
    no_progress: bool = field(default=False, metadata={"help": "no progress bar on stderr"})
    strict: bool = field(default=False, metadata={
        "help": "exit with status 3 when any session was not held (missed deadlines, errors, ended early)"})

    def __post_init__(self) -> None:
        for name in ("text", "voice", "policy", "reply_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInputError(f"--{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        if self.text + self.voice + self.policy == 0:
            raise InvalidInputError("nothing to run: give --text N, --voice N and/or --policy N")
        if not (isinstance(self.duration, (int, float)) and math.isfinite(self.duration) and self.duration > 0):
            raise InvalidInputError(f"--duration must be a number of seconds > 0, got {self.duration!r}")
        if not 20 <= self.chunk_ms <= 10_000:
            raise InvalidInputError(f"--chunk-ms must be from 20 to 10000, got {self.chunk_ms}")
        if self.reply_tokens < 1 or self.voice_reply_tokens < 1:
            raise InvalidInputError("--reply-tokens and --voice-reply-tokens must be >= 1")
        if self.window < 0 or (self.policy_replan is not None and self.policy_replan < 1):
            raise InvalidInputError("--window must be >= 0 and --policy-replan >= 1")
        if isinstance(self.policy_hz, bool) or not isinstance(self.policy_hz, (int, float)) \
                or not math.isfinite(self.policy_hz) or not 0 < self.policy_hz <= 1000:
            raise InvalidInputError(f"--policy-hz must be a rate in (0, 1000], got {self.policy_hz!r}")
        if not (math.isfinite(self.voice_turn_ms) and self.voice_turn_ms > 0):
            raise InvalidInputError(f"--voice-turn-ms must be > 0, got {self.voice_turn_ms!r}")
        if not (math.isfinite(self.turn_timeout) and self.turn_timeout > 0):
            raise InvalidInputError(f"--turn-timeout must be > 0, got {self.turn_timeout!r}")
        for url in (self.url, self.policy_url):
            if url is not None:
                check_url(url, self.allow_remote)


def check_url(url: str, allow_remote: bool) -> None:
    """A ws:// or wss:// URL whose host is a loopback address (127.0.0.0/8, ::1, `localhost`), or any host with
    `allow_remote`; InvalidInputError otherwise. Host names are never resolved: a name that points at loopback is
    still refused (the check must not depend on DNS)."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise InvalidInputError(f"the URL must be ws://HOST:PORT or wss://HOST:PORT, got {url!r}")
    if allow_remote or is_loopback(parts.hostname):
        return
    raise InvalidInputError(f"{parts.hostname} is not a loopback address: streamserve bench loads only servers on "
                            "this machine (127.0.0.1, ::1, localhost) unless --allow-remote is given")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
