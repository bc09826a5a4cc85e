"""LoRA adapters on demand (vLLM): the router in front of real `llmgw sim` processes, which
implement vLLM's runtime LoRA API. Cold load once under 20 concurrent requests, LRU idle unload at
the cap, an adapter with a stream in flight kept, a hot adapter spreading, a failed load reaching
the clients and retried after its backoff, a restarted replica's holdings re-learned (and its
adapter loaded again at once when it answers 404 for it), an adapter removed from the declaration
leaving routing at once and unloaded once idle."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import SimProc, start_sim
from .stub_engine import StubEngine, answer, normal, send_huge
from .test_router_integration import Daemon, free_port, procs  # noqa: F401 — procs is a fixture
from .test_sim_vllm import wait_for

RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
SLOW = ["--sim-decode-ms-per-token", "20", "--sim-prefill-ms-per-token", "0"]


def lora_sim(procs: list[Any], *extra: str, port: int = 0) -> SimProc:
    s = start_sim(["--engine", "vllm", "m", "--host", "127.0.0.1", "--port", str(port), "--enable-lora",
                   "--max-loras", "4", "--max-cpu-loras", "16", *extra], env=RUNTIME)
    procs.append(s)
    return s


def lora_router(procs: list[Any], tmp: Path, sims: list[SimProc], adapters: dict[str, str], *, cap: int = 4,
                router: str = "", pools: str = "", pool: str | None = None, urls: list[str] | None = None,
                scrape_s: float = 0.2) -> Daemon:
    lines = ["[server]", 'host = "127.0.0.1"', "[router]", f"scrape_interval_s = {scrape_s}", "adapter_backoff_s = 0.5",
             router, "[control]", f"store = {json.dumps(str(tmp / 'router.db'))}",
             "[admin]", f"socket = {json.dumps(str(tmp / 'admin' / 'admin.sock'))}", pools,
             "[[models]]", 'name = "m"', 'engine = "vllm"', f"max_loaded_adapters = {cap}"]
    for url in urls or [s.url for s in sims]:
        lines += ["[[models.replicas]]", f"url = {json.dumps(url)}"] + ([f'pool = "{pool}"'] if pool else [])
    for name, source in adapters.items():
        lines += ["[[models.adapters]]", f"name = {json.dumps(name)}", f"source = {json.dumps(source)}"]
    path = tmp / "llmgw.toml"
    path.write_text("\n".join(lines) + "\n")
    d = Daemon(path)
    procs.append(d)
    return d


def router_metric(d: Daemon, name: str, **labels: str) -> float:
    for line in httpx.get(f"{d.url}/metrics").text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            key = line.rpartition(" ")[0]
            if key.split("{")[0] == name:
                return float(line.rpartition(" ")[2])
    return 0.0


def loads(d: Daemon, outcome: str = "ok") -> float:
    return router_metric(d, "llmgw_adapter_loads_total", outcome=outcome)


def listed(s: SimProc) -> set[str]:
    return {c["id"] for c in httpx.get(f"{s.url}/v1/models").json()["data"] if c.get("parent")}


def ask(d: Daemon, model: str, **kw: Any) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 2, **kw}
    return httpx.post(f"{d.url}/v1/completions", json=body, timeout=30)


def test_a_cold_adapter_is_loaded_once_for_20_concurrent_requests(procs: list[Any], tmp_path: Path) -> None:
    slow_load = ["--sim-decode-ms-per-token", "0", "--sim-prefill-ms-per-token", "0", "--sim-lora-load-ms", "300"]  # the 20 arrive while it loads
    sims = [lora_sim(procs, *slow_load), lora_sim(procs, *slow_load)]
    d = lora_router(procs, tmp_path, sims, {"sql": "/adapters/sql"})
    wait_for(lambda: ask(d, "m").status_code == 200)
    answers: list[int] = []
    go = threading.Barrier(20)

    def one() -> None:
        go.wait()
        answers.append(ask(d, "sql").status_code)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers == [200] * 20
    assert loads(d) == 1 and loads(d, "failed") == 0
    assert sum("sql" in listed(s) for s in sims) == 1
    assert router_metric(d, "llmgw_adapter_load_waiting") == 0
    assert 1 <= router_metric(d, "llmgw_adapter_load_waits_total") <= 20  # exported (late arrivals find it loaded)


def test_at_the_cap_the_least_recently_used_idle_adapter_is_unloaded(procs: list[Any], tmp_path: Path) -> None:
    s = lora_sim(procs, "--sim-zero-cost")
    d = lora_router(procs, tmp_path, [s], {"a": "/ad/a", "b": "/ad/b", "c": "/ad/c"}, cap=2)
    for name in ("a", "b", "a"):  # b is now the least recently used
        assert ask(d, name).status_code == 200
    assert listed(s) == {"a", "b"}
    r = ask(d, "c")
    assert r.status_code == 200, r.text
    assert listed(s) == {"a", "c"}
    assert router_metric(d, "llmgw_adapter_unloads_total", outcome="ok") == 1
    assert router_metric(d, "llmgw_adapters_loaded", replica="m/0") == 2
    sock = tmp_path / "admin" / "admin.sock"
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://llmgw") as admin:
        view = admin.get("/api/v1/adapters").json()
    rep = view["replicas"][0]
    assert rep["replica"] == "m/0" and rep["cap"] == 2 and rep["used"] == 2
    assert sorted(a["adapter"] for a in rep["adapters"]) == ["a", "c"]
    assert view["loads"]["ok"] == 3 and view["unloads"]["ok"] == 1 and view["waiting"] == 0


def test_an_adapter_with_a_stream_in_flight_is_not_unloaded(procs: list[Any], tmp_path: Path) -> None:
    s = lora_sim(procs, *SLOW)
    d = lora_router(procs, tmp_path, [s], {"a": "/ad/a", "b": "/ad/b"}, cap=1, router="queue_timeout_s = 0.5")
    body = {"model": "a", "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{d.url}/v1/completions", json=body) as held:
        assert held.status_code == 200
        chunks = held.iter_bytes()  # kept: a dropped iterator closes the stream
        next(chunks)  # the stream is running
        r = ask(d, "b")  # no idle adapter anywhere: it waits, then 429 with the reason
        assert r.status_code == 429, r.text
        assert "every loaded adapter has requests in flight" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert listed(s) == {"a"}
    r = ask(d, "b")  # a is idle now
    assert r.status_code == 200 and listed(s) == {"b"}


def test_a_hot_adapter_spreads_when_its_holder_is_saturated(procs: list[Any], tmp_path: Path) -> None:
    sims = [lora_sim(procs, *SLOW), lora_sim(procs, *SLOW)]
    d = lora_router(procs, tmp_path, sims, {"a": "/ad/a"}, pool="p",
                    pools='[[pools]]\nname = "p"\nmax_inflight_per_replica = 1')
    assert ask(d, "a").status_code == 200
    first = [i for i, s in enumerate(sims) if "a" in listed(s)]
    assert len(first) == 1
    body = {"model": "a", "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{d.url}/v1/completions", json=body) as held:
        assert held.headers["x-llmgw-endpoint"] == f"m/{first[0]}"
        r = ask(d, "a")  # its only holder is at its cap: loaded on the other replica too
        assert r.status_code == 200 and r.headers["x-llmgw-endpoint"] == f"m/{1 - first[0]}"
    assert all("a" in listed(s) for s in sims)
    assert loads(d) == 2


def test_a_failed_load_reaches_the_clients_and_is_retried_after_its_backoff(procs: list[Any],
                                                                            tmp_path: Path) -> None:
    s = lora_sim(procs, "--sim-zero-cost", "--sim-lora-require-path")
    where = tmp_path / "adapters" / "a"
    d = lora_router(procs, tmp_path, [s], {"a": str(where)}, router="adapter_backoff_max_s = 0.5")
    answers: list[httpx.Response] = []
    go = threading.Barrier(5)

    def one() -> None:
        go.wait()
        answers.append(ask(d, "a"))

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == 5 and loads(d, "failed") >= 1
    for r in answers:
        assert r.status_code in (502, 503), r.text
        err = r.json()["error"]
        assert "No adapter found" in err["message"] and err["code"] == "adapter_load_failed"
    failed = loads(d, "failed")
    r = ask(d, "a")  # within the backoff: the same reason at once, no new load
    if r.status_code == 503:
        assert int(r.headers["retry-after"]) >= 1 and "No adapter found" in r.json()["error"]["message"]
        assert loads(d, "failed") == failed
    where.mkdir(parents=True)  # the operator fixes it: after the backoff the load is tried again
    wait_for(lambda: ask(d, "a").status_code == 200, timeout=10)
    assert loads(d) == 1 and listed(s) == {"a"}
    assert router_metric(d, "llmgw_adapters_loaded", replica="m/0") == 1


def test_a_restarted_replica_s_holdings_are_relearned(procs: list[Any], tmp_path: Path) -> None:
    port = free_port()
    s = lora_sim(procs, "--sim-zero-cost", port=port)
    d = lora_router(procs, tmp_path, [s], {"a": "/ad/a", "b": "/ad/b"}, cap=1)
    assert ask(d, "a").status_code == 200 and listed(s) == {"a"}
    s.stop()
    s2 = lora_sim(procs, "--sim-zero-cost", "--lora-modules", "b=/ad/b", port=port)
    # /v1/models lists both (they are declared); how many replicas serve each is what changed
    served = lambda: {o["id"]: o.get("replicas") for o in httpx.get(f"{d.url}/v1/models").json()["data"]}  # noqa: E731
    wait_for(lambda: served().get("b") == 1 and served().get("a") == 0, timeout=15)
    assert ask(d, "b").status_code == 200
    assert loads(d) == 1  # b was held after the restart: no load
    assert ask(d, "a").status_code == 200  # the slot of b (idle) is made room of; a is loaded again
    assert listed(s2) == {"a"} and loads(d) == 2


def test_an_engine_restarted_on_the_same_url_gets_its_adapter_again_without_a_404(procs: list[Any],
                                                                                  tmp_path: Path) -> None:
    """Issue 21 item 6: the restarted engine answers 404 for an adapter the book says it holds;
    the router loads it again and the client gets 200 — long before the model-list refresh (every
    10 scrapes: 50 s here)."""
    port = free_port()
    s = lora_sim(procs, "--sim-zero-cost", port=port)
    d = lora_router(procs, tmp_path, [s], {"a": "/ad/a"}, scrape_s=5.0)
    wait_for(lambda: ask(d, "a").status_code == 200, timeout=15)
    assert listed(s) == {"a"} and loads(d) == 1
    s.stop()
    s2 = lora_sim(procs, "--sim-zero-cost", port=port)
    assert listed(s2) == set()
    with ThreadPoolExecutor(8) as pool:  # a burst: every request that meets the 404 tries again
        answers = list(pool.map(lambda _: ask(d, "a"), range(8)))
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers if r.status_code != 200]
    assert listed(s2) == {"a"} and loads(d) == 2  # loaded again once
    assert ask(d, "a").status_code == 200 and loads(d) == 2  # held again: no other load


def test_a_removed_adapter_stops_being_served_and_is_unloaded_once_idle(procs: list[Any], tmp_path: Path) -> None:
    """Issue 21 item 3: `PUT` the model without `e1` — requests for it get 404 at once, /v1/models
    drops it, it is not unloaded while a stream for it runs, then is, and its slot serves others."""
    s = lora_sim(procs, *SLOW)
    d = lora_router(procs, tmp_path, [], {}, urls=[])  # the config's model "m" has no replica
    decl = {"name": "n", "engine": "vllm", "max_loaded_adapters": 2, "replicas": [{"url": s.url}],
            "adapters": [{"name": "e1", "source": "/ad/e1"}, {"name": "e2", "source": "/ad/e2"}]}
    sock = tmp_path / "admin" / "admin.sock"
    body = {"model": "e1", "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    ids = lambda: {o["id"] for o in httpx.get(f"{d.url}/v1/models").json()["data"]}  # noqa: E731
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://llmgw", timeout=30) as admin:
        assert admin.put("/api/v1/models/n", json=decl).status_code in (200, 201)
        wait_for(lambda: ask(d, "e1", max_tokens=1).status_code == 200, timeout=15)
        assert listed(s) == {"e1"} and "e1" in ids()
        with httpx.Client(timeout=30) as c, c.stream("POST", f"{d.url}/v1/completions", json=body) as held:
            assert held.status_code == 200
            chunks = held.iter_bytes()
            next(chunks)  # the stream for e1 is running
            decl["adapters"] = [{"name": "e2", "source": "/ad/e2"}, {"name": "e3", "source": "/ad/e3"}]
            r = admin.put("/api/v1/models/n", json=decl)
            assert r.status_code == 200, r.text
            r = ask(d, "e1")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
            assert "e1" not in ids() and {"e2", "e3"} <= ids()
            assert listed(s) == {"e1"}  # a stream is in flight: not unloaded
            rest = b"".join(chunks)
        assert rest.rstrip().endswith(b"data: [DONE]")
        wait_for(lambda: listed(s) == set(), timeout=10)  # idle now: unloaded, its slot free
        rows = admin.get("/api/v1/adapters").json()["replicas"][0]
        assert rows["used"] == 0 and rows["adapters"] == []
    assert ask(d, "e2").status_code == 200 and ask(d, "e3").status_code == 200
    assert listed(s) == {"e2", "e3"}  # both slots usable: nothing was pushed out to make room
    assert loads(d) == 3 and router_metric(d, "llmgw_adapter_unloads_total", outcome="ok") == 1


def test_an_unknown_adapter_is_a_404_in_the_openai_envelope(procs: list[Any], tmp_path: Path) -> None:
    s = lora_sim(procs, "--sim-zero-cost")
    d = lora_router(procs, tmp_path, [s], {"a": "/ad/a"})
    r = ask(d, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert loads(d) == 0 and loads(d, "failed") == 0


class LyingEngine:
    """A vLLM stub whose runtime LoRA API misbehaves: ``mode`` "not_listed" (200, then the adapter
    is not in /v1/models), "hang" (no answer), "huge" (an endless answer)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.release = threading.Event()
        self.engine = StubEngine(self.handle)
        self.url = self.engine.url

    def handle(self, conn: Any, method: str, path: str, body: bytes) -> None:
        if path == "/v1/load_lora_adapter":
            if self.mode == "hang":
                self.release.wait(30)
                return
            if self.mode == "huge":
                send_huge(conn, 64 << 20, "text/plain")
                return
            conn.sendall(answer(200, b"Success: LoRA adapter 'a' added successfully.", [("content-type", "text/plain")]))
        else:
            normal(conn, method, path, body)

    def stop(self) -> None:
        self.release.set()
        self.engine.stop()


