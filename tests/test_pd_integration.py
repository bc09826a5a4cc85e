"""Prefill/decode disaggregation over real processes: a router in front of simulated vLLM engines
started with --kv-transfer-config — one prefiller, two decoders. The two-step path (streamed and
not), a short prompt that skips it, every failure's fallback (prefiller down, its blocks gone, a
decoder whose pull fails under policy fail), explain and the trace."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai

from .conftest import SimProc, start_sim
from .test_router_integration import Daemon, free_port, procs  # noqa: F401 — the fixture
from .test_sim_vllm import metrics, wait_for

LONG = "Summarise the following report on the state of the river delta and its harbours. " * 40
KV = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def sim(procs: list[Any], policy: str = "recompute", *extra: str) -> SimProc:  # noqa: F811
    s = start_sim(["--engine", "vllm", "m", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost",
                   "--kv-transfer-config", json.dumps({**KV, "kv_load_failure_policy": policy}), *extra])
    procs.append(s)
    return s


def pd_router(procs: list[Any], tmp: Path, prefill: list[SimProc], decode: list[SimProc],  # noqa: F811
              min_prompt_tokens: int = 64) -> Daemon:
    lines = ["[server]", 'host = "127.0.0.1"', "[router]", "scrape_interval_s = 0.2",
             "[control]", f"store = {json.dumps(str(tmp / 'router.db'))}",
             "[admin]", f"socket = {json.dumps(str(tmp / 'admin' / 'admin.sock'))}",
             "[[models]]", 'name = "m"', 'engine = "vllm"', "[models.pd]", f"min_prompt_tokens = {min_prompt_tokens}"]
    for role, sims in (("prefill", prefill), ("decode", decode)):
        for s in sims:
            lines += ["[[models.replicas]]", f'url = "{s.url}"', f'role = "{role}"']
    cfg = tmp / "llmgw.toml"
    cfg.write_text("\n".join(lines) + "\n")
    d = Daemon(cfg)
    procs.append(d)
    wait_for(lambda: httpx.get(f"{d.url}/ready").status_code == 200, 20)
    return d


def ctl(tmp: Path, *args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "llmgw", "ctl", "--socket", str(tmp / "admin" / "admin.sock"),
                          *args, "-o", "json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def metric(url: str, name: str, **labels: str) -> float:
    """A series' value (summed over what the labels leave open); 0 when there is none."""
    return sum(v for key, v in metrics(url).items()
               if key.split("{")[0] == name and all(f'{k}="{val}"' in key for k, val in labels.items()))


def router_metric(d: Daemon, name: str, **labels: str) -> float:
    return metric(d.url, name, **labels)


def test_a_long_prompt_is_prefilled_on_the_prefiller_and_decoded_elsewhere(procs: list[Any],  # noqa: F811
                                                                           tmp_path: Path) -> None:
    p = sim(procs)
    decoders = [sim(procs), sim(procs)]
    d = pd_router(procs, tmp_path, [p], decoders)
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="x")
    # not streamed: one ordinary answer, from a decoder
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": LONG}], max_tokens=6, extra_headers={"x-request-id": "pd-1"})
    chat = raw.parse()
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    assert raw.headers["x-llmgw-endpoint"] in ("m/1", "m/2")  # a decoder answered
    # streamed, completions API
    chunks = list(client.completions.create(model="m", prompt=LONG, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}, extra_headers={"x-request-id": "pd-2"}))
    assert chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    # the prefiller prefilled both (its blocks read by the decoders), the decoders pulled, none failed
    assert metric(p.url, "llmgw_sim_kv_transfer_reads_total") == 2
    pulled = sum(metric(s.url, "llmgw_sim_kv_transfer_blocks_total") or 0
                 for s in decoders)
    assert pulled > 0 and pulled == router_metric(d, "llmgw_pd_transferred_blocks_total", model="m")
    assert router_metric(d, "llmgw_pd_requests_total", model="m", path="split") == 2
    assert router_metric(d, "llmgw_pd_fallbacks_total", model="m", reason="no_prefiller") == 0
    # explain: two decisions, the prefiller's and the decoder's
    ds = ctl(tmp_path, "explain", "pd-1")
    ds = ds.get("decisions", ds) if isinstance(ds, dict) else ds
    assert [x["phase"] for x in ds] == ["prefill", "decode"]
    assert ds[0]["chosen"] == "m/0" and ds[1]["chosen"] in ("m/1", "m/2")
    assert ds[0]["strategy"] == "prefill" and ds[1]["strategy"] == "decode"
    # the trace: prefill, transfer, decode
    tr = ctl(tmp_path, "trace", "pd-2")
    names = [ph["name"] for ph in tr["phases"]]
    assert "prefill" in names and names[-2:] == ["transfer", "decode"], names
    assert [a["phase"] for a in tr["attempts"]] == ["prefill", "decode"] and tr["outcome"] == "ok"


