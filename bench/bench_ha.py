"""Several routers, one fleet (docs/ha.md): the engines' cache hit rate with N routers against one,
a leader SIGKILLed mid-run, and `--workers 2` against one worker — in one run, on one machine.

    .venv/bin/python bench/bench_ha.py [--requests 320] [--rate 8] [--routers 3] [--postgres]
        [--lease 5] [--modes no-events,events] [--no-independent] [--idle 5] [--skip-kill]
        [--skip-workers] [--workers-seconds 5] [--workers-rounds 3] [--keep] [--json FILE]

The fleet: one agent placing 4 simulated vLLM replicas (`[models.deploy] simulate = true`) whose
KV caches are too small for the workload's working set but whose sum roughly holds it (sized as
bench_prefix_routing.py sizes them), and N `llmgw daemon --role router` processes sharing one
store: a SQLite file on this host (`[store] shared = true`), or with --postgres a throwaway
PostgreSQL (tests/pg_server.py). The agent dials router 0 and learns the others.

The workload is bench_prefix_routing.py's shared-prefix multi-turn chat (tenants' long system
prompts, conversations resending their history), open loop at --rate, replayed with the same
schedule for every run. Two models take turns on the fleet: `m` without KV events (tier 1 only:
each router's prefix tree, shared over the routers' peer feed) and `m-ev` with them (tier 2 on
every router, from the engines' own events); the fleet is scaled from one to the other between
the two. For each, the schedule goes (a) to router 0 alone, (b) to all N routers behind a
client-side round robin (each request to the next router: a conversation's turns land on
different routers); without KV events also (c) N routers sharing nothing of tier 1 — the
routers restarted with their peer feeds advertised where nothing listens, the agent and engines
kept: independent instances, the baseline of the issue's measurement. Before each run the
engines' caches are reset (vLLM's /reset_prefix_cache) and the run's requests carry a cache_salt
of their own, so no router's tree remembers another run. Reported per run: the engines' own
prefix-cache hit rate (vllm:prefix_cache_hits / queries, deltas), TTFT p50/p99, requests per
replica (max/mean), router CPU per request (summed over every router running, and over those
that served); and once per model the routers' CPU with no request for --idle seconds (scrapes,
the agent's streams, KV events, the store), which per request is that over the rate.

Then (unless --skip-kill) the schedule once more over all N routers, the client retrying a
refused connection once on the next router, and the leader SIGKILLed halfway: requests lost
(failed after that retry), and from the kill, when a survivor says it leads (each survivor's
GET /api/v1/status polled), and when an admin change sent to a survivor (scale `m` 0 -> 1)
answers 200 and when that replica is routed (the successor placed it).

Then (unless --skip-workers) bench/bench_workers.py's figures, one router process against
`--workers 2` (its own closed-loop load on a stub engine), when that bench is here.

Bounded: a fixed number of requests on 127.0.0.1; every process started (routers, the agent and
its engines, PostgreSQL) is stopped by its PID at the end. Prints figures, no verdict."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import trio

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))  # tests/pg_server.py, for --postgres
from bench_prefix_routing import engine_counters, replay, working_set_blocks, workload  # noqa: E402
from loadgen import Latencies, proc_cpu_seconds  # noqa: E402

TOKEN = "bench-ha-join-token"
MODELS = {"no-events": "m", "events": "m-ev"}


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(v)


def table(name: str, values: dict[str, Any]) -> list[str]:
    return [f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in values.items()]


class Proc:
    """An `llmgw daemon` in its own session; its log in a file; its JSON ready line read."""

    def __init__(self, config: Path, role: str, log: Path) -> None:
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "llmgw", "daemon", "--role", role, "--config",
                                          str(config), "--port", "0", "--log-level", "info"],
                                         stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise SystemExit(f"{role} did not start: {log.read_text(errors='replace')[-2000:]}")
        self.info = json.loads(line)
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(10)


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


class Cluster:
    """N routers on one store, one agent (it dials router 0), the model's engines placed by it."""

    def __init__(self, tmp: Path, a: argparse.Namespace, blocks: int, store: dict[str, Any]) -> None:
        self.tmp, self.a = tmp, a
        self.routers: list[Proc | None] = []
        self.agent: Proc | None = None
        self.admin: list[httpx.Client] = []
        self.ports = [free_port() for _ in range(a.routers)]
        engine_args = ["--sim-kv-blocks", str(blocks), "--max-model-len", "8192",
                       "--sim-prefill-ms-per-token", "0.05", "--sim-decode-ms-per-token", "8"]
        first = a.modes.split(",")[0]
        self.models = {mode: {"count": a.replicas if mode == first else 0, "simulate": True, "health_timeout_s": 60.0,
                              "args": engine_args, "env": ["VLLM_SERVER_DEV_MODE=1"], "kv_events": mode == "events"}
                       for mode in MODELS}
        self.store = store
        self.deaf_feed = False
        self.starts = 0
        for i in range(a.routers):
            sock = tmp / f"admin-{i}" / "admin.sock"
            self.admin.append(httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://llmgw",
                                           timeout=30))
            self.routers.append(None)
        try:
            for i in range(a.routers):
                self.start_router(i)
        except BaseException:
            self.close()  # the routers that did start
            raise

    def start_router(self, i: int) -> None:
        self.starts += 1
        sock = self.tmp / f"admin-{i}" / "admin.sock"
        self.routers[i] = Proc(self.router_config(i, sock), "router", self.tmp / f"router-{i}-{self.starts}.log")

    def restart_routers(self, *, deaf_feed: bool) -> None:
        """Every router stopped and started again (the agent and its engines stay): with deaf_feed,
        none hears another's routing decisions — independent instances on one fleet."""
        self.deaf_feed = deaf_feed
        for r in self.routers:
            if r is not None:
                r.stop()
        for i in range(len(self.routers)):
            self.start_router(i)

    def router_config(self, i: int, sock: Path) -> Path:
        lines = table("server", {"host": "127.0.0.1"})
        # as bench_prefix_routing's router: the default strategy, no load cap in the way
        lines += table("router", {"scrape_interval_s": 0.25, "queue_size": 4096, "saturation_load": 100000.0})
        lines += table("control", {"listen": f"127.0.0.1:{self.ports[i]}", "join_token": TOKEN, "settle_s": 1.0,
                                   "store": str(self.tmp / "router.db")})
        # every store call ends within a third of the lease (the shipped 2 s for the shipped 5 s lease)
        bound = min(2.0, round(self.a.lease / 3, 3))
        lines += table("store", {"lease_s": self.a.lease, "timeout_s": bound, **self.store})
        lines += table("admin", {"socket": str(sock)})
        if self.deaf_feed:  # its peers dial a port nothing listens on: it hears them, they never hear it
            lines += table("ha", {"feed_advertise": f"127.0.0.1:{free_port()}"})
        for mode, name in MODELS.items():
            lines += ["[[models]]", f'name = "{name}"', 'engine = "vllm"']
            lines += table("models.deploy", self.models[mode])
        path = self.tmp / f"router-{i}.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start_agent(self) -> None:
        lines = table("agent", {"node": "n1", "router": f"127.0.0.1:{self.ports[0]}", "join_token": TOKEN,
                                "state_dir": str(self.tmp / "agent-n1"), "reconnect_min_s": 0.1,
                                "reconnect_max_s": 0.5})
        path = self.tmp / "agent.toml"
        path.write_text("\n".join(lines) + "\n")
        self.agent = Proc(path, "agent", self.tmp / "agent.log")

    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.routers) if r is not None and r.alive()]

    def port(self, i: int) -> int:
        r = self.routers[i]
        assert r is not None
        return int(r.info["port"])

    def url(self, i: int) -> str:
        r = self.routers[i]
        assert r is not None
        return str(r.info["url"])

    def get(self, i: int, path: str) -> Any:
        r = self.admin[i].get(path)
        r.raise_for_status()
        return r.json()

    def role(self, i: int) -> str | None:
        try:
            return self.get(i, "/api/v1/status").get("role")
        except (httpx.HTTPError, OSError):
            return None

    def leader(self) -> int | None:
        found = [i for i in self.live() if self.role(i) == "leader"]
        return found[0] if len(found) == 1 else None

    def endpoints(self, i: int, model: str) -> list[dict[str, Any]]:
        return [e for e in self.get(i, "/api/v1/endpoints") if e["model"] == model and not e["draining"]]

    def metric(self, i: int, name: str) -> list[str]:
        text = httpx.get(f"{self.url(i)}/metrics", timeout=10).text
        return [line for line in text.splitlines() if line.startswith(name)]

    def scale(self, i: int, model: str, n: int) -> httpx.Response:
        return self.admin[i].post(f"/api/v1/models/{model}/scale", json={"replicas": n})

    def wait_serving(self, model: str, n: int, kv_events: bool) -> list[str]:
        """Every router routes the model's n replicas (and, with KV events, hears each engine's);
        the engines' URLs."""
        for i in self.live():
            wait_for(lambda i=i: len(self.endpoints(i, model)) == n, 120, f"router {i} to route {n} of {model}")
        urls = sorted(e["url"] for e in self.endpoints(self.live()[0], model))
        if kv_events:
            # a follower that heard an engine's first events before it knew the replica refused them
            # (unknown_replica); the reset's AllBlocksCleared starts every router's index afresh
            reset_caches(urls)
            for i in self.live():
                wait_for(lambda i=i: len([x for x in self.metric(i, "llmgw_kv_events_lag_seconds")
                                          if f'"{model}/' in x]) >= n, 60, f"router {i} to hear {model}'s KV events")
        peers = 0 if self.deaf_feed else len(self.live()) - 1
        for i in self.live():
            wait_for(lambda i=i: sum(float(x.rsplit(" ", 1)[1])
                                     for x in self.metric(i, "llmgw_peer_feed_peers")) >= peers,
                     60, f"router {i}'s peer feed to reach the others")
        return urls

    def close(self) -> None:
        for p in [self.agent, *self.routers]:
            if p is not None:
                try:
                    p.stop()
                except Exception as e:  # noqa: BLE001 — the others are stopped all the same
                    print(f"stopping pid {p.pid}: {e!r}", file=sys.stderr)
        # engines a stopped agent left behind (it stops them itself; this is the safety net)
        for rec in (self.tmp / "agent-n1").glob("engines/*.json"):
            pgid = json.loads(rec.read_text()).get("pgid")
            if pgid:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for c in self.admin:
            c.close()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_requests(urls: list[str]) -> list[int]:
    """Requests each engine finished (vllm:request_success_total), in the order of `urls`."""
    return [int(sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{u}/metrics", timeout=10).text.splitlines()
                    if line.startswith("vllm:request_success_total"))) for u in urls]


