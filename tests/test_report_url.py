"""Engine report URLs (llmgw.fleet.report_url): only http(s)://host:port, and only on the node's own
address. Issue 12's `http://[::1` (crashed the scraper) and `ftp://x` (every request a 500) are
refused here, before the router ever dials them."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.fleet.report_url import (
    BadReportUrl,
    address_allowed,
    host_problem,
    is_loopback_host,
    parse_networks,
    parse_report_url,
)

ip = ipaddress.ip_address


@pytest.mark.parametrize(("url", "base"), [
    ("http://10.0.0.7:8000", "http://10.0.0.7:8000"),
    ("http://10.0.0.7:8000/", "http://10.0.0.7:8000"),
    ("HTTPS://Node-7.Example:443", "https://node-7.example:443"),
    ("http://[::1]:9000", "http://[::1]:9000"),
    ("http://[fd00::7]:9000", "http://[fd00::7]:9000"),
    ("http://localhost:1", "http://localhost:1"),
])
def test_good_urls(url: str, base: str) -> None:
    assert parse_report_url(url).base == base


@pytest.mark.parametrize(("url", "why"), [
    ("http://[::1", "malformed host or port"),
    ("ftp://x", "scheme must be http or https"),
    ("x", r"not an http\(s\) URL"),
    ("http://10.0.0.7", "the port is missing"),
    ("http://10.0.0.7:0", "port 0 is out of range"),
    ("http://10.0.0.7:70000", "port 70000 is out of range"),
    ("http://10.0.0.7:80/v1", "no path, query or fragment"),
    ("http://10.0.0.7:80?x", "no path, query or fragment"),
    ("http://user:pw@10.0.0.7:80", "no user info"),
    ("http://10.0.0.7:80 ", "without spaces"),
    ("http://nöde:80", "ASCII"),
    ("http://:80", "neither an IP address nor a DNS name"),
    ("http://-bad-:80", "neither an IP address nor a DNS name"),
    ("http://10.0.0.256:80", "not an IPv4 address"),
    ("http://1.2.3:80", "not an IPv4 address"),
    ("http://[1.2.3.4]:80", "not an IPv6 address"),
    ("http://[fe80::1%eth0]:80", "no IPv6 zone"),
    ("http://" + "a" * 2100 + ":80", "at most 2048"),
])
def test_bad_urls_say_why(url: str, why: str) -> None:
    with pytest.raises(BadReportUrl, match=why):
        parse_report_url(url)


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=60) | st.builds(lambda s, r: s + r, st.sampled_from(["http://", "https://", "http://["]),
                                        st.text(max_size=40)))
def test_any_string_parses_or_is_refused_cleanly(url: str) -> None:
    try:
        parse_report_url(url)
    except BadReportUrl:
        pass


def test_only_the_nodes_own_address() -> None:
    peer = ip("10.0.0.7")
    assert address_allowed(ip("10.0.0.7"), peer)
    assert address_allowed(ip("::ffff:10.0.0.7"), peer)  # IPv4-mapped is the same address
    assert not address_allowed(ip("10.0.0.8"), peer)  # another node's engines
    assert not address_allowed(ip("127.0.0.1"), peer)  # the router's own loopback: not a remote node's
    assert not address_allowed(ip("169.254.169.254"), peer)
    local = ip("127.0.0.1")
    assert address_allowed(ip("127.0.0.1"), local) and address_allowed(ip("::1"), local)  # a local agent
    assert not address_allowed(ip("0.0.0.0"), ip("0.0.0.0"))
    nets = parse_networks(["10.1.0.0/16", "fd00::/8"])
    assert address_allowed(ip("10.1.2.3"), peer, nets) and address_allowed(ip("fd00::1"), peer, nets)
    assert not address_allowed(ip("10.2.0.1"), peer, nets)
    with pytest.raises(ValueError, match="not a network"):
        parse_networks(["10.0.0.0/33"])


def test_host_problems_name_the_host_and_the_rule() -> None:
    peer = ip("10.0.0.7")
    assert host_problem(parse_report_url("http://10.0.0.7:8000"), peer) is None
    why = host_problem(parse_report_url("http://10.9.9.9:8000"), peer)
    assert why == "host 10.9.9.9 is not the node's own address (10.0.0.7)"
    name = parse_report_url("http://gpu-7.lab:8000")
    assert host_problem(name, peer, resolved=[ip("10.0.0.7")]) is None
    assert "resolves to 10.0.0.9" in (host_problem(name, peer, resolved=[ip("10.0.0.7"), ip("10.0.0.9")]) or "")
    assert host_problem(name, peer, resolved=[]) == "host gpu-7.lab does not resolve"


@pytest.mark.parametrize(("host", "loop"), [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("[::1]", True),
                                            ("localhost", True), ("::ffff:127.0.0.1", True), ("0.0.0.0", False),
                                            ("10.0.0.1", False), ("router", False), ("", False)])
def test_loopback_hosts(host: str, loop: bool) -> None:
    assert is_loopback_host(host) is loop
