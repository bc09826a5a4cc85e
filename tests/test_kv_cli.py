"""`llmgw kv hash` and `llmgw kv decode` against vLLM's golden vectors (vllm-golden.json), their
JSON shape and their error paths (one line naming the flag, exit 1, no traceback)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from llmgw.cli import entry as cli
from llmgw.cli import kv as kv_cli
from llmgw.fleet.engine_cmd import KV_HASH_ALGO, KV_HASH_SEED, build_env, kv_events_args
from llmgw.fleet.types import EngineSpec
from llmgw.kv import events

from .conftest import load_golden

GOLDEN = load_golden()
VERSIONS = GOLDEN["versions"]

CASES = [pytest.param(ver, algo, case, id=f"{ver}-{algo}-{case['name']}")
         for ver, vd in VERSIONS.items() for algo, hd in vd["hashing"].items() for case in hd["cases"]]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["kv", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def hash_args(ver: str, algo: str, case: dict[str, Any], *extra: str) -> list[str]:
    vd = VERSIONS[ver]
    args = ["hash", "--tokens", ",".join(map(str, case["prompt_token_ids"])), "--vllm-version", ver,
            "--algo", algo, "--seed", vd["PYTHONHASHSEED"], "--block-size", str(vd["block_size"]), *extra]
    lr = case["lora_request"]
    if lr:
        args += ["--lora", f"{lr['lora_name']}:{lr['lora_int_id']}"]
        if lr["lora_path"]:
            args += ["--lora-path", lr["lora_path"]]
    if case["cache_salt"] is not None:
        args += ["--cache-salt", case["cache_salt"]]
    return args


# --------------------------------------------------------------------------- hash

@pytest.mark.parametrize("ver,algo,case", CASES)
def test_hash_chain_equals_vllms(capsys: pytest.CaptureFixture[str], ver: str, algo: str,
                                 case: dict[str, Any]) -> None:
    code, out, err = run(capsys, *hash_args(ver, algo, case, "-o", "json"))
    assert code == 0, err
    doc = json.loads(out)
    assert [b["hash"] for b in doc["blocks"]] == [b["event_int64"] for b in case["blocks"]]
    assert [b["digest"] for b in doc["blocks"]] == [b["hash_hex"] for b in case["blocks"]]
    assert doc["none_hash"] == VERSIONS[ver]["hashing"][algo]["none_hash_hex"]
    code, out, _ = run(capsys, *hash_args(ver, algo, case, "--hash-form", "bytes", "-o", "json"))
    assert [b["hash"] for b in json.loads(out)["blocks"]] == [b["hash_hex"] for b in case["blocks"]]


def test_hash_table_and_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    case = VERSIONS["0.33.0"]["hashing"]["sha256_cbor"]["cases"][0]
    tokens = case["prompt_token_ids"] + [7, 8]  # a partial tail is not hashed
    args = ["hash", "--tokens", " ".join(map(str, tokens))]  # the defaults: sha256_cbor, PYTHONHASHSEED=0
    code, out, _ = run(capsys, *args)
    lines = out.splitlines()
    assert code == 0 and "2 left over" in lines[0] and "sha256_cbor, PYTHONHASHSEED=0," in lines[0] and lines[1].split() == ["BLOCK", "TOKENS", "EVENT", "HASH"]
    assert lines[2].split() == ["0", "0-15", str(case["blocks"][0]["event_int64"])]
    code, out, _ = run(capsys, *args, "-o", "json")
    doc = json.loads(out)
    assert set(doc) == {"vllm_version", "algo", "seed", "block_size", "hash_form", "none_hash", "tokens",
                        "partial_tokens", "blocks"}
    assert (doc["vllm_version"], doc["tokens"], doc["partial_tokens"]) == ("0.33.0", len(tokens), 2)
    assert doc["blocks"][1] == {"index": 1, "start": 16, "end": 31, "hash": case["blocks"][1]["event_int64"],
                                "digest": case["blocks"][1]["hash_hex"]}


def test_hash_no_seed_is_vllms_fixed_one(capsys: pytest.CaptureFixture[str]) -> None:
    """0.29+ with sha256* and PYTHONHASHSEED unset: NONE_HASH is hash("vllm-none-hash")."""
    unset = VERSIONS["0.33.0"]["none_hash_when_PYTHONHASHSEED_unset"]["sha256_cbor"]
    code, out, _ = run(capsys, "hash", "--tokens", "1", "--no-seed", "-o", "json")
    assert code == 0 and json.loads(out)["none_hash"] == unset["none_hash_hex"]
    assert json.loads(out)["blocks"] == []


def test_hash_tokens_from_a_file_and_stdin(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    case = VERSIONS["0.33.0"]["hashing"]["sha256_cbor"]["cases"][0]
    f = tmp_path / "tokens.json"
    f.write_text(json.dumps(case["prompt_token_ids"]) + "\n")
    want = [b["event_int64"] for b in case["blocks"]]
    code, out, _ = run(capsys, "hash", "--tokens-file", str(f), "--seed", "0", "-o", "json")
    assert code == 0 and [b["hash"] for b in json.loads(out)["blocks"]] == want
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(f.read_bytes())))
    code, out, _ = run(capsys, "hash", "--tokens-file", "-", "--seed", "0", "-o", "json")
    assert code == 0 and [b["hash"] for b in json.loads(out)["blocks"]] == want


@pytest.mark.parametrize("args,message", [
    (["--tokens", "1,x,3"], "--tokens: token 1 is 'x'"),
    (["--tokens", "1,-2"], "--tokens: token 1 is '-2'"),
    (["--tokens", "99999999999999999999"], "--tokens: token 0"),
    (["--tokens", " , "], "--tokens: no token ids"),
    (["--tokens", "1", "--vllm-version", "latest"], "--vllm-version: 'latest' is not a version"),
    (["--tokens", "1", "--vllm-version", "0.10.1", "--seed", "0"], "--algo/--vllm-version: vLLM 0.10.1 used int"),
    (["--tokens", "1", "--vllm-version", "0.12.0", "--algo", "xxhash", "--seed", "0"],
     "--algo/--vllm-version: vLLM 0.12.0 has no prefix-caching hash algo 'xxhash'"),
    (["--tokens", "1", "--vllm-version", "0.28.0", "--algo", "sha256", "--no-seed"],
     "--no-seed: vLLM 0.28.0 with --algo sha256 draws"),
    (["--tokens", "1", "--algo", "xxhash_cbor", "--no-seed"], "--no-seed: vLLM 0.33.0 with --algo xxhash_cbor"),
    (["--tokens", "1", "--block-size", "0", "--seed", "0"], "--block-size: 0 is not from 1"),
    (["--tokens", "1", "--lora", "sql", "--seed", "0"], "--lora-path: vLLM 0.33.0 hashes the adapter's"),
    (["--tokens", "1", "--lora", "sql", "--vllm-version", "0.11.0", "--seed", "0"], "--lora: vLLM 0.11.0 hashes"),
    (["--tokens", "1", "--lora", "sql:one", "--seed", "0"], "--lora: the id in 'sql:one'"),
    (["--tokens", "1", "--lora", ":1", "--seed", "0"], "--lora: ':1' has no adapter name"),
    (["--tokens", "1", "--lora-path", "/a", "--seed", "0"], "--lora-path: needs --lora"),
    (["--tokens-file", "/nonexistent/tokens"], "--tokens-file: cannot read /nonexistent/tokens"),
])
def test_hash_bad_input_names_the_flag(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, out, err = run(capsys, "hash", *args)
    assert (code, out) == (1, "")
    assert err.startswith(f"llmgw kv hash: {message}") and err.count("\n") == 1, err


def test_hash_bad_token_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "t"
    f.write_bytes(b"\xff\xfe1,2")
    assert run(capsys, "hash", "--tokens-file", str(f))[2].startswith(f"llmgw kv hash: --tokens-file: {f} is not text")
    monkeypatch.setattr("llmgw.cli.kv.MAX_INPUT_BYTES", 8)
    f.write_text("1," * 10)
    assert "is larger than 8 bytes" in run(capsys, "hash", "--tokens-file", str(f))[2]


def test_hash_needs_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["kv", "hash"])
    assert e.value.code == 2 and "--tokens" in capsys.readouterr().err


# --------------------------------------------------------------------------- decode

GOLDEN_33 = VERSIONS["0.33.0"]["kv_events"]
MIXED = GOLDEN_33["mixed_all_bytes_hashes"]


@pytest.mark.parametrize("ver", list(VERSIONS))
def test_decode_golden_payloads(capsys: pytest.CaptureFixture[str], ver: str) -> None:
    for b in VERSIONS[ver]["kv_events"]["batches"]:
        code, out, err = run(capsys, "decode", b["msgpack_hex"], "-o", "json")
        assert code == 0, err
        doc = json.loads(out)
        want = events.decode_batch(bytes.fromhex(b["msgpack_hex"]))
        assert (doc["ts"], doc["data_parallel_rank"]) == (b["ts"], b["data_parallel_rank"])
        assert [e["type"] for e in doc["events"]] == [type(e).__name__ for e in want.events]


def test_decode_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "decode", MIXED["msgpack_hex"])
    lines = out.splitlines()
    assert code == 0 and lines[0] == "ts 1700000003.0  data_parallel_rank 0  6 event(s)"
    assert lines[1].startswith('  [0] BlockStored 3 block(s) hashes=["202da172')
    assert "parent=null  tokens=48  block_size=16  medium=\"GPU\"" in lines[1]
    assert 'lora="sql-lora" (id 1)' in lines[2] and 'extra_keys=[["sql-lora", "tenant-a"]]' in lines[2]
    assert lines[3].startswith('  [2] BlockRemoved 1 block(s) hashes=["202da172') and 'medium="GPU"' in lines[3]
    assert lines[6] == "  [5] AllBlocksCleared"


def test_decode_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "decode", MIXED["msgpack_hex"], "-o", "json")
    doc = json.loads(out)
    assert code == 0 and set(doc) == {"ts", "data_parallel_rank", "events"}
    stored = doc["events"][0]
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert stored["block_hashes"][0].startswith("202da172") and stored["token_ids"] == list(range(1, 49))
    assert doc["events"][5] == {"type": "AllBlocksCleared"}


def test_decode_from_file_stdin_and_frames(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    payload = bytes.fromhex(MIXED["msgpack_hex"])
    want = run(capsys, "decode", MIXED["msgpack_hex"])[1]
    f = tmp_path / "payload.bin"
    f.write_bytes(payload)
    assert run(capsys, "decode", "--file", str(f))[1] == want
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(MIXED["msgpack_hex"].encode() + b"\n")))
    assert run(capsys, "decode", "-")[1] == want
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(payload)))
    assert run(capsys, "decode", "--file", "-")[1] == want
    topic, seq, _ = events.pub_frames("kv@test", 7, payload)
    code, out, _ = run(capsys, "decode", topic.hex(), seq.hex(), payload.hex())
    assert code == 0 and out == "topic 'kv@test'  seq 7  " + want
    code, out, _ = run(capsys, "decode", topic.hex(), seq.hex(), payload.hex(), "-o", "json")
    assert json.loads(out)["topic"] == "kv@test" and json.loads(out)["seq"] == 7


def test_decode_shows_unknown_events_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown tag is shown, not hidden; a string from the wire can't drive the terminal."""
    payload = msgpack.packb([1.5, [{"type": "Moved\x1b[2J", "to": "\u202eCPU"}], None])
    code, out, _ = run(capsys, "decode", payload.hex())
    assert code == 0 and "\x1b" not in out and "\u202e" not in out
    assert 'unknown event "Moved\\u001b[2J"' in out.splitlines()[1]
    doc = json.loads(run(capsys, "decode", payload.hex(), "-o", "json")[1])
    assert doc["events"] == [{"type": "Moved\x1b[2J", "unknown": True,
                              "raw": {"type": "Moved\x1b[2J", "to": "\u202eCPU"}}]


