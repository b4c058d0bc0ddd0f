"""Who the client is, for the limits that count per client address, and what a client may ask of HTTP itself.

The client address (`client_address`) is the TCP peer's address; when the peer is one of `--trusted-proxies` and
the request carries `X-Forwarded-For`, it is the right-most address of that header that is not itself a trusted
proxy (the standard rule: each proxy appends the address it received from, so entries left of the first untrusted
one from the right were written by the client and are never read). A header that cannot be read up to that entry
(an entry that is not an IP address, an empty entry) leaves the peer's address, so a client cannot choose which
address it counts as. IPv4-mapped IPv6 peers (`::ffff:a.b.c.d`, a dual-stack listener) count as their IPv4 address.

`ConnectionCounts` holds the connections (WebSockets and WebRTC calls) each address has open against
`--max-connections-per-ip`; an address over it is refused with `too_many_connections` (WebSocket close 1013, HTTP 429).
Sessions per address are counted by the session registry (server/service/registry.py) from `ClientContext.address`.

`expect` is the `expect_handler` of every route (and, through `answer_unmatched_expectations`, of aiohttp's own 404
and 405 answers): `Expect: 100-continue` (any case) gets the interim 100 on HTTP/1.1, anything else 417 — aiohttp's
default handler echoes the value in its 417 text, and a value that is not UTF-8 made that a 500 (docs/security.md).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import hdrs, web
from aiohttp.web_urldispatcher import MatchInfoError, UrlMappingMatchInfo

from streamserve.errors import InvalidInputError, StreamserveError
from streamserve.server.transports.http_replies import error_response

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
UNKNOWN = "unknown"  # the address of a request whose peer is not known (its transport already gone)


class TooManyConnectionsError(StreamserveError):
    """This client address holds --max-connections-per-ip connections (WebSockets and WebRTC calls together)."""

    code = "too_many_connections"


def parse_address(text: str) -> IPAddress | None:
    """An IP address (IPv4-mapped IPv6 as its IPv4 address), or None when `text` is not one."""
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_trusted_proxies(spec: str | None) -> frozenset[IPAddress]:
    """`--trusted-proxies` -> the addresses; InvalidInputError naming the first entry that is not an IP address."""
    trusted: set[IPAddress] = set()
    for entry in (spec or "").split(","):
        if not entry.strip():
            continue
        address = parse_address(entry)
        if address is None:
            raise InvalidInputError(f"trusted_proxies: {entry.strip()!r} is not an IP address (give the proxies' "
                                    "addresses, comma-separated, e.g. 127.0.0.1,::1)")
        trusted.add(address)
    return frozenset(trusted)


def forwarded_client(peer: str | None, forwarded_for: Iterable[str], trusted: frozenset[IPAddress]) -> str:
    """The client address of a request from `peer` carrying these X-Forwarded-For values (in header order)."""
    address = parse_address(peer) if peer is not None else None
    if address is None:
        return peer if peer else UNKNOWN
    if address not in trusted:
        return str(address)  # the header of an untrusted peer is the client's own claim: ignored
    entries = [e for value in forwarded_for for e in value.split(",")]
    for entry in reversed(entries):
        hop = parse_address(entry)
        if hop is None:  # malformed before an untrusted hop was found: the peer counts
            return str(address)
        if hop not in trusted:
            return str(hop)
    # every entry is a trusted proxy (or there is none): the left-most, the first proxy, else the peer
    first = parse_address(entries[0]) if entries else None
    return str(first if first is not None else address)


def client_address(request: web.Request, trusted: frozenset[IPAddress]) -> str:
    """The address the per-address limits count this request against (see the module docstring)."""
    return forwarded_client(request.remote, request.headers.getall(hdrs.X_FORWARDED_FOR, ()), trusted)


class ConnectionCounts:
    """Connections open per client address, against a limit. Used on the event loop only (no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: Counter[str] = Counter()  # address -> connections; an address at 0 is removed

    def acquire(self, address: str) -> None:
        """Count one more connection of `address`, or TooManyConnectionsError when it holds the limit."""
        if self.open[address] >= self.limit:
            raise TooManyConnectionsError(f"this client address has {self.limit} connections open (the server's "
                                          "limit per address); close one and retry")
        self.open[address] += 1

    def release(self, address: str) -> None:
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]


def close_reason(e: StreamserveError) -> bytes:
    """A WebSocket close reason naming the error's code: at most 123 bytes (RFC 6455), cut at a character."""
    return f"{e.code}: {e}".encode()[:123].decode(errors="ignore").encode()


# ---- Expect ----------------------------------------------------------------------------------------------------------
async def expect(request: web.Request) -> web.StreamResponse | None:
    """The expect_handler of every route: 100 Continue for `100-continue` (HTTP/1.1; HTTP/1.0 clients know no 1xx
    and are simply answered), 417 for any other expectation, one that is not UTF-8 text included."""
    value = request.headers.get(hdrs.EXPECT, "")
    if value.strip().lower() == "100-continue":
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the body's answer is yet to come (as aiohttp's own handler does)
        return None
    return error_response(417, "expectation_failed", "the only expectation this server meets is "
                          "'Expect: 100-continue'")


class _Unmatched(MatchInfoError):
    """aiohttp's 404 / 405 match, answering Expect with ours (its own SystemRoute has aiohttp's default)."""

    @property
    def expect_handler(self) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
        return expect


def answer_unmatched_expectations(app: web.Application) -> None:
    """Requests that match no route (404, 405) meet `expect` too: the router's resolve is wrapped (aiohttp builds
    their route itself, with its default expect handler, and offers no setting for it)."""
    resolve = app.router.resolve

    async def resolved(request: web.Request) -> UrlMappingMatchInfo:
        match = await resolve(request)
        if isinstance(match, MatchInfoError) and not isinstance(match, _Unmatched):
            return _Unmatched(match.http_exception)
        return match

    app.router.resolve = resolved  # type: ignore[method-assign]