@pytest.mark.parametrize(("mode", "status", "outcome", "words"), [
    ("not_listed", 502, "not_listed", "does not list the adapter"),
    ("hang", 504, "timeout", "no answer within"),
    ("huge", 502, "failed", ""),
])
def test_a_misbehaving_load_is_a_clear_error_and_a_counted_failure(procs: list[Any], tmp_path: Path, mode: str,
                                                                   status: int, outcome: str, words: str) -> None:
    e = LyingEngine(mode)
    procs.append(e)
    d = lora_router(procs, tmp_path, [], {"a": "/ad/a"}, urls=[e.url], router="adapter_load_timeout_s = 0.5")
    r = ask(d, "a")
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == "adapter_load_failed" and words in err["message"] and len(err["message"]) < 600
    assert "127.0.0.1" not in err["message"]  # the engine's address is for the log, not for clients
    assert loads(d, outcome) == 1 and loads(d) == 0
    assert router_metric(d, "llmgw_adapters_loaded", replica="m/0") == 0  # no leaked slot
    assert router_metric(d, "llmgw_adapter_load_waiting") == 0  # no stuck waiter


def test_an_adapter_that_does_not_fit_the_base_model_gets_the_engine_s_reason(procs: list[Any],
                                                                              tmp_path: Path) -> None:
    big = tmp_path / "rank64"
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps({"r": 64}))
    s = lora_sim(procs, "--sim-zero-cost", "--max-lora-rank", "16")
    d = lora_router(procs, tmp_path, [s], {"big": str(big)})
    r = ask(d, "big")
    assert r.status_code == 502 and "LoRA rank 64 is greater than max_lora_rank 16" in r.json()["error"]["message"]
    assert loads(d, "failed") == 1 and listed(s) == set()
    assert ask(d, "m").status_code == 200  # the base model is untouched


