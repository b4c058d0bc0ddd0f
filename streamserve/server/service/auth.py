"""Who may use the server: the API key, short-lived client secrets, and the browser Origin allow-list.

A request authenticates with the API key or a live client secret, given either as `Authorization:
Bearer VALUE` or, for browsers (which cannot set headers on a WebSocket), inside the WebSocket
subprotocol list: `openai-insecure-api-key.VALUE` (OpenAI's browser convention) or
`streamserve-key.VALUE`. Those protocol entries are secrets and are never echoed back; the server echoes
only a non-secret protocol the client offered (browsers fail a handshake that answers none of theirs).

Client secrets (`POST /v1/realtime/client_secrets`, minted with the API key) are 256 random bits, kept
only as SHA-256 digests (a lookup by digest compares nothing secret-dependent), live 10 to 7200 s, and
each authenticates ONE session: the first one opened with it, and resumes of that session. The store is
bounded; expired secrets are purged. Every comparison with the key is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from streamserve.config import ServerConfig
from streamserve.errors import InvalidInputError
from streamserve.server.service.results import ClientSecretScopeError

SECRET_PROTOCOL_PREFIXES = ("openai-insecure-api-key.", "streamserve-key.")
SECRET_PREFIX = "ek_"  # OpenAI's ephemeral keys start so; the prefix tells secrets and API keys apart in logs
MIN_SECRET_TTL, MAX_SECRET_TTL, DEFAULT_SECRET_TTL = 10, 7200, 600  # OpenAI's bounds, seconds
MAX_LIVE_SECRETS = 4096  # minted and unexpired at once; more are refused (429) until some expire
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


@dataclass(eq=False)
class ClientSecret:
    digest: bytes
    expires_at: float  # wall clock (time.time()), as in the response's expires_at
    session_id: str | None = None  # the one session it authenticates, once opened
    claimed: bool = False  # an open with it is in flight or done
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def expired(self) -> bool:
        return time.time() >= self.expires_at


class Grant:
    """What one authenticated connection may do with sessions. With the API key (or no key configured): anything. With a
    client secret: open one session, the secret's first, and resume only that one. `address` is the client address the
    request came from (server/transports/clients.py; None for an in-process caller), which the limits per address
    count."""

    def __init__(self, secret: ClientSecret | None = None, address: str | None = None) -> None:
        self.secret, self.address = secret, address

    def claim_open(self) -> None:
        """Before an open: take the secret's single session (ClientSecretScopeError when it is taken)."""
        if self.secret is None:
            return
        with self.secret.lock:
            if self.secret.claimed:
                raise ClientSecretScopeError("this client secret already opened its session; resume that session "
                                             "or mint a new secret for another")
            self.secret.claimed = True

    def opened(self, session_id: str | None) -> None:
        """After the open: bind the secret to the session (None: the open failed, the claim is released)."""
        if self.secret is None:
            return
        with self.secret.lock:
            self.secret.session_id = session_id
            self.secret.claimed = session_id is not None

    def check_resume(self, session_id: str) -> None:
        if self.secret is not None and self.secret.session_id != session_id:
            raise ClientSecretScopeError("a client secret may resume only the session it opened")


