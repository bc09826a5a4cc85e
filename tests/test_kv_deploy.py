"""`[models.deploy] kv_events = true`: config validation, the spec on the wire, the engine's command line
and environment, and a real agent-launched simulated vLLM publishing KV events where it reports."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
import trio
import zmq

from llmgw.config import ConfigError, parse_config
from llmgw.daemon.control.plane.plane import deploy_of
from llmgw.fleet.engine_cmd import build_command, build_env
from llmgw.fleet.types import EngineReport, EngineSpec
from llmgw.fleet.wire_fields import WireProtocolError  # noqa: F401  (the wire checker's error)
from llmgw.kv.events import BlockStored, decode_batch
from tests.test_engines import Harness, groups, running, sim_spec  # noqa: F401  (fixture)

KV = ("ipc:///s/kv/a.pub", "ipc:///s/kv/a.replay")


def _cfg(engine: str, extra: str = "kv_events = true") -> str:
    path = 'model_path = "x.gguf"\n' if engine == "llamacpp" else ""
    return f'[[models]]\nname = "m"\nengine = "{engine}"\n[models.deploy]\n{path}{extra}\n'


def test_config_kv_events_on_for_vllm_reaches_the_template_spec():
    cfg = parse_config(_cfg("vllm"))
    assert cfg.models[0].deploy.kv_events is True
    assert deploy_of(cfg.models[0]).template.kv_events is True
    off = parse_config(_cfg("vllm", ""))
    assert off.models[0].deploy.kv_events is False and deploy_of(off.models[0]).template.kv_events is False


def test_config_kv_events_refused_for_llamacpp_naming_the_field():
    with pytest.raises(ConfigError) as e:
        parse_config(_cfg("llamacpp"))
    text = str(e.value)
    assert "models[0].deploy.kv_events" in text and "vllm" in text


def test_config_kv_events_not_a_bool():
    with pytest.raises(ConfigError) as e:
        parse_config(_cfg("vllm", 'kv_events = "yes"'))
    assert "kv_events" in str(e.value)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("simulate", [False, True])
def test_command_line_vllm_and_simulator(simulate):
    spec = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="org/m", simulate=simulate, kv_events=True)
    cmd = build_command(spec, "127.0.0.1", 8001, sys.executable, KV)
    cfg = json.loads(_flag(cmd, "--kv-events-config"))
    assert cfg == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": KV[0], "replay_endpoint": KV[1],
                   "topic": "kv"}
    assert _flag(cmd, "--prefix-caching-hash-algo") == "sha256_cbor"
    assert "--block-size" not in cmd  # the engine's own, read by the router
    if simulate:
        assert cmd[1:6] == ["-m", "llmgw", "sim", "--engine", "vllm"]
    else:
        assert cmd[:3] == ["vllm", "serve", "org/m"]


def test_command_line_off_has_no_kv_flags_and_kv_needs_endpoints():
    spec = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="org/m")
    cmd = build_command(spec, "127.0.0.1", 8001, sys.executable)
    assert "--kv-events-config" not in cmd and "--prefix-caching-hash-algo" not in cmd
    with pytest.raises(ValueError, match="endpoints"):
        build_command(EngineSpec(replica="m/1", model="m", engine="vllm", model_path="m", kv_events=True),
                      "127.0.0.1", 8001, sys.executable)
    with pytest.raises(ValueError, match="kv_events needs engine vllm"):
        build_command(EngineSpec(replica="m/1", model="m", engine="llamacpp", model_path="m.gguf", kv_events=True),
                      "127.0.0.1", 8001, sys.executable, KV)


def test_env_fixed_hash_seed_unless_the_profile_sets_one():
    on = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="m", kv_events=True)
    assert build_env(on, {"PYTHONHASHSEED": "random", "A": "1"}) == {"PYTHONHASHSEED": "0", "A": "1"}
    own = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="m", kv_events=True,
                     env=(("PYTHONHASHSEED", "7"),))
    assert build_env(own, {})["PYTHONHASHSEED"] == "7"
    off = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="m")
    assert build_env(off, {"PYTHONHASHSEED": "random"}) == {"PYTHONHASHSEED": "random"}


def test_wire_spec_and_report_fields_optional():
    off = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="m")
    assert "kv_events" not in off.to_wire()  # spec_hash of existing engines unchanged: no restarts
    on = EngineSpec(replica="m/1", model="m", engine="vllm", model_path="m", kv_events=True)
    assert on.spec_hash() != off.spec_hash()
    from llmgw.fleet import wire_fields
    assert wire_fields._spec(on.to_wire(), "spec") == on and wire_fields._spec(off.to_wire(), "spec") == off
    r = EngineReport(replica="m/1", model="m", state="ready", kv_endpoint=KV[0], kv_replay=KV[1])
    assert wire_fields._report(r.to_wire(), "r") == r and EngineReport.from_wire(r.to_wire()) == r
    bare = EngineReport(replica="m/1", model="m", state="ready")
    assert "kv_endpoint" not in bare.to_wire() and wire_fields._report(bare.to_wire(), "r") == bare
    with pytest.raises(wire_fields.WireProtocolError):
        wire_fields._report({**bare.to_wire(), "kv_endpoint": 5}, "r")



@pytest.mark.anyio
async def test_agent_launched_sim_publishes_block_stored_at_the_reported_endpoint(tmp_path, groups):  # noqa: F811
    h = Harness(tmp_path, groups)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    try:
        async with running(h):
            h.sup.apply([sim_spec(kv_events=True)])
            ready = await h.wait_for("ready")
            assert ready.kv_endpoint and ready.kv_endpoint.startswith(f"ipc://{tmp_path}/kv/")
            assert ready.kv_replay and ready.kv_replay.endswith(".replay")
            assert (tmp_path / "kv").stat().st_mode & 0o077 == 0
            sub.connect(ready.kv_endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv")
            stored: list[BlockStored] = []
            body = {"model": "m", "prompt": "hello " * 64, "max_tokens": 1}
            async with httpx.AsyncClient(timeout=10.0) as client:
                with trio.fail_after(20):
                    for _ in range(200):  # a SUB misses what was published before it joined: retry
                        assert (await client.post(ready.url + "/v1/completions", json=body)).status_code == 200
                        if await trio.to_thread.run_sync(sub.poll, 200):
                            topic, seq, payload = sub.recv_multipart()
                            assert topic == b"kv" and len(seq) == 8
                            stored = [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
                            if stored:
                                break
            assert stored and stored[0].block_hashes
    finally:
        sub.close()
        ctx.term()