def reset_caches(urls: list[str]) -> None:
    for u in urls:
        r = httpx.post(f"{u}/reset_prefix_cache", timeout=10)
        if r.status_code != 200:
            raise SystemExit(f"{u}/reset_prefix_cache answered {r.status_code}: {r.text[:200]}")


class Run:
    """One replay of the schedule: the engines' hit rate, TTFT, spread and the routers' CPU."""

    def __init__(self, c: Cluster, urls: list[str], targets: list[int], model: str, salt: str) -> None:
        self.c, self.urls, self.targets, self.model, self.salt = c, urls, targets, model, salt
        self.outcomes: Counter = Counter()

    def start(self) -> None:
        reset_caches(self.urls)
        self.q0, self.h0 = engine_counters(self.urls)
        self.cpu0 = {i: proc_cpu_seconds(self.c.routers[i].pid) for i in self.c.live()}  # type: ignore[union-attr]

    async def replay(self, convs: list[dict], a: argparse.Namespace) -> None:
        ports = [self.c.port(i) for i in self.targets]
        self.lat, self.per, _ = await replay(ports if len(ports) > 1 else ports[0], convs, a.rate, a.seed, "default",
                                             60.0, body={"model": self.model, "cache_salt": self.salt},
                                             outcomes=self.outcomes)

    def finish(self, n_req: int) -> dict[str, Any]:
        q1, h1 = engine_counters(self.urls)
        cpu = {i: proc_cpu_seconds(self.c.routers[i].pid) - t for i, t in self.cpu0.items()  # type: ignore[union-attr]
               if i in self.c.live()}
        counts = [n for _, n in sorted(self.per.items())] + [0] * (len(self.urls) - len(self.per))
        served = sum(counts) or 1
        return {"hit_rate": (h1 - self.h0) / max(1.0, q1 - self.q0), "ttft_p50": self.lat.pct(50),
                "ttft_p99": self.lat.pct(99), "per_replica": counts,
                "max_over_mean": max(counts) / (served / len(counts)),
                "cpu_ms_all": 1e3 * sum(cpu.values()) / n_req,
                "cpu_ms_serving": 1e3 * sum(v for i, v in cpu.items() if i in self.targets) / n_req,
                "outcomes": dict(self.outcomes), "ok": len(self.lat.values)}


