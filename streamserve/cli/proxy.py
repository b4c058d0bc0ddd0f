"""`streamserve proxy-config`: an nginx configuration for N streamserve instances behind one session-affine proxy.

The text comes from `streamserve.tools.nginx.render` (no I/O there); this command only parses flags, creates the
folders a standalone configuration needs under its prefix, and writes the file (or stdout).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from streamserve.errors import InvalidInputError
from streamserve.tools.nginx import (
    AFFINITY_HEADER,
    AFFINITY_PARAM,
    DEFAULT_FIRST_PORT,
    DEFAULT_INSTANCE_HOST,
    DEFAULT_LISTEN,
    SOCKET_TIMEOUT_S,
    STANDALONE_DIRS,
    ProxyOptions,
    instance_addresses,
    render,
)

EXAMPLES = f"""\
examples:
  # two instances on 127.0.0.1:8001 and :8002, nginx on 127.0.0.1:8000, as a conf.d snippet (root, Debian's nginx)
  streamserve proxy-config --instances 2 --out /etc/nginx/conf.d/streamserve.conf && nginx -t && nginx -s reload
  streamserve serve --port 8001 --trusted-proxies 127.0.0.1 --snapshot-store /srv/snapshots &
  streamserve serve --port 8002 --trusted-proxies 127.0.0.1 --snapshot-store /srv/snapshots &

  # any user, no system nginx configuration: a complete nginx.conf under ./proxy
  streamserve proxy-config --instances 2 --standalone ./proxy --out ./proxy/nginx.conf
  nginx -p ./proxy -c nginx.conf -g 'daemon off;'

  # instances on other machines (nginx on 0.0.0.0:443 terminating TLS is yours to add)
  streamserve proxy-config --upstream 10.0.0.5:8000 --upstream 10.0.0.6:8000 --listen 0.0.0.0:8000

Clients choose their instance by an affinity key: `?{AFFINITY_PARAM}=KEY` on the URL (browsers) or the header
`{AFFINITY_HEADER}: KEY`; without either, the client address is the key. The Python SDK sends a random key per
Client (`streamserve_client.connect(url, affinity=...)` to choose it), so a client's sessions and their resumes
land on one instance. docs/scale.md explains the configuration.
"""


def register(add_parser: Callable[..., argparse.ArgumentParser]) -> None:
    """Add this sub-command with `add_parser` (argparse's `add_subparsers().add_parser`)."""
    p = add_parser("proxy-config", help="write an nginx configuration: N instances behind one session-affine proxy",
                   description="Write an nginx configuration (Debian's nginx: apt-get install nginx-light) that "
                               "routes WebSocket and HTTP requests to N streamserve instances by consistent hashing "
                               "of a session-affinity key (header, else query parameter, else client address), "
                               "moves requests off instances that refuse, hang or drain (passive health: max_fails, "
                               "proxy_next_upstream on errors, timeouts, 502 and 503), and keeps sockets for an "
                               f"hour ({SOCKET_TIMEOUT_S} s read and send timeouts, no response buffering).",
                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--instances", type=int, metavar="N",
                       help="N instances on --instance-host, instance i on port --first-port + i")
    where.add_argument("--upstream", action="append", metavar="HOST:PORT",
                       help="an instance's address (repeat for each; IPv6 as [ADDRESS]:PORT)")
    p.add_argument("--instance-host", default=DEFAULT_INSTANCE_HOST,
                   help=f"with --instances: the instances' host (default: {DEFAULT_INSTANCE_HOST})")
    p.add_argument("--first-port", type=int, default=DEFAULT_FIRST_PORT,
                   help=f"with --instances: the first instance's port (default: {DEFAULT_FIRST_PORT})")
    p.add_argument("--listen", default=DEFAULT_LISTEN,
                   help=f"where nginx listens, HOST:PORT or PORT (default: {DEFAULT_LISTEN}, this machine only)")
    p.add_argument("--out", metavar="FILE", help="write the configuration here (default: stdout)")
    p.add_argument("--standalone", metavar="PREFIX",
                   help="write a complete nginx.conf run as `nginx -p PREFIX -c nginx.conf -g 'daemon off;'` by any "
                        "user: pid, logs and temp files under PREFIX (its logs/ and temp/ folders are created); "
                        "without it: an http{}-level snippet for /etc/nginx/conf.d")
    p.add_argument("--max-fails", type=int, default=1,
                   help="failed attempts (refused, timed out, 502, 503) within --fail-timeout that take an instance "
                        "out of the ring for --fail-timeout (default: 1)")
    p.add_argument("--fail-timeout", type=int, default=10, metavar="SECONDS", help="(default: 10)")
    p.add_argument("--tries", type=int, help="instances one request may try (default: all of them)")
    p.add_argument("--max-body-bytes", type=int, default=ProxyOptions.max_body_bytes,
                   help="client_max_body_size: the instances' --max-frame-bytes (default: %(default)s)")
    p.add_argument("--worker-connections", type=int, default=ProxyOptions.worker_connections,
                   help="with --standalone: connections per nginx worker; each proxied WebSocket holds two "
                        "(default: %(default)s)")
    p.set_defaults(run=cmd_proxy_config)


def options_from_args(args: argparse.Namespace) -> ProxyOptions:
    if args.upstream:
        upstreams = tuple(args.upstream)
    else:
        upstreams = instance_addresses(args.instances, args.instance_host, args.first_port)
    return ProxyOptions(upstreams=upstreams, listen=args.listen, standalone=args.standalone is not None,
                        max_fails=args.max_fails, fail_timeout_s=args.fail_timeout, tries=args.tries,
                        max_body_bytes=args.max_body_bytes, worker_connections=args.worker_connections)


def cmd_proxy_config(args: argparse.Namespace) -> int:
    text = render(options_from_args(args))
    if args.standalone is not None:
        prefix = Path(args.standalone)
        try:
            for name in STANDALONE_DIRS:
                (prefix / name).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidInputError(f"cannot create the folders of --standalone {prefix}: {e.strerror}") from None
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.out).write_text(text)
    except OSError as e:
        raise InvalidInputError(f"cannot write --out {args.out}: {e.strerror}") from None
    run_it = (f"nginx -p {args.standalone} -c {Path(args.out).resolve()} -g 'daemon off;'"
              if args.standalone is not None else "nginx -t && nginx -s reload")
    print(f"streamserve: wrote {args.out}; run: {run_it}", file=sys.stderr)
    return 0
