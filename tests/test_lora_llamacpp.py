"""llama.cpp LoRA adapters through the router: the per-request ``lora`` list (the asked adapter at
its scale, every other id at 0; a base request all zeros), the ids learned from each replica's
``/lora-adapters`` (untrusted, bounded), unknown adapters, ``/v1/models``. Pure pieces, the
scrape boundary in process, and a router in front of simulated llama-servers."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from llmgw.config import parse_config
from llmgw.daemon.net.upstream import UpstreamPool
from llmgw.daemon.router.registry import Registry
from llmgw.route.engine_answers import MAX_ADAPTERS, BadAnswer, lora_adapters_of
from llmgw.route.lora_body import lora_list, request_body, with_lora

from .conftest import SimProc, start_sim
from .stub_engine import StubEngine, answer, handler_of
from .test_router_integration import Daemon
from .test_sim_vllm import wait_for


def _model(urls: list[str], adapters: list[tuple[str, str, float]]) -> str:
    out = ['[[models]]', 'name = "m"', 'engine = "llamacpp"']
    for u in urls:
        out += ["[[models.replicas]]", f"url = {json.dumps(u)}"]
    for name, source, scale in adapters:
        out += ["[[models.adapters]]", f'name = "{name}"', f"source = {json.dumps(source)}", f"scale = {scale}"]
    return "\n".join(out) + "\n"


AB = [("a", "/l/a.gguf", 0.5), ("b", "/l/b.gguf", 1.0)]


# -- the body -----------------------------------------------------------------------------------
def test_lora_list_puts_the_asked_id_at_its_scale_and_zeros_elsewhere() -> None:
    assert lora_list((0, 1, 2), 1, 0.5) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}, {"id": 2, "scale": 0.0}]
    assert lora_list((0, 1), None, 1.0) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]


@pytest.mark.parametrize("raw", [b'{"model":"a","prompt":"x"}', b' \n{ "model" : "a", "prompt": "x" }\r\n ',
                                 b'{"model":"a","prompt":"}\\"{"}'])
def test_with_lora_splices_the_list_into_the_body_as_it_came(raw: bytes) -> None:
    obj = json.loads(raw)
    out = with_lora(raw, obj, [{"id": 0, "scale": 1.0}])
    assert json.loads(out) == {**obj, "lora": [{"id": 0, "scale": 1.0}]}
    assert out.startswith(raw.rstrip(b" \t\r\n")[:-1])  # the client's bytes, not a re-serialisation


def test_with_lora_replaces_a_clients_own_list_and_handles_other_encodings() -> None:
    raw = b'{"model":"a","lora":[{"id":3,"scale":9}]}'
    assert json.loads(with_lora(raw, json.loads(raw), [])) == {"model": "a", "lora": []}
    utf16 = '{"model":"a"}'.encode("utf-16")
    assert json.loads(with_lora(utf16, json.loads(utf16), [])) == {"model": "a", "lora": []}
    bom = b"\xef\xbb\xbf" + b'{"model":"a"}'
    assert json.loads(with_lora(bom, json.loads(bom), [])) == {"model": "a", "lora": []}


def test_request_body_only_for_llamacpp_models_with_declared_adapters() -> None:
    reg = Registry(parse_config(_model(["http://127.0.0.1:1"], AB)))
    entry = reg.models["m"]
    rep = entry.replicas[0]
    raw = b'{"model":"m","prompt":"x"}'
    obj = json.loads(raw)
    # ids not learned yet: no request may go there (the scheduler does not see it), and none is sent blind
    assert reg.views(entry, 0.0) == []
    for adapter in (None, "a"):
        with pytest.raises(LookupError):
            request_body(raw, obj, entry, rep, adapter)
    reg.set_lora_ids(rep, {"/l/b.gguf": 0, "/l/a.gguf": 1, "/l/other.gguf": 2})
    assert rep.view.adapters == {"a", "b"} and reg.views(entry, 0.0) == [rep.view]
    assert json.loads(request_body(raw, obj, entry, rep, "a"))["lora"] == [
        {"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}, {"id": 2, "scale": 0.0}]
    assert json.loads(request_body(raw, obj, entry, rep, None))["lora"] == [
        {"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}, {"id": 2, "scale": 0.0}]
    plain = Registry(parse_config(_model(["http://127.0.0.1:1"], [])))
    assert request_body(raw, obj, plain.models["m"], plain.models["m"].replicas[0], None) is raw


def test_declared_adapters_resolve_and_unknown_ones_do_not() -> None:
    reg = Registry(parse_config(_model(["http://127.0.0.1:1"], AB)))
    assert reg.resolve("a") == (reg.models["m"], "a")
    assert reg.resolve("zzz") is None


# -- /lora-adapters -----------------------------------------------------------------------------
def test_lora_adapters_of_maps_paths_to_ids() -> None:
    body = b'[{"id":0,"path":"/l/a.gguf","scale":0.0},{"id":1,"path":"/l/b.gguf","scale":0.0,"task_name":""}]'
    assert lora_adapters_of(body) == {"/l/a.gguf": 0, "/l/b.gguf": 1}
    assert lora_adapters_of(b"[]") == {}


@pytest.mark.parametrize("body", [
    b"", b"garbage", b"{}", b"[1]", b'[{"id":"0","path":"x"}]', b'[{"id":0}]', b'[{"id":5,"path":"x"}]',
    b'[{"id":0,"path":"x"},{"id":0,"path":"y"}]', b'[{"id":0,"path":"x"},{"id":1,"path":"x"}]',
    b'[{"id":true,"path":"x"}]', b'[{"id":0,"path":"' + b"p" * 5000 + b'"}]', b"[" * 100_000,
])
def test_lora_adapters_of_refuses_what_it_cannot_use(body: bytes) -> None:
    with pytest.raises(BadAnswer):
        lora_adapters_of(body)


def test_lora_adapters_are_bounded() -> None:
    many = b",".join(b'{"id":%d,"path":"p%d"}' % (i, i) for i in range(MAX_ADAPTERS + 1))
    with pytest.raises(BadAnswer, match="more than"):
        lora_adapters_of(b"[" + many + b"]")


_LLAMA_METRICS = answer(200, b"llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n",
                        [("content-type", "text/plain")])


def _scrape(reg: Registry, times: int = 1) -> None:
    async def main() -> None:
        async with UpstreamPool() as pool:
            for _ in range(times):
                for rep in list(reg.replicas.values()):
                    await reg.scrape_one(pool, rep)

    trio.run(main)


def test_ids_are_learned_from_lora_adapters_by_path() -> None:
    listed = b'[{"id":0,"path":"/l/b.gguf","scale":0.0},{"id":1,"path":"/l/x.gguf","scale":0.0}]'
    engine = StubEngine(handler_of({"/lora-adapters": answer(200, listed), "/metrics": _LLAMA_METRICS}))
    try:
        reg = Registry(parse_config(_model([engine.url], AB)))
        _scrape(reg, 3)
    finally:
        engine.stop()
    rep = reg.models["m"].replicas[0]
    # a declared adapter the replica does not list is not on it: it is not eligible for it
    assert rep.lora_ids == {"b": 0} and rep.lora_all == (0, 1) and rep.view.adapters == {"b"}
    assert reg.models["m"].adapters == {"b": {rep.id}}
    assert engine.count("/lora-adapters") == 1  # learned once (again with the slow /v1/models round)


def test_garbage_lora_adapters_is_counted_and_the_replica_loses_its_adapters(caplog: pytest.LogCaptureFixture) -> None:
    state = {"body": b'[{"id":0,"path":"/l/a.gguf","scale":0.0}]'}

    def lora(conn: Any, *a: Any) -> None:
        conn.sendall(answer(200, state["body"]))

    engine = StubEngine(handler_of({"/lora-adapters": lora, "/metrics": _LLAMA_METRICS}))
    try:
        reg = Registry(parse_config(_model([engine.url], AB)))
        rep = reg.models["m"].replicas[0]
        _scrape(reg)
        assert rep.view.adapters == {"a"}
        state["body"] = b"\x00 not json"

        async def main() -> None:
            async with UpstreamPool() as pool:
                for _ in range(2):
                    await reg.scrape_one(pool, rep, models_too=True)

        with caplog.at_level(logging.WARNING, logger="llmgw.router"):
            trio.run(main)
    finally:
        engine.stop()
    assert rep.lora_ids is None and rep.view.adapters == frozenset() and "a" not in reg.models["m"].adapters
    assert reg.answer_errors[(rep.id, "/lora-adapters")] == 2
    assert rep.scrape_error is None  # the metrics are fine: routing goes on
    assert [r for r in caplog.records if "/lora-adapters" in r.getMessage()]


# -- a router in front of simulated llama-servers -----------------------------------------------
@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in reversed(started):
        p.stop()


def llama(procs: list[Any], *loras: Path) -> SimProc:
    args = ["--engine", "llamacpp", "-m", "base.gguf", "--port", "0", "-np", "1", "--metrics", "--sim-zero-cost",
            "--sim-lora-require-path"]
    for f in loras:
        args += ["--lora-scaled", f"{f}:0"]
    s = start_sim(args)
    procs.append(s)
    return s


def router_for(procs: list[Any], tmp: Path, urls: list[str], adapters: list[tuple[str, str, float]]) -> Daemon:
    text = (f'[server]\nhost = "127.0.0.1"\n[router]\nscrape_interval_s = 0.1\n'
            f"[control]\nstore = {json.dumps(str(tmp / 'router.db'))}\n"
            f"[admin]\nsocket = {json.dumps(str(tmp / 'admin' / 'admin.sock'))}\n" + _model(urls, adapters))
    (tmp / "llmgw.toml").write_text(text)
    d = Daemon(tmp / "llmgw.toml")
    procs.append(d)
    return d


def slot_lora(url: str) -> list[dict[str, Any]]:
    (slot,) = httpx.get(url + "/slots").json()
    return slot["params"]["lora"]


def complete(d: Daemon, model: str) -> httpx.Response:
    return httpx.post(d.url + "/v1/completions", json={"model": model, "prompt": "hello there", "max_tokens": 2})


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out = {n: tmp_path / f"{n}.gguf" for n in ("a", "b")}
    for f in out.values():
        f.write_bytes(b"GGUF")
    return out


def test_adapter_and_base_requests_carry_the_explicit_list(procs: list[Any], tmp_path: Path,
                                                          files: dict[str, Path]) -> None:
    both = llama(procs, files["b"], files["a"])  # ids: b = 0, a = 1
    only_b = llama(procs, files["b"])
    d = router_for(procs, tmp_path, [both.url, only_b.url], [("a", str(files["a"]), 0.5), ("b", str(files["b"]), 1.0)])
    wait_for(lambda: complete(d, "a").status_code == 200, timeout=20)  # the ids are learned
    for _ in range(4):  # only the replica listing "a" is eligible for it
        r = complete(d, "a")
        assert r.status_code == 200 and r.headers["x-llmgw-endpoint"] == "m/0"
        assert slot_lora(both.url) == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]
    seen = set()
    for _ in range(12):  # base requests: all zeros wherever they land (the slot ran "a" before)
        r = complete(d, "m")
        assert r.status_code == 200
        url = both.url if r.headers["x-llmgw-endpoint"] == "m/0" else only_b.url
        seen.add(url)
        assert slot_lora(url) == [{"id": 0, "scale": 0.0}] + ([{"id": 1, "scale": 0.0}] if url == both.url else [])
    r = complete(d, "b")
    assert r.status_code == 200
    assert {"id": 0, "scale": 1.0} in slot_lora(both.url if r.headers["x-llmgw-endpoint"] == "m/0" else only_b.url)
    assert seen  # the base requests went through


def test_unknown_adapter_is_a_counted_404_and_v1_models_lists_declared_adapters(
        procs: list[Any], tmp_path: Path, files: dict[str, Path]) -> None:
    s = llama(procs, files["a"])
    d = router_for(procs, tmp_path, [s.url], [("a", str(files["a"]), 1.0), ("never", "/nowhere/never.gguf", 1.0)])
    r = complete(d, "zzz")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "The model `zzz` does not exist.", "type": "invalid_request_error",
                                 "param": "model", "code": "model_not_found"}
    metrics = httpx.get(d.url + "/metrics").text
    assert 'llmgw_requests_total{code="404",model="-",outcome="rejected"} 1' in metrics.replace(
        'model="-",outcome="rejected",code="404"', 'code="404",model="-",outcome="rejected"')
    models = {o["id"]: o for o in httpx.get(d.url + "/v1/models").json()["data"]}
    assert models["a"]["parent"] == "m" and models["never"]["parent"] == "m" and models["never"]["replicas"] == 0
    wait_for(lambda: httpx.get(d.url + "/v1/models/a").json()["replicas"] == 1, timeout=20)
    # declared, listed by no replica: known, but nothing can serve it
    r = complete(d, "never")
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def test_a_replica_with_garbage_lora_adapters_gets_no_requests(procs: list[Any], tmp_path: Path,
                                                                      files: dict[str, Path]) -> None:
    bad = StubEngine(handler_of({"/lora-adapters": answer(200, b"\x00garbage"), "/metrics": _LLAMA_METRICS}))
    procs.append(bad)
    good = llama(procs, files["a"])
    d = router_for(procs, tmp_path, [bad.url, good.url], [("a", str(files["a"]), 1.0)])
    wait_for(lambda: complete(d, "a").status_code == 200, timeout=20)
    for _ in range(6):  # adapter and base requests: its ids are unknown, so none may go there
        for model in ("a", "m"):
            r = complete(d, model)
            assert r.status_code == 200 and r.headers["x-llmgw-endpoint"] == "m/1"
    assert bad.count("/v1/completions") == 0
    assert 'path="/lora-adapters"' in httpx.get(d.url + "/metrics").text


def test_a_changed_declaration_makes_the_ids_be_learned_again() -> None:
    cfg = parse_config(_model(["http://127.0.0.1:1"], AB))
    reg = Registry(cfg)
    entry = reg.models["m"]
    rep = entry.replicas[0]
    reg.set_lora_ids(rep, {"/l/a.gguf": 0, "/l/b.gguf": 1})
    reg.add_model(cfg.models[0])  # the same declaration: nothing to learn again
    assert rep.lora_ids == {"a": 0, "b": 1}
    changed = parse_config(_model(["http://127.0.0.1:1"], [("a", "/l/a2.gguf", 0.5)])).models[0]
    reg.add_model(changed)  # its engines restart with other files: the old ids mean nothing
    assert rep.lora_ids is None and reg.views(entry, 0.0) == [] and entry.adapters == {}
    assert set(entry.declared) == {"a"}