def row(label: str, r: dict[str, Any]) -> str:
    return (f"  {label:25} {r['hit_rate']:8.1%} {1e3 * r['ttft_p50']:8.1f}ms {1e3 * r['ttft_p99']:7.1f}ms "
            f"{r['max_over_mean']:8.2f} {r['cpu_ms_all']:7.2f}ms {r['cpu_ms_serving']:8.2f}ms  {r['per_replica']}"
            + (f"  {r['outcomes']}" if r["outcomes"] else ""))


def successor(c: Cluster, survivors: list[int], t_kill: float, out: dict[str, float]) -> None:
    """From the kill: when a survivor says it leads (status polled every 50 ms)."""
    deadline = t_kill + 120
    while time.monotonic() < deadline:
        for i in survivors:
            if c.role(i) == "leader":
                out["leads_s"] = time.monotonic() - t_kill
                out["leader"] = i
                return
        time.sleep(0.05)


def first_act(c: Cluster, via: int, t_kill: float, out: dict[str, float]) -> None:
    """From the kill: an admin change sent to a survivor (scale `m` 0 -> 1) answers 200; then
    the replica it asks for is routed (the successor placed it and its engine is up)."""
    deadline = t_kill + 120
    codes: Counter = Counter()
    while time.monotonic() < deadline:
        try:
            r = c.scale(via, MODELS["no-events"], 1)
            codes[r.status_code] += 1
            if r.status_code == 200:
                out["admin_200_s"] = time.monotonic() - t_kill
                break
        except (httpx.HTTPError, OSError) as e:
            codes[type(e).__name__] += 1
        time.sleep(0.05)
    out["admin_answers"] = dict(codes)  # type: ignore[assignment]
    while time.monotonic() < deadline:
        try:
            if len(c.endpoints(via, MODELS["no-events"])) == 1:
                out["placed_s"] = time.monotonic() - t_kill
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=320, help="per run (rounded to whole conversations)")
    ap.add_argument("--rate", type=float, default=8.0, help="requests/s, open loop")
    ap.add_argument("--routers", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--sys-words", type=int, default=800)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lease", type=float, default=5.0, help="[store] lease_s (the shipped default: 5)")
    ap.add_argument("--postgres", action="store_true", help="a throwaway PostgreSQL instead of a shared SQLite file")
    ap.add_argument("--modes", default="no-events,events", help="which runs, in this order: no-events, events")
    ap.add_argument("--independent", action=argparse.BooleanOptionalAction, default=True,
                    help="also N routers sharing nothing of tier 1 (no-events: the routers restarted with their "
                         "peer feeds advertised where nothing listens)")
    ap.add_argument("--skip-kill", action="store_true")
    ap.add_argument("--skip-workers", action="store_true")
    ap.add_argument("--workers-seconds", type=float, default=5.0, help="bench_workers.py --seconds")
    ap.add_argument("--workers-rounds", type=int, default=3, help="bench_workers.py --rounds (compare medians)")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds the routers' idle CPU is measured (0: not)")
    ap.add_argument("--keep", action="store_true", help="keep the routers' and the agent's logs and configs")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if not modes or any(m not in MODELS for m in modes):
        ap.error(f"--modes: a comma-separated list of {', '.join(MODELS)}")
    users = max(1, math.ceil(a.requests / (a.tenants * a.turns)))
    convs = workload(a.seed, a.tenants, users, a.turns, a.sys_words)[: max(1, math.ceil(a.requests / a.turns))]
    n_req = sum(len(c["turns"]) for c in convs)
    blocks = max(8192 // 16 + 1, int(1.1 * working_set_blocks(convs, 8) / a.replicas))
    tmp = Path(tempfile.mkdtemp(prefix="bench-ha-"))
    pg = None
    c: Cluster | None = None
    results: dict[str, Any] = {}
    logs: list[str] = []
    try:
        if a.postgres:
            from tests.pg_server import PgServer, PgUnavailable

            pg = PgServer()
            try:
                pg.start()
            except PgUnavailable as e:
                raise SystemExit(f"--postgres: {e}") from None
            store: dict[str, Any] = {"url": pg.create_database("bench_ha")}
        else:
            store = {"shared": True}
        t0 = time.monotonic()
        c = Cluster(tmp, a, blocks, store)
        c.start_agent()
        print(f"{n_req} requests a run ({len(convs)} conversations of {a.turns} turns, {a.tenants} tenants' "
              f"system prompts of ~{a.sys_words * 2} tokens), {a.rate}/s open loop; {a.replicas} simulated vLLM "
              f"replicas x {blocks} KV blocks on one agent; {a.routers} routers on "
              f"{'PostgreSQL' if a.postgres else 'one shared SQLite file'}, lease {a.lease} s; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        lead = c.leader()
        print("hit rate, TTFT, spread and router CPU per request (all routers running / those that served):")
        print(f"  {'run':25} {'hit rate':>8} {'TTFT p50':>10} {'p99':>9} {'max/mean':>8} {'CPU all':>9} "
              f"{'serving':>10}  requests per replica")
        run_no = 0
        urls: list[str] = []
        for k, mode in enumerate(modes):
            model = MODELS[mode]
            if k > 0:  # the fleet from the last mode's model to this one's
                for name, n in ((MODELS[modes[k - 1]], 0), (model, a.replicas)):
                    r = c.scale(0, name, n)
                    if r.status_code != 200:
                        raise SystemExit(f"scale {name} {n}: {r.status_code} {r.text[:300]}")
                for i in c.live():
                    wait_for(lambda i=i: not c.endpoints(i, MODELS[modes[k - 1]]), 120,
                             f"router {i} to drop the old model")
            urls = c.wait_serving(model, a.replicas, mode == "events")
            lead = c.leader()
            if a.idle > 0:  # what the routers spend with no request: scrapes, the agents' streams, the store
                cpu0 = {i: proc_cpu_seconds(c.routers[i].pid) for i in c.live()}  # type: ignore[union-attr]
                time.sleep(a.idle)
                idle = {i: 1e3 * (proc_cpu_seconds(c.routers[i].pid) - t) / a.idle  # type: ignore[union-attr]
                        for i, t in cpu0.items()}
                results[f"{mode}: idle CPU ms/s"] = idle
                print(f"  {mode}: idle, each router spends " + ", ".join(f"{v:.0f}" for v in idle.values())
                      + f" ms of CPU a second (at {a.rate:g} req/s: {sum(idle.values()) / a.rate:.1f} ms a request "
                      f"for all {len(idle)}, {idle[0] / a.rate:.1f} for router 0)", flush=True)
            runs = [(f"{mode}: 1 router", [0]), (f"{mode}: {a.routers} routers", list(range(a.routers)))]
            if mode == "no-events" and a.independent:
                runs.append((f"{mode}: {a.routers} independent", list(range(a.routers))))
            for label, targets in runs:
                if label.endswith("independent"):
                    c.restart_routers(deaf_feed=True)
                    urls = c.wait_serving(model, a.replicas, False)
                run_no += 1
                run = Run(c, urls, targets, model, f"bench-run-{run_no}")
                run.start()
                trio.run(run.replay, convs, a)
                results[label] = run.finish(n_req)
                print(row(label, results[label]), flush=True)
                if label.endswith("independent"):
                    c.restart_routers(deaf_feed=False)
                    urls = c.wait_serving(model, a.replicas, False)
        print(f"  (router 0 {'leads' if lead == 0 else 'follows'}: the 1-router runs go to it)")
        if not a.skip_kill and a.routers >= 2:
            mode = modes[-1]
            model = MODELS[mode]
            lead = c.leader()
            if lead is None:
                raise SystemExit("no single leader before the kill run")
            survivors = [i for i in c.live() if i != lead]
            run_no += 1
            run = Run(c, urls, list(range(a.routers)), model, f"bench-run-{run_no}")
            run.start()
            before = engine_requests(urls)
            if a.keep:  # what each router knows of the engines as the run starts
                for i in c.live():
                    (tmp / f"metrics-{i}-before-kill-run.txt").write_text(httpx.get(f"{c.url(i)}/metrics").text)
            half = n_req / a.rate / 2
            timing: dict[str, Any] = {}
            threads: list[threading.Thread] = []

            async def killed_halfway() -> None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run.replay, convs, a)
                    await trio.sleep(half)
                    t_kill = time.monotonic()
                    os.killpg(c.routers[lead].pid, signal.SIGKILL)  # type: ignore[union-attr]
                    timing["engine_requests_at_kill"] = await trio.to_thread.run_sync(engine_requests, urls)
                    for fn, arg in ((successor, survivors), (first_act, survivors[-1])):
                        th = threading.Thread(target=fn, args=(c, arg, t_kill, timing), daemon=True)
                        th.start()
                        threads.append(th)

            trio.run(killed_halfway)
            c.routers[lead].proc.wait(10)  # type: ignore[union-attr]
            for th in threads:
                th.join(130)
            res = run.finish(n_req)
            at_kill = [x - y for x, y in zip(timing["engine_requests_at_kill"], before)]
            after = [x - y for x, y in zip(engine_requests(urls), timing["engine_requests_at_kill"])]
            lost = sum(v for k, v in res["outcomes"].items() if k.startswith("failed"))
            res.update(timing, lost=lost, killed=lead)
            results[f"{mode}: leader killed"] = res
            print(f"leader (router {lead}) SIGKILLed {half:.0f} s into a {a.routers}-router run ({mode}), "
                  f"the client retrying a refused connection once on the next router:")
            print(row(f"{mode}: leader killed", {**res, "cpu_ms_all": float('nan'), "cpu_ms_serving": float('nan')}))
            print(f"  requests lost {lost} of {n_req} (a stream cut after its first byte counts as lost; retried "
                  f"after a refused connection: {res['outcomes'].get('retried', 0)})")
            print(f"  requests each engine finished before the kill {at_kill}, after it {after}")
            print(f"  a survivor leads {timing.get('leads_s', float('nan')):.2f} s after the kill "
                  f"(router {timing.get('leader')}); an admin scale sent to router {survivors[-1]} answers 200 after "
                  f"{timing.get('admin_200_s', float('nan')):.2f} s (answers meanwhile: {timing.get('admin_answers')}); "
                  f"the replica it asked for is routed after {timing.get('placed_s', float('nan')):.2f} s")
        logs = [p.name for p in tmp.glob("*.log")
                if "Traceback (most recent call last)" in p.read_text(errors="replace")]
        if logs:
            print(f"NOTE: a traceback in {', '.join(logs)} (kept in {tmp})")
        print(f"(cluster part took {time.monotonic() - t0:.0f} s)")
    except BaseException:
        print(f"(logs and configs kept in {tmp})", file=sys.stderr)
        raise
    finally:
        if c is not None:
            c.close()
        if pg is not None:
            pg.cleanup()
    workers = BENCH / "bench_workers.py"
    if a.skip_workers:
        pass
    elif workers.exists():
        print(f"--workers 2 against one router process (bench/bench_workers.py --seconds {a.workers_seconds:g} "
              f"--rounds {a.workers_rounds}):", flush=True)
        out = subprocess.run([sys.executable, str(workers), "--seconds", str(a.workers_seconds), "--rounds",
                              str(a.workers_rounds)], capture_output=True, text=True, timeout=900)
        print("  " + "\n  ".join((out.stdout + (out.stderr if out.returncode else "")).strip().splitlines()))
        results["workers"] = out.stdout
    else:
        print("--workers 2 against one worker: measured by bench/bench_workers.py (not on this branch)")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    if not logs and not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"(logs and configs kept in {tmp})")


if __name__ == "__main__":
    main()