def test_a_short_prompt_goes_straight_to_a_decoder(procs: list[Any], tmp_path: Path) -> None:  # noqa: F811
    p = sim(procs)
    d = pd_router(procs, tmp_path, [p], [sim(procs)], min_prompt_tokens=256)
    r = httpx.post(f"{d.url}/v1/chat/completions", json={"model": "m", "max_tokens": 3,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["x-llmgw-endpoint"] == "m/1"
    assert router_metric(d, "llmgw_pd_requests_total", model="m", path="short") == 1
    assert metric(p.url, "vllm:request_success_total") == 0


def test_every_prefill_failure_falls_back_to_the_decoder_prefilling(procs: list[Any],  # noqa: F811
                                                                    tmp_path: Path) -> None:
    p = sim(procs)
    dec = sim(procs)
    d = pd_router(procs, tmp_path, [p], [dec])
    def body(i: int) -> dict[str, Any]:  # each its own prompt: a decoder that prefilled one has it cached
        return {"model": "m", "messages": [{"role": "user", "content": f"Report {i}. {LONG}"}], "max_tokens": 4}

    # the prefiller is gone: a connect error — the decoder prefills, the client gets its answer
    p.stop()
    for i in range(2):
        r = httpx.post(f"{d.url}/v1/chat/completions", json=body(i), headers={"x-request-id": f"down-{i}"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert router_metric(d, "llmgw_pd_fallbacks_total", model="m", reason="connect") >= 1
    tr = ctl(tmp_path, "trace", "down-0")
    assert any("the decoder prefills" in ph["note"] for ph in tr["phases"]), tr["phases"]
    assert tr["outcome"] == "ok"
    # its breaker opens after failure_threshold of them: then no prefiller can take it at all
    for i in range(2, 5):
        assert httpx.post(f"{d.url}/v1/chat/completions", json=body(i)).status_code == 200
    assert router_metric(d, "llmgw_pd_fallbacks_total", model="m", reason="no_prefiller") >= 1
    assert metric(dec.url, "llmgw_sim_kv_transfer_blocks_total") == 0


class MovedPrefiller:
    """A prefiller whose answers point decoders at a closed port — what a prefiller that went away
    after its prefill (or a side channel no decoder can reach) looks like to a decoder: its pull
    fails. Forwards everything else to the simulated prefiller as it is."""

    def __init__(self, target: str) -> None:
        closed = free_port()
        client = httpx.Client(base_url=target, timeout=30)

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                r = client.request(self.command, self.path, content=self.rfile.read(n) if n else None,
                                   headers={"content-type": self.headers.get("content-type", "application/json")})
                body = r.content
                if self.command == "POST" and r.status_code == 200:
                    doc = r.json()
                    if doc.get("kv_transfer_params"):
                        doc["kv_transfer_params"]["remote_port"] = closed
                    body = json.dumps(doc).encode()
                self.send_response(r.status_code)
                self.send_header("content-type", r.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _forward

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_decoder_that_cannot_pull_fails_and_the_retry_prefills(procs: list[Any], tmp_path: Path) -> None:  # noqa: F811
    # the decoders run policy fail: a pull that fails answers 500 (vLLM's "Internal server error");
    # the router retries on the other decoder without the params, and that one prefills
    moved = MovedPrefiller(sim(procs).url)
    procs.append(moved)
    decoders = [sim(procs, "fail"), sim(procs, "fail")]
    d = pd_router(procs, tmp_path, [moved], decoders)  # type: ignore[list-item]
    r = httpx.post(f"{d.url}/v1/chat/completions", json={"model": "m", "max_tokens": 3,
                                                         "messages": [{"role": "user", "content": LONG}]},
                   headers={"x-request-id": "lost"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert router_metric(d, "llmgw_pd_fallbacks_total", model="m", reason="decode_retry") == 1
    tr = ctl(tmp_path, "trace", "lost")
    assert [a["phase"] for a in tr["attempts"]] == ["prefill", "decode", ""]
    assert tr["attempts"][1]["status"] == 500 and tr["attempts"][2]["outcome"] == "ok"
    assert "its decoder prefills" in tr["attempts"][1]["error"]
    assert sum(metric(x.url, "vllm:nixl_num_failed_transfers_total") for x in decoders) == 1


def test_a_clients_own_kv_transfer_params_are_refused(procs: list[Any], tmp_path: Path) -> None:  # noqa: F811
    d = pd_router(procs, tmp_path, [sim(procs)], [sim(procs)])
    r = httpx.post(f"{d.url}/v1/completions", json={"model": "m", "prompt": "x", "kv_transfer_params": {
        "do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 5600}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


def test_a_tenants_split_requests_are_billed_once_for_the_decoders_answer(procs: list[Any],  # noqa: F811
                                                                         tmp_path: Path) -> None:
    """Tenants × disaggregation: the prefill step's one token is never billed; a streamed split
    request the router asks usage for (its tap) still carries the prefiller's params."""
    p = sim(procs)
    dec = sim(procs)
    d = pd_router(procs, tmp_path, [p], [dec])
    admin = httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp_path / "admin" / "admin.sock")),
                         base_url="http://admin/api/v1")
    with admin as a:
        assert a.post("/tenants", json={"name": "team-a", "models": ["m"]}).status_code == 201
        r = a.post("/tenants/team-a/keys", json={"name": "ci"})
        auth = {"authorization": f"Bearer {r.json()['key']}"}
        body = {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{d.url}/v1/chat/completions", json=body, headers=auth).status_code == 200
        again = {**body, "stream": True, "messages": [{"role": "user", "content": "Again. " + LONG}]}  # not cached
        r = httpx.post(f"{d.url}/v1/chat/completions", json=again, headers=auth)
        assert r.status_code == 200 and "[DONE]" in r.text and '"usage"' not in r.text  # the tap's, stripped
        (row,) = a.get("/usage", params={"tenant": "team-a", "by": "key"}).json()["rows"]
        assert row["requests"] == 2 and row["completion_tokens"] == 8 and row["errors"] == 0
    # both were split: the prefiller's blocks were read twice, by the decoder (the router's /metrics
    # now wants an operator's key)
    assert metric(p.url, "llmgw_sim_kv_transfer_reads_total") == 2
    assert metric(dec.url, "llmgw_sim_kv_transfer_failures_total") == 0


def test_a_slow_prefiller_times_out_and_one_without_a_connector_gives_no_params(procs: list[Any],  # noqa: F811
                                                                                tmp_path: Path) -> None:
    """The two fallbacks an answer decides: no answer within prefill_timeout_s, and an answer without
    kv_transfer_params (a "prefill" replica started without a KV connector)."""
    slow = start_sim(["--engine", "vllm", "m", "--host", "127.0.0.1", "--port", "0", "--sim-prefill-ms-per-token", "50",
                      "--kv-transfer-config", json.dumps(KV)])  # a long prompt's prefill: seconds
    procs.append(slow)
    plain = start_sim(["--engine", "vllm", "m", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost"])
    procs.append(plain)
    dec = sim(procs)
    body = {"model": "m", "messages": [{"role": "user", "content": LONG}], "max_tokens": 3}
    for prefiller, reason in ((slow, "timeout"), (plain, "no_params")):
        tmp = tmp_path / reason
        tmp.mkdir()
        lines = ["[server]", 'host = "127.0.0.1"', "[router]", "scrape_interval_s = 0.2",
                 "[control]", f"store = {json.dumps(str(tmp / 'router.db'))}",
                 "[admin]", f"socket = {json.dumps(str(tmp / 'admin' / 'admin.sock'))}",
                 "[[models]]", 'name = "m"', 'engine = "vllm"', "[models.pd]", "min_prompt_tokens = 64",
                 "prefill_timeout_s = 0.3"]
        for url, role in ((prefiller.url, "prefill"), (dec.url, "decode")):
            lines += ["[[models.replicas]]", f'url = "{url}"', f'role = "{role}"']
        (tmp / "llmgw.toml").write_text("\n".join(lines) + "\n")
        d = Daemon(tmp / "llmgw.toml")
        procs.append(d)
        wait_for(lambda: httpx.get(f"{d.url}/ready").status_code == 200, 20)
        r = httpx.post(f"{d.url}/v1/chat/completions", json=body, timeout=30, headers={"x-request-id": reason})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, reason
        tr = ctl(tmp, "trace", reason)
        assert router_metric(d, "llmgw_pd_fallbacks_total", model="m", reason=reason) == 1, reason
        assert any(f"gave no KV to pull ({reason}" in ph["note"] for ph in tr["phases"]), tr["phases"]
        assert router_metric(d, "llmgw_pd_transferred_blocks_total", model="m") == 0


def test_a_next_turn_cached_on_its_decoder_goes_there_unsplit(procs: list[Any], tmp_path: Path) -> None:  # noqa: F811
    """The threshold reads what the decoder would compute: a conversation's next turn, its history
    cached on the decoder that served the last one, is not prefilled again elsewhere."""
    p = sim(procs)
    decoders = [sim(procs), sim(procs)]
    d = pd_router(procs, tmp_path, [p], decoders)
    first = [{"role": "user", "content": LONG}]
    r = httpx.post(f"{d.url}/v1/chat/completions", json={"model": "m", "max_tokens": 4, "messages": first})
    assert r.status_code == 200
    holder = r.headers["x-llmgw-endpoint"]
    said = r.json()["choices"][0]["message"]["content"]
    dec = decoders[int(holder.split("/")[1]) - 1]
    hits = metric(dec.url, "vllm:prefix_cache_hits_total")
    turn = [*first, {"role": "assistant", "content": said}, {"role": "user", "content": "And the harbours?"}]
    r = httpx.post(f"{d.url}/v1/chat/completions", json={"model": "m", "max_tokens": 4, "messages": turn},
                   headers={"x-request-id": "turn-2"})
    assert r.status_code == 200 and r.headers["x-llmgw-endpoint"] == holder
    assert router_metric(d, "llmgw_pd_requests_total", model="m", path="cached") == 1
    assert router_metric(d, "llmgw_pd_requests_total", model="m", path="split") == 1
    assert metric(p.url, "llmgw_sim_kv_transfer_reads_total") == 1  # the first turn's only
    assert metric(dec.url, "vllm:prefix_cache_hits_total") > hits  # the pulled blocks served the turn
    (one,) = ctl(tmp_path, "explain", "turn-2")["decisions"]
    assert one["chosen"] == holder and "cached on " + holder in one["note"]


def test_an_unreachable_prefiller_is_replaced_by_another(procs: list[Any], tmp_path: Path) -> None:  # noqa: F811
    gone = sim(procs)
    live = sim(procs)
    dec = sim(procs)
    d = pd_router(procs, tmp_path, [gone, live], [dec])
    gone.stop()
    retried = ""
    for i in range(20):  # until a request's prefiller of choice is the one that is gone
        rid = f"r-{i}"
        r = httpx.post(f"{d.url}/v1/chat/completions", headers={"x-request-id": rid}, json={
            "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": f"Report {i}. {LONG}"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        if [a["phase"] for a in ctl(tmp_path, "trace", rid)["attempts"]] == ["prefill", "prefill", "decode"]:
            retried = rid
            break
    assert retried, "the gone prefiller was never chosen"
    tr = ctl(tmp_path, "trace", retried)
    assert tr["attempts"][0]["replica"] == "m/0" and tr["attempts"][0]["outcome"] == "connect"
    assert tr["attempts"][1]["replica"] == "m/1" and tr["outcome"] == "ok"
    assert any("another prefiller" in ph["note"] for ph in tr["phases"]), tr["phases"]
    # every request was split: none fell back to its decoder prefilling
    assert router_metric(d, "llmgw_pd_fallbacks_total", model="m") == 0
    assert metric(live.url, "llmgw_sim_kv_transfer_reads_total") == i + 1
