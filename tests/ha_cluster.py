"""Several routers sharing one store, their agents and engines, over real processes (docs/ha.md).

`Cluster` starts N `llmgw daemon --role router` processes on one store — a SQLite file shared on
this host (`[store] shared = true`), or a PostgreSQL database (`[store] url`) — each with its own
control port and admin socket, and agents that dial router 0 (they learn the others from its
welcome). Everything started is stopped, agents first.

On separate hosts (tests/test_ha_hosts.py): `hosts` gives each router its address (its OpenAI
port, control listener and feed bind there, and each keeps its own control TLS directory, so each
has its own CA), `prefix` the command that runs it there (`ip netns exec NS`)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx

from .test_fleet_integration import TOKEN, table, toml_value
from .test_router_integration import Daemon, free_port
from .test_sim_vllm import wait_for


class Cluster:
    def __init__(self, tmp: Path, models: list[dict[str, Any]], *, routers: int = 2,
                 store: dict[str, Any] | None = None, lease_s: float = 1.5, control: dict[str, Any] | None = None,
                 lost_after: float = 30.0, deaf: frozenset[int] = frozenset(), fixed_api_ports: bool = False,
                 hosts: list[str] | None = None, prefix: list[tuple[str, ...]] | None = None,
                 ha: dict[str, Any] | None = None) -> None:
        """`deaf`: routers started with no control listener, so no agent reaches them."""
        self.ha = ha or {}
        self.hosts = hosts or ["127.0.0.1"] * routers
        self.prefix = prefix or [()] * routers
        self.tmp = tmp
        self.models = models
        self.store = dict(shared=True) if store is None else store  # one SQLite file on this host
        self.lease_s = lease_s
        self.control_extra = control or {}
        self.lost_after = lost_after
        self.deaf = deaf
        self.ports = [free_port() for _ in range(routers)]
        # the OpenAI ports: ephemeral, or chosen once so that a restarted router comes back at the same URL
        self.api_ports = [free_port() for _ in range(routers)] if fixed_api_ports else None
        self.routers: list[Daemon | None] = [None] * routers
        self.agents: dict[str, Daemon] = {}
        self.clients: list[httpx.Client] = []
        for i in range(routers):
            self.clients.append(httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket(i))),
                                             base_url="http://llmgw", timeout=10))
            self.start_router(i)

    # -- routers -----------------------------------------------------------------------------------
    def socket(self, i: int) -> Path:
        return self.tmp / f"admin-{i}" / "admin.sock"

    def router_config(self, i: int) -> Path:
        host = self.hosts[i] if i < len(self.hosts) else "127.0.0.1"  # a router added later: loopback
        lines = table("server", {"host": host})
        lines += table("router", {"scrape_interval_s": 0.2})
        reach = {} if i in self.deaf else {"listen": f"{host}:{self.ports[i]}", "join_token": TOKEN}
        own = self.tmp / "router.db" if host == "127.0.0.1" else self.tmp / f"host-{i}" / "router.db"
        lines += table("control", {**reach,
                                   "heartbeat_s": 0.2, "not_ready_after_s": 1.0, "lost_after_s": self.lost_after,
                                   "drain_timeout_s": 2.0, "settle_s": 1.0, "store": str(own),
                                   **self.control_extra})
        bound = {"timeout_s": round(self.lease_s / 3, 3)}  # a call that times out ends within the lease
        lines += table("store", {"lease_s": self.lease_s, "poll_s": 0.1, **bound, **self.store})
        lines += table("admin", {"socket": str(self.socket(i))})
        if host != "127.0.0.1":
            lines += table("ha", {"feed_listen": f"{host}:0", **self.ha})
        for m in self.models:
            lines += ["[[models]]"] + [f"{k} = {toml_value(v)}" for k, v in m.items() if not isinstance(v, dict)]
            for k, v in m.items():  # its sub-tables: deploy, autoscale
                if isinstance(v, dict):
                    lines += table(f"models.{k}", v)
        path = self.tmp / f"router-{i}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start_router(self, i: int) -> Daemon:
        extra = ("--port", str(self.api_ports[i])) if self.api_ports else ()
        prefix = self.prefix[i] if i < len(self.prefix) else ()
        d = Daemon(self.router_config(i), role="router", log_level="info", extra=extra, prefix=prefix)
        self.routers[i] = d
        return d

    def router(self, i: int) -> Daemon:
        d = self.routers[i]
        assert d is not None
        return d

    def get(self, i: int, path: str) -> Any:
        r = self.clients[i].get(path)
        r.raise_for_status()
        return r.json()

    def status(self, i: int) -> dict[str, Any]:
        return self.get(i, "/api/v1/status")

    def leader(self, among: list[int] | None = None) -> int | None:
        """The index of the router that says it leads (among the running ones), if exactly one does."""
        found = []
        for i, d in enumerate(self.routers):
            if d is None or d.proc.poll() is not None or (among is not None and i not in among):
                continue
            try:
                if self.status(i).get("role") == "leader":
                    found.append(i)
            except httpx.HTTPError:
                continue
        return found[0] if len(found) == 1 else None

    def wait_leader(self, among: list[int] | None = None, timeout: float = 20) -> int:
        got: list[int] = []
        wait_for(lambda: (x := self.leader(among)) is not None and not got.append(x), timeout=timeout)
        return got[0]

    def signal(self, i: int, sig: int) -> None:
        os.killpg(self.router(i).proc.pid, sig)

    def kill(self, i: int) -> None:
        d = self.router(i)
        os.killpg(d.proc.pid, signal.SIGKILL)
        d.proc.wait(10)

    # -- agents and clients ------------------------------------------------------------------------
    def agent_config(self, node: str, **agent: Any) -> Path:
        values = {"node": node, "router": f"{self.hosts[0]}:{self.ports[0]}", "join_token": TOKEN,
                  "state_dir": str(self.tmp / f"agent-{node}"), "reconnect_min_s": 0.1, "reconnect_max_s": 0.5,
                  "stop_grace_s": 3.0, **agent}
        lines = table("agent", values) + table("agent.restart", {"base_s": 0.1, "max_s": 0.5})
        path = self.tmp / f"agent-{node}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start_agent(self, node: str, prefix: tuple[str, ...] = (), **kw: Any) -> Daemon:
        d = Daemon(self.agent_config(node, **kw), role="agent", log_level="info", prefix=prefix)
        self.agents[node] = d
        return d

    def ready(self, i: int, model: str) -> list[dict[str, Any]]:
        return [r for r in self.get(i, "/api/v1/replicas")
                if r["model"] == model and r["state"] == "ready" and r["desired"] == "run"]

    def routed(self, i: int, model: str) -> list[str]:
        """The replicas router i routes `model` to."""
        return sorted(e["id"] for e in self.get(i, "/api/v1/endpoints") if e["model"] == model and not e["draining"])

    def chat(self, i: int, model: str, content: str = "hi") -> httpx.Response:
        return httpx.post(f"{self.router(i).url}/v1/chat/completions", timeout=10,
                          json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 3})

    def close(self) -> None:
        for a in self.agents.values():
            a.stop()
        for d in self.routers:
            if d is not None:
                if d.proc.poll() is None:
                    try:
                        os.killpg(d.proc.pid, signal.SIGCONT)  # a stopped one must hear the TERM
                    except ProcessLookupError:
                        pass
                d.stop()
        for c in self.clients:
            c.close()