class Authenticator:
    def __init__(self, api_key: str | None) -> None:
        self.api_key = api_key
        self.secrets: dict[bytes, ClientSecret] = {}
        self.lock = threading.Lock()

    @property
    def required(self) -> bool:
        return self.api_key is not None

    def is_api_key(self, value: str | None) -> bool:
        if self.api_key is None or value is None:
            return False
        return hmac.compare_digest(value.encode(), self.api_key.encode())

    def mint(self, ttl: int) -> tuple[str, ClientSecret]:
        """A new client secret -> (its value, shown once; its record). OverflowError when the store is full."""
        now = time.time()
        with self.lock:
            self.purge(now)
            if len(self.secrets) >= MAX_LIVE_SECRETS:
                raise OverflowError("too many live client secrets")
            value = SECRET_PREFIX + secrets.token_urlsafe(32)  # 256 random bits
            record = ClientSecret(_digest(value), now + ttl)
            self.secrets[record.digest] = record
        return value, record

    def purge(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for digest in [d for d, s in self.secrets.items() if s.expires_at <= now]:
            del self.secrets[digest]

    def grant_for(self, credential: str | None, address: str | None = None) -> Grant | None:
        """The credential a request from `address` carries -> its Grant, or None (401). Without a configured key
        and no credential, everyone is granted; a client secret that is presented must be live in any case."""
        if credential is not None and credential.startswith(SECRET_PREFIX):
            with self.lock:
                record = self.secrets.get(_digest(credential))
                if record is not None and record.expired:
                    del self.secrets[record.digest]
                    record = None
            if record is not None:
                return Grant(record, address)
            if not self.is_api_key(credential):  # an expired or unknown secret is refused, key or not
                return None
        if self.api_key is None or self.is_api_key(credential):
            return Grant(None, address)
        return None


def bearer(header: str | None) -> str | None:
    """The credential of `Authorization: Bearer VALUE`, or of `Api-Key VALUE` (what openpi's client sends)."""
    if header is None:
        return None
    scheme, _, value = header.strip().partition(" ")
    return value.strip() if scheme.lower() in ("bearer", "api-key") and value.strip() else None


def split_protocols(header: str | None) -> tuple[str | None, list[str]]:
    """`Sec-WebSocket-Protocol` -> (the credential it carries, the non-secret protocols offered, in order)."""
    credential, public = None, []
    for item in (header or "").split(","):
        item = item.strip()
        if not item:
            continue
        prefix = next((p for p in SECRET_PROTOCOL_PREFIXES if item.startswith(p)), None)
        if prefix is not None:
            credential = credential or item[len(prefix):]
        else:
            public.append(item)
    return credential, public


def parse_origins(spec: str | None) -> tuple[str, ...]:
    """`--allowed-origins` -> normalised patterns; `scheme://host:*` allows any port."""
    if not spec:
        return ()
    return tuple(o.strip().rstrip("/").lower() for o in spec.split(",") if o.strip())


_ORIGIN = re.compile(r"^(https?)://([^/:]+|\[[0-9a-f:]+\])(?::(\d+))?$")
_IP = re.compile(r"^(\d{1,3}(\.\d{1,3}){3}|\[[0-9a-f:]+\])$")


def origin_allowed(origin: str | None, host_header: str | None, patterns: tuple[str, ...],
                   server_host: str = "127.0.0.1") -> bool:
    """No Origin (a non-browser client): allowed. Otherwise the origin must match the allow-list, or, without
    one, be a loopback page, or be the server's own origin (the Host it was reached at). A Host is trusted as
    the server's own only when it is an IP address, a loopback name or the --host name: a page under any
    other DNS name could be a DNS-rebinding attack (evil.example resolving to this server), so such a
    name must be listed in --allowed-origins."""
    if origin is None:
        return True
    origin = origin.strip().rstrip("/").lower()
    m = _ORIGIN.match(origin)
    if m is None:  # "null" (file://, sandboxed frames) and anything malformed
        return "null" in patterns and origin == "null"
    scheme, host, port = m.group(1), m.group(2), m.group(3)
    if host_header:
        own = host_header.lower()
        own_name = own.rsplit(":", 1)[0] if not own.endswith("]") else own
        trusted = own_name in LOOPBACK_HOSTS or own_name == server_host.lower() or _IP.match(own_name) is not None
        if trusted and origin in (f"http://{own}", f"https://{own}"):
            return True
    if not patterns:
        return host in LOOPBACK_HOSTS
    for p in patterns:
        if p == origin or p == "*":
            return True
        if p.endswith(":*") and f"{scheme}://{host}" == p[:-2] and port is not None:
            return True
    return False


def resolve_api_key(config: ServerConfig) -> str | None:
    """--api-key, else the first line of --api-key-file, else STREAMSERVE_API_KEY, else none."""
    if config.api_key is not None:
        if not config.api_key.strip():  # it would let in anyone offering an empty credential
            raise InvalidInputError("the API key given is empty")
        return config.api_key
    if config.api_key_file is not None:
        try:
            key = Path(config.api_key_file).read_text().strip().splitlines()
        except OSError as e:
            raise InvalidInputError(f"cannot read the API key file {config.api_key_file!r}: {e.strerror}") from None
        if not key or not key[0].strip():
            raise InvalidInputError(f"the API key file {config.api_key_file!r} is empty")
        return key[0].strip()
    return os.environ.get("STREAMSERVE_API_KEY") or None
