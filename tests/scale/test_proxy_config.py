"""`streamserve proxy-config` (streamserve/tools/nginx.py): the configuration's structure, parsed, and nginx's own
`nginx -t` on every variant."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from scale_support import NGINX, needs_nginx, nginx_command

from streamserve.errors import InvalidInputError
from streamserve.tools.nginx import ProxyOptions, instance_addresses, render, split_address

Directive = tuple[str, list[str], list["Directive"] | None]  # name, arguments, the block's directives (or None)


def parse(text: str) -> list[Directive]:
    """nginx's configuration syntax, enough for these files: words, "quoted" and '' strings, ; { } and comments."""
    tokens: list[str] = []
    syntax: set[int] = set()  # positions of { } ; (a quoted "{" or "" is a word)
    i = 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "#":
            i = text.index("\n", i) if "\n" in text[i:] else len(text)
        elif c in "{};":
            syntax.add(len(tokens))
            tokens.append(c)
            i += 1
        elif c in "\"'":
            end = text.index(c, i + 1)
            tokens.append(text[i + 1:end])
            i = end + 1
        else:
            j = i
            while j < len(text) and not text[j].isspace() and text[j] not in "{};":
                j += 1
            tokens.append(text[i:j])
            i = j

    def block(pos: int) -> tuple[list[Directive], int]:
        out: list[Directive] = []
        while pos < len(tokens) and not (pos in syntax and tokens[pos] == "}"):
            name, args, pos = tokens[pos], [], pos + 1
            while pos not in syntax:
                args.append(tokens[pos])
                pos += 1
            if tokens[pos] == "{":
                children, pos = block(pos + 1)
                assert tokens[pos] == "}"
                out.append((name, args, children))
            else:
                out.append((name, args, None))
            pos += 1
        return out, pos

    directives, end = block(0)
    assert end == len(tokens), "unbalanced braces"
    return directives


def find(directives: list[Directive], name: str, *args: str) -> list[Directive]:
    return [d for d in directives if d[0] == name and list(d[1][:len(args)]) == list(args)]


def one(directives: list[Directive], name: str, *args: str) -> Directive:
    found = find(directives, name, *args)
    assert len(found) == 1, (name, args, found)
    return found[0]


def children(d: Directive) -> list[Directive]:
    assert d[2] is not None
    return d[2]


def test_the_snippet_routes_by_the_affinity_key_with_passive_health_and_long_socket_timeouts() -> None:
    top = parse(render(ProxyOptions(instance_addresses(3))))
    assert not find(top, "events") and not find(top, "http") and not find(top, "pid")  # an http{}-level snippet
    # the key: the header, else the query parameter, else the client address
    given = children(one(top, "map", "$http_x_streamserve_affinity", "$streamserve_affinity_given"))
    assert {d[0]: d[1] for d in given} == {"": ["$arg_affinity"], "default": ["$http_x_streamserve_affinity"]}
    key = children(one(top, "map", "$streamserve_affinity_given", "$streamserve_affinity"))
    assert {d[0]: d[1] for d in key} == {"": ["$remote_addr"], "default": ["$streamserve_affinity_given"]}
    upgrade = children(one(top, "map", "$http_upgrade", "$streamserve_connection_upgrade"))
    assert {d[0]: d[1] for d in upgrade} == {"default": ["upgrade"], "": [""]}

    upstream = children(one(top, "upstream", "streamserve"))
    assert upstream[0] == ("hash", ["$streamserve_affinity", "consistent"], None)  # before keepalive, as nginx wants
    assert [d[1] for d in find(upstream, "server")] == [
        [f"127.0.0.1:{8001 + i}", "max_fails=1", "fail_timeout=10s"] for i in range(3)]
    assert one(upstream, "keepalive")[1] == ["32"]

    server = children(one(top, "server"))
    assert one(server, "listen")[1] == ["127.0.0.1:8000"]  # loopback unless told
    assert one(server, "client_max_body_size")[1] == [str(1 << 20)]  # the instances' --max-frame-bytes default
    loc = children(one(server, "location", "/"))
    settings = {d[0]: d[1] for d in loc if d[0] != "proxy_set_header"}
    assert settings == {
        "proxy_pass": ["http://streamserve"], "proxy_http_version": ["1.1"],
        "proxy_connect_timeout": ["5s"], "proxy_read_timeout": ["3600s"], "proxy_send_timeout": ["3600s"],
        "proxy_buffering": ["off"],
        "proxy_next_upstream": ["error", "timeout", "http_502", "http_503"],  # no non_idempotent: POSTs not retried
        "proxy_next_upstream_tries": ["3"]}
    assert children(one(server, "location", "/admin/")) == [("return", ["404"], None)]  # drain names its instance
    headers = {d[1][0]: d[1][1] for d in loc if d[0] == "proxy_set_header"}
    assert headers == {"Upgrade": "$http_upgrade", "Connection": "$streamserve_connection_upgrade",
                       "Host": "$http_host", "X-Forwarded-For": "$proxy_add_x_forwarded_for",
                       "X-Forwarded-Proto": "$scheme"}