def sim_metric(s: SimProc, name: str) -> float:
    for line in httpx.get(f"{s.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    return 0.0


def test_the_simulator_loads_a_cold_adapter_once_for_every_request_arriving_meanwhile(procs: list[Any]) -> None:
    # What bench/bench_lora.py reads: one worker-cache load, and every request that waited for it.
    s = lora_sim(procs, "--sim-decode-ms-per-token", "0", "--sim-prefill-ms-per-token", "0",
                 "--sim-lora-load-ms", "1000", "--max-cpu-loras", "1")
    for name in ("a", "b"):  # b pushes a out of the one-adapter worker cache
        r = httpx.post(f"{s.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": f"/ad/{name}"}, timeout=10)
        assert r.status_code == 200
    assert sim_metric(s, "llmgw_sim_lora_loads_total") == 2
    answers: list[int] = []
    go = threading.Barrier(5)

    def one() -> None:
        go.wait()
        answers.append(httpx.post(f"{s.url}/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1},
                                  timeout=30).status_code)

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers == [200] * 5
    assert sim_metric(s, "llmgw_sim_lora_loads_total") == 3  # a, once
    assert sim_metric(s, "llmgw_sim_lora_load_waits_total") == 5
    assert httpx.post(f"{s.url}/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1}).status_code == 200
    assert sim_metric(s, "llmgw_sim_lora_load_waits_total") == 5  # warm now