@pytest.mark.parametrize("args,message", [
    (["zz"], "HEX: not hex"),
    (["c1"], "not a KV event batch (1 bytes): not a msgpack document"),
    ([msgpack.packb({"a": 1}).hex()], "not a KV event batch (4 bytes): bad batch"),
    ([msgpack.packb([1.0, [["BlockStored", "x"]], None]).hex()], "not a KV event batch"),
    (["00", "01"], "expected one HEX payload, or three"),
    ([], "expected one HEX payload, or three"),
    (["6b76", "01", "90"], "frames: expected [topic, seq8, payload]"),
    (["90", "--file", "x"], "give the payload either as HEX or with --file"),
    (["--file", "/nonexistent/p"], "--file: cannot read /nonexistent/p"),
])
def test_decode_garbage_is_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, out, err = run(capsys, "decode", *args)
    assert (code, out) == (1, "")
    assert err.startswith(f"llmgw kv decode: {message}") and err.count("\n") == 1, err


def test_decode_garbage_in_a_real_process() -> None:
    """The installed command: exit 1, one line, no traceback."""
    r = subprocess.run([sys.executable, "-m", "llmgw", "kv", "decode", "93c0"], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith("llmgw kv decode: not a KV event batch")


# -- llmgw kv watch, against a real publisher ------------------------------------------------------
def test_watch_prints_a_live_simulators_events(sim_factory: Any) -> None:
    # "*": the publisher binds (an OS-chosen port, resolved in its ready line), as vLLM does
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0", "topic": "kv"}
    s = sim_factory(["--engine", "vllm", "sim-model", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost",
                     "--prefix-caching-hash-algo", "sha256_cbor", "--kv-events-config", json.dumps(cfg)])
    w = subprocess.Popen([sys.executable, "-m", "llmgw", "kv", "watch", s.info["kv_events"], "--count", "1",
                          "--seconds", "30", "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # A SUB socket misses what was published before it joined: send until the watcher has one batch.
        for i in range(200):
            httpx.post(f"{s.url}/v1/completions", timeout=10,
                       json={"model": "sim-model", "prompt": f"watch me {i} " * 20, "max_tokens": 1})
            try:
                out, err = w.communicate(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            raise AssertionError("the watcher printed nothing")
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    assert w.returncode == 0, err
    doc = json.loads(out.decode().splitlines()[0])
    assert doc["topic"] == "kv" and isinstance(doc["seq"], int)
    assert any(e["type"] == "BlockStored" for e in doc["events"])


def test_hash_defaults_are_what_tier2_engines_are_launched_with(sim_factory: Any) -> None:
    """Issue 21 item 20: `llmgw kv hash` with no --algo/--seed reproduces the hashes of an engine
    launched as the agent launches a kv_events vLLM (its flags and environment, from
    llmgw.fleet.engine_cmd): here a simulated one, its events read with `llmgw kv watch`."""
    spec = EngineSpec(replica="m/1", model="sim-model", engine="vllm", model_path="sim-model", simulate=True,
                      kv_events=True)
    env = build_env(spec, {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"})
    s = sim_factory(["--engine", "vllm", "sim-model", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost",
                     *kv_events_args("tcp://*:0", "tcp://*:0")], env=env)
    w = subprocess.Popen([sys.executable, "-m", "llmgw", "kv", "watch", s.info["kv_events"], "--count", "1",
                          "--seconds", "30", "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for i in range(200):  # until the watcher (a SUB: it misses what came before it joined) has a batch
            httpx.post(f"{s.url}/v1/completions", timeout=10,
                       json={"model": "sim-model", "prompt": f"hash me {i} " * 20, "max_tokens": 1})
            try:
                out, err = w.communicate(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            raise AssertionError("the watcher printed nothing")
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
    assert w.returncode == 0, err
    stored = [e for e in json.loads(out.decode().splitlines()[0])["events"]
              if e["type"] == "BlockStored" and e["parent_block_hash"] is None]
    assert stored, out
    ev = stored[0]
    r = subprocess.run([sys.executable, "-m", "llmgw", "kv", "hash", "--tokens", ",".join(map(str, ev["token_ids"])),
                        "--block-size", str(ev["block_size"]), "-o", "json"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["algo"], doc.get("seed")) == (KV_HASH_ALGO, KV_HASH_SEED)
    assert [b["hash"] for b in doc["blocks"]] == ev["block_hashes"]


def test_watch_refuses_a_bad_endpoint(capsys: Any) -> None:
    assert kv_cli.main(["watch", "http://x:1"]) == 1
    assert "ENDPOINT: expected tcp://" in capsys.readouterr().err
