"""nginx configuration for N streamserve instances behind one session-affine proxy (`streamserve proxy-config`).

A pure function of its options: `render(ProxyOptions(...))` returns the configuration text; nothing here reads or
writes files. Debian's nginx (`apt-get install nginx-light`, 1.22+) runs it; the open-source build has passive health
checks only, which is what this uses. docs/scale.md ("Scale-out behind nginx") explains every choice.

- Affinity: a client sends `affinity=KEY` as a query parameter of its URL (browsers cannot set headers on a
  WebSocket) or the header `X-Streamserve-Affinity: KEY`; `map` blocks pick the header, else the parameter, else the
  client address, and `hash ... consistent` turns the key into an instance. Adding or removing an instance moves
  only about 1/N of the keys.
- Health: `max_fails`/`fail_timeout` per server; `proxy_next_upstream error timeout http_502 http_503` moves a
  request to the next instance of the ring when its own is down (connection refused), hangs (timeout) or drains
  (503 to WebSocket upgrades and /healthz). POSTs are never retried (`non_idempotent` is left out): a POST that
  timed out may already have made a WebRTC call or minted a client secret on the first instance.
- Long-lived sockets: HTTP/1.1 to the instances, Upgrade/Connection passed through a `map`, an hour of read and
  send timeout, no response buffering (replies stream), `client_max_body_size` at the server's own body limit
  (`--max-frame-bytes`; WebSocket frames after the upgrade are not bodies and nginx does not limit them).
- Client address: `X-Forwarded-For` is appended to, so the instances count per-address limits against the real
  client when started with `--trusted-proxies <nginx's address>`.
- `/admin/` (POST /admin/drain) is not proxied: it concerns one instance, which the operator addresses directly.

Variable, upstream and log-format names start with `streamserve` so that the http-level snippet can sit in
/etc/nginx/conf.d next to other sites: many define their own `map $http_upgrade $connection_upgrade` (often with
"" -> close), and nginx accepts two maps of one variable without a word, one silently replacing the other.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from streamserve.config import ServerConfig
from streamserve.errors import InvalidInputError

DEFAULT_LISTEN = "127.0.0.1:8000"  # loopback: a proxy that serves others is the operator's explicit choice
DEFAULT_INSTANCE_HOST = "127.0.0.1"
DEFAULT_FIRST_PORT = 8001
AFFINITY_PARAM = "affinity"  # the query parameter clients send (clients/python: Client(affinity=...))
AFFINITY_HEADER = "X-Streamserve-Affinity"
SOCKET_TIMEOUT_S = 3600  # read/send: a quiet conversation keeps its socket for an hour
# the folders a standalone configuration uses under its prefix; nginx creates a temp path's last component only
STANDALONE_DIRS = ("logs", "temp")
TEMP_PATHS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")

_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")  # a DNS name or an IPv4 address


@dataclass(frozen=True)
class ProxyOptions:
    """What `render` writes. `upstreams`: the instances as HOST:PORT (IPv6 as [ADDR]:PORT)."""

    upstreams: tuple[str, ...]
    listen: str = DEFAULT_LISTEN
    standalone: bool = False  # a whole nginx.conf for `nginx -p PREFIX -c nginx.conf`, else an http{} snippet
    max_fails: int = 1  # failed attempts within fail_timeout that take an instance out of the ring
    fail_timeout_s: int = 10  # ... for this long, after which one request tries it again
    tries: int | None = None  # instances one request may try (proxy_next_upstream_tries); None: all of them
    connect_timeout_s: int = 5
    socket_timeout_s: int = SOCKET_TIMEOUT_S
    max_body_bytes: int = ServerConfig.max_frame_bytes  # aiohttp's client_max_size on the instances
    keepalive: int = 32  # idle HTTP connections nginx keeps to the instances (WebSockets are not pooled)
    worker_connections: int = 1024  # standalone only; each proxied WebSocket holds two

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise InvalidInputError("proxy-config needs at least one instance (--instances N or --upstream HOST:PORT)")
        for address in self.upstreams:
            split_address(address, "upstream")
        if len(set(self.upstreams)) != len(self.upstreams):
            raise InvalidInputError("proxy-config: the same instance address is listed twice")
        split_address(self.listen, "listen", bare_port=True)
        for name in ("max_fails", "fail_timeout_s", "connect_timeout_s", "socket_timeout_s", "max_body_bytes",
                     "keepalive", "worker_connections"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidInputError(f"proxy-config: {name} must be an integer >= 1, got {v!r}")
        if self.tries is not None and (isinstance(self.tries, bool) or not isinstance(self.tries, int)
                                       or self.tries < 1):
            raise InvalidInputError(f"proxy-config: tries must be an integer >= 1, got {self.tries!r}")


def split_address(address: str, what: str, bare_port: bool = False) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT; with `bare_port` a lone PORT, host 127.0.0.1) -> (host, port), else
    InvalidInputError. Checked strictly: the text goes into an nginx file, so nothing but a name, an address and a
    port may pass (no spaces, semicolons or braces)."""
    text = address.strip()
    if bare_port and text.isdigit():
        host, port_text = DEFAULT_INSTANCE_HOST, text
    elif text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        ok = bool(sep)
        if ok:
            try:
                ok = ipaddress.ip_address(host).version == 6
            except ValueError:
                ok = False
        if not ok:
            raise InvalidInputError(f"{what}: {address!r} is not [IPv6]:PORT")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not _NAME.match(host):
            raise InvalidInputError(f"{what}: {address!r} is not HOST:PORT (IPv6 as [ADDRESS]:PORT)")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise InvalidInputError(f"{what}: {address!r} has no port from 1 to 65535")
    return host, int(port_text)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def instance_addresses(instances: int, host: str = DEFAULT_INSTANCE_HOST,
                       first_port: int = DEFAULT_FIRST_PORT) -> tuple[str, ...]:
    """`--instances N`: instance i listens on host:first_port + i."""
    if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
        raise InvalidInputError(f"--instances must be an integer >= 1, got {instances!r}")
    if first_port < 1 or first_port + instances - 1 > 65535:
        raise InvalidInputError(f"--first-port {first_port} with {instances} instances leaves the ports 1-65535")
    return tuple(join_address(host.strip("[]"), first_port + i) for i in range(instances))