def test_the_standalone_file_keeps_everything_under_its_prefix_and_leaves_daemon_to_the_command_line() -> None:
    top = parse(render(ProxyOptions(("127.0.0.1:9001", "[::1]:9002"), listen="9000", standalone=True,
                                    max_fails=3, fail_timeout_s=30, tries=1, max_body_bytes=4096,
                                    worker_connections=2048)))
    assert not find(top, "daemon") and not find(top, "user")
    paths = {"pid": one(top, "pid")[1][0], "error_log": one(top, "error_log")[1][0]}
    assert one(children(one(top, "events")), "worker_connections")[1] == ["2048"]
    http = children(one(top, "http"))
    paths["access_log"] = one(http, "access_log")[1][0]
    assert one(http, "access_log")[1][1] == "streamserve" and find(http, "log_format", "streamserve")
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        paths[kind] = one(http, f"{kind}_temp_path")[1][0]
    # relative paths are nginx's prefix (-p PREFIX), and all of them sit in the folders proxy-config creates there
    assert all(p.split("/")[0] in ("logs", "temp") for p in paths.values()), paths
    upstream = children(one(http, "upstream", "streamserve"))
    assert [d[1] for d in find(upstream, "server")] == [["127.0.0.1:9001", "max_fails=3", "fail_timeout=30s"],
                                                        ["[::1]:9002", "max_fails=3", "fail_timeout=30s"]]
    server = children(one(http, "server"))
    assert one(server, "listen")[1] == ["127.0.0.1:9000"]
    assert one(server, "client_max_body_size")[1] == ["4096"]
    assert one(children(one(server, "location", "/")), "proxy_next_upstream_tries")[1] == ["1"]


@pytest.mark.parametrize("bad", ["", "host", "host:0", "host:65536", "a;b:1", "a b:1", "a{b:1", "[::1:80",
                                 "[1.2.3.4]:80", "1.2.3.4:80;", "ho$t:80"])
def test_addresses_that_are_not_host_and_port_never_reach_the_file(bad: str) -> None:
    with pytest.raises(InvalidInputError):
        split_address(bad, "upstream")
    with pytest.raises(InvalidInputError):
        ProxyOptions(("127.0.0.1:8001", bad))


def test_options_that_cannot_work_are_refused() -> None:
    assert split_address("[::1]:80", "x") == ("::1", 80) and split_address("8000", "x", bare_port=True) \
        == ("127.0.0.1", 8000)
    for bad in ({"upstreams": ()}, {"upstreams": ("a:1", "a:1")}, {"tries": 0}, {"max_fails": 0},
                {"max_body_bytes": True}, {"listen": "0"}):
        with pytest.raises(InvalidInputError):
            ProxyOptions(**{"upstreams": ("a:1",), **bad})  # type: ignore[arg-type]
    for n, first in ((0, 8001), (2, 65535), (1, 0)):
        with pytest.raises(InvalidInputError):
            instance_addresses(n, "127.0.0.1", first)
    assert instance_addresses(2, "::1", 9000) == ("[::1]:9000", "[::1]:9001")


VARIANTS = {
    "snippet": ProxyOptions(instance_addresses(2)),
    "snippet-ipv6-bare-port": ProxyOptions(("[::1]:8001", "127.0.0.1:8002", "localhost:8003"), listen="8080",
                                           tries=2, max_fails=2, fail_timeout_s=5, max_body_bytes=65536),
    "standalone": ProxyOptions(instance_addresses(4), standalone=True),
    "standalone-one": ProxyOptions(("127.0.0.1:8001",), listen="[::1]:8000", standalone=True, keepalive=1,
                                   worker_connections=64),
}


@needs_nginx
@pytest.mark.parametrize("variant", VARIANTS)
def test_nginx_accepts_every_variant(variant: str, tmp_path: Path) -> None:
    options = VARIANTS[variant]
    for name in ("logs", "temp"):
        (tmp_path / name).mkdir()
    if options.standalone:
        (tmp_path / "nginx.conf").write_text(render(options))
    else:  # the snippet inside a main file, as Debian's nginx.conf includes conf.d/*.conf inside http{}
        (tmp_path / "streamserve.conf").write_text(render(options))
        (tmp_path / "nginx.conf").write_text(
            "pid logs/nginx.pid;\nerror_log logs/error.log;\nevents {}\nhttp {\n"
            + "".join(f"    {k}_temp_path temp/{k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
            + f"    include {tmp_path / 'streamserve.conf'};\n}}\n")
    cmd = nginx_command(tmp_path)
    done = subprocess.run([*cmd[:-2], "-t"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "test is successful" in done.stderr, done.stderr


def streamserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamserve", *args], capture_output=True, text=True, timeout=120)


def test_the_command_writes_what_render_writes_and_explains_itself(tmp_path: Path) -> None:
    out = streamserve("proxy-config", "--instances", "2")
    assert out.returncode == 0 and out.stdout == render(ProxyOptions(instance_addresses(2)))
    prefix = tmp_path / "proxy"
    out = streamserve("proxy-config", "--upstream", "127.0.0.1:9001", "--upstream", "127.0.0.1:9002", "--listen",
                      "127.0.0.1:9000", "--standalone", str(prefix), "--out", str(prefix / "nginx.conf"))
    assert out.returncode == 0, out.stderr
    assert (prefix / "nginx.conf").read_text() == render(
        ProxyOptions(("127.0.0.1:9001", "127.0.0.1:9002"), listen="127.0.0.1:9000", standalone=True))
    assert (prefix / "logs").is_dir() and (prefix / "temp").is_dir() and "nginx -p" in out.stderr
    if NGINX is not None:  # the folders it made are all nginx needs
        done = subprocess.run([*nginx_command(prefix)[:-2], "-t"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    helptext = streamserve("proxy-config", "--help").stdout
    assert all(w in helptext for w in ("affinity", "X-Streamserve-Affinity", "--standalone", "--trusted-proxies",
                                       "nginx-light"))
    assert "proxy-config" in streamserve("--help").stdout
    bad = streamserve("proxy-config", "--upstream", "a;b:1")
    assert bad.returncode == 1 and bad.stderr.startswith("streamserve: error: upstream:")
    assert streamserve("proxy-config").returncode == 2  # --instances or --upstream is required
