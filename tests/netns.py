"""Separate hosts on one machine for the tests: Linux network namespaces joined by veth pairs to a
bridge (tests/test_ha_hosts.py).

`Hosts(names)` makes, in the root namespace, a bridge `llmgw-b<tag>` with the address .1 of a
private /24 (10.231.N.0/24, N picked among those no interface or route of this machine uses), and
for every name a namespace `llmgw-<tag>-<name>` with loopback up and `eth0`, the end of a veth pair
whose other end (`llmgw-<tag>-<i>`) is a port of the bridge, addressed 10.231.N.(11+i). The test
process, in the root namespace, reaches every host through the bridge's address; nothing outside
loopback and these namespaces is ever addressed (no default route is set in them).

`cut(name)` / `mend(name)` set a host's bridge port down / up: its cable pulled and put back.
`prefix(name)` is the command prefix that runs a process in a host (`ip netns exec NS`, which
execs, so the process keeps the PID Popen gave it); `enter(name)` joins a host's namespace from a
`preexec_fn` (for a process that drops root first, like PostgreSQL). `close()` kills by PID what
still runs in the namespaces (only ever processes of these namespaces), then deletes them and the
bridge; it runs even when the setup failed halfway. `unavailable()` says why none can be made here
(not root, no `ip`, no netns support), or None."""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import time

__all__ = ["Hosts", "unavailable"]

CLONE_NEWNET = 0x40000000
_IP = "ip"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([_IP, *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def unavailable() -> str | None:
    """Why no namespaces can be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root to test routers on separate hosts)"
    if shutil.which(_IP) is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"llmgw-probe-{secrets.token_hex(3)}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot make a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _used_subnets() -> set[int]:
    """The N of every 10.231.N.x an address or a route of this machine names."""
    text = _ip("-4", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    return {int(n) for n in re.findall(r"\b10\.231\.(\d{1,3})\.", text)}


class Hosts:
    def __init__(self, names: list[str]) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"llmgw-b{self.tag}"
        self.ns: dict[str, str] = {}
        self.port: dict[str, str] = {}
        self.addr: dict[str, str] = {}
        used = _used_subnets()
        free = [n for n in range(16, 250) if n not in used]
        if not free:
            raise RuntimeError("every 10.231.N.0/24 is in use here")
        n = free[secrets.randbelow(len(free))]
        self.subnet = f"10.231.{n}"
        self.gateway = f"{self.subnet}.1"
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names):
                self._add(i, name)
        except BaseException:
            self.close()
            raise

    def _add(self, i: int, name: str) -> None:
        ns, port, addr = f"llmgw-{self.tag}-{name}", f"llmgw-{self.tag}-{i}", f"{self.subnet}.{11 + i}"
        _ip("netns", "add", ns)
        self.ns[name] = ns
        _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.port[name] = port
        _ip("link", "set", port, "master", self.bridge)
        _ip("link", "set", port, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        self.addr[name] = addr

    def prefix(self, name: str) -> tuple[str, ...]:
        return (_IP, "netns", "exec", self.ns[name])

    def enter(self, name: str) -> None:
        """Join the host's network namespace (this process: call it in a `preexec_fn`)."""
        fd = os.open(f"/var/run/netns/{self.ns[name]}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
        finally:
            os.close(fd)

    def cut(self, name: str) -> None:
        _ip("link", "set", self.port[name], "down")

    def mend(self, name: str) -> None:
        _ip("link", "set", self.port[name], "up")

    def pids(self, name: str) -> list[int]:
        r = _ip("netns", "pids", self.ns[name], check=False)
        return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []

    def kill_all(self, name: str) -> None:
        """SIGKILL (by PID) every process still in the host's namespace, and wait until none is."""
        pids = self.pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while pids and time.monotonic() < deadline:  # polled: a killed process leaves the namespace at its exit
            pids = self.pids(name)
            if pids:
                time.sleep(0.05)

    def close(self) -> None:
        """Kill (by PID) whatever still runs in the namespaces, then delete them and the bridge."""
        for name in list(self.ns):
            self.kill_all(name)
        for name in list(self.ns):
            if name in self.port:
                _ip("link", "del", self.port.pop(name), check=False)
            _ip("netns", "del", self.ns.pop(name), check=False)
        _ip("link", "del", self.bridge, check=False)