def render(options: ProxyOptions) -> str:
    """The configuration text: an http{}-level snippet, or (standalone) a complete nginx.conf whose pid, logs and
    temp files are relative to nginx's prefix (`-p PREFIX`) and that leaves `daemon` to the command line."""
    body = _http_block(options)
    if not options.standalone:
        return _header(options, "an http{}-level snippet: put it in /etc/nginx/conf.d/streamserve.conf,\n"
                                "# then `nginx -t && systemctl reload nginx`") + body
    temp = "".join(f"    {kind}_temp_path temp/{kind};\n" for kind in TEMP_PATHS)
    return (_header(options, "a complete nginx.conf: `nginx -p PREFIX -c nginx.conf -g 'daemon off;'`\n"
                             "# as any user (pid, logs and temp files under PREFIX)")
            + "worker_processes auto;\n"
              "pid logs/nginx.pid;\n"
              "error_log logs/error.log warn;\n\n"
              "events {\n"
              f"    worker_connections {options.worker_connections};  # each proxied WebSocket holds two\n"
              "}\n\n"
              "http {\n"
              "    default_type application/octet-stream;\n"
            + temp + "\n" + _indent(body)
            + "\n    access_log logs/access.log streamserve;  # after its log_format\n}\n")


def _header(options: ProxyOptions, what: str) -> str:
    return (f"# streamserve proxy-config: {len(options.upstreams)} streamserve instance(s) behind nginx, routed by\n"
            f"# session affinity (docs/scale.md). This is {what}.\n"
            f"# Start each instance with --trusted-proxies <this nginx's address as the instances see it>.\n\n")


def _indent(text: str) -> str:
    return "".join(f"    {line}" if line.strip() else line for line in text.splitlines(keepends=True))


def _http_block(o: ProxyOptions) -> str:
    tries = o.tries if o.tries is not None else len(o.upstreams)
    listen_host, listen_port = split_address(o.listen, "listen", bare_port=True)
    servers = "".join(f"    server {u} max_fails={o.max_fails} fail_timeout={o.fail_timeout_s}s;\n"
                      for u in o.upstreams)
    header_var = "$http_" + AFFINITY_HEADER.lower().replace("-", "_")
    return f"""\
# the affinity key: the {AFFINITY_HEADER} header, else the `{AFFINITY_PARAM}` query parameter, else the client address
map {header_var} $streamserve_affinity_given {{
    ""      $arg_{AFFINITY_PARAM};
    default {header_var};
}}
map $streamserve_affinity_given $streamserve_affinity {{
    ""      $remote_addr;
    default $streamserve_affinity_given;
}}

# WebSocket upgrades pass through; other requests reuse pooled connections (an empty Connection header)
map $http_upgrade $streamserve_connection_upgrade {{
    default upgrade;
    ""      "";
}}

log_format streamserve '$remote_addr [$time_local] "$request" $status $body_bytes_sent '
                       'upstream=$upstream_addr upstream_status=$upstream_status time=$request_time';

upstream streamserve {{
    # consistent hashing (ketama): a key stays on its instance while that instance is up; an instance that fails
    # or drains hands its keys to the next instance of the ring, and only those move
    hash $streamserve_affinity consistent;
{servers}    keepalive {o.keepalive};
}}

server {{
    listen {join_address(listen_host, listen_port)};
    # the instances' own body limit (--max-frame-bytes): SDP offers, client secrets; WebSocket frames are not bodies
    client_max_body_size {o.max_body_bytes};

    location / {{
        proxy_pass http://streamserve;
        proxy_http_version 1.1;
        proxy_set_header Upgrade $http_upgrade;
        proxy_set_header Connection $streamserve_connection_upgrade;
        proxy_set_header Host $http_host;  # the browser's own Host: the instances' Origin check compares with it
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;  # read with --trusted-proxies
        proxy_set_header X-Forwarded-Proto $scheme;

        # long-lived sockets and streamed replies
        proxy_connect_timeout {o.connect_timeout_s}s;
        proxy_read_timeout {o.socket_timeout_s}s;
        proxy_send_timeout {o.socket_timeout_s}s;
        proxy_buffering off;

        # passive health: a refused, hung or draining (503) instance passes the request to the next of the ring;
        # no non_idempotent: a POST that timed out may already have made a call or a secret there
        proxy_next_upstream error timeout http_502 http_503;
        proxy_next_upstream_tries {tries};
    }}

    # an instance's admin routes (POST /admin/drain) name that instance: send them to it, not through a proxy that
    # picks one by affinity key
    location /admin/ {{
        return 404;
    }}
}}
"""
