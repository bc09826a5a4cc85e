"""llmgw.kv.hashing against vLLM's own golden vectors (vllm-golden.json)."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import cbor2
import pytest
from hypothesis import given, strategies as st

from llmgw.kv.hashing import (
    BlockHasher, HashContext, LoRA, VllmVersion, as_version, block_extra_keys,
    event_extra_keys, event_hash, get_hash_fn, hash_block_tokens, none_hash,
    supported_algos, to_event_extra_keys,
)

from .conftest import load_golden

GOLDEN = load_golden()
VERSIONS = GOLDEN["versions"]

CASES = [
    pytest.param(ver, algo, case, id=f"{ver}-{algo}-{case['name']}")
    for ver, vd in VERSIONS.items()
    for algo, hd in vd["hashing"].items()
    for case in hd["cases"]
]


def _lora(case: dict[str, Any]) -> LoRA | None:
    lr = case["lora_request"]
    return LoRA(lr["lora_name"], lr["lora_int_id"], lr["lora_path"]) if lr else None


def _jsonish(x: Any) -> Any:
    """Tuples as the golden JSON shows them (lists)."""
    return [_jsonish(i) for i in x] if isinstance(x, (tuple, list)) else x


@pytest.mark.parametrize("ver,algo", [(v, a) for v, vd in VERSIONS.items() for a in vd["hashing"]])
def test_none_hash_with_seed(ver: str, algo: str) -> None:
    hd = VERSIONS[ver]["hashing"][algo]
    got = none_hash(algo, hd["none_hash_seed_used"], ver)
    assert got.hex() == hd["none_hash_hex"]
    assert HashContext.create(ver, algo, 16, "0").none_hash.hex() == hd["none_hash_hex"]


@pytest.mark.parametrize("ver,algo,case", CASES)
def test_golden_chain(ver: str, algo: str, case: dict[str, Any]) -> None:
    vd = VERSIONS[ver]
    ctx = HashContext.create(ver, algo, vd["block_size"], vd["PYTHONHASHSEED"])
    hasher = BlockHasher(ctx, _lora(case), case["cache_salt"])
    digests = hasher.extend(case["prompt_token_ids"])
    blocks = case["blocks"]
    assert len(digests) == case["num_full_blocks"] == len(blocks)
    for digest, keys, b in zip(digests, hasher.extra_keys, blocks):
        assert digest.hex() == b["hash_hex"], f"block {b['index']}"
        assert event_hash(digest) == b["event_int64"]
        assert event_hash(digest, use_int=False) == digest
        assert _jsonish(keys) == b["extra_keys_hashed"]
        # The exact serialized input, not just the digest:
        parent = bytes.fromhex(b["parent_hash_hex"]) if b["parent_hash_hex"] else ctx.none_hash
        hashed = (parent, tuple(b["token_ids"]), keys)
        if "cbor_input_hex" in b:
            assert cbor2.dumps(hashed, canonical=True).hex() == b["cbor_input_hex"]
        if "pickle_input_hex" in b:
            # Our interpreter's pickle must reproduce vLLM's (Python 3.11.7) bytes.
            assert pickle.dumps(hashed, protocol=pickle.HIGHEST_PROTOCOL).hex() == b["pickle_input_hex"]
        # The stand-alone function agrees with the chain.
        parent_arg = bytes.fromhex(b["parent_hash_hex"]) if b["parent_hash_hex"] else None
        assert hash_block_tokens(ctx.hash_fn, parent_arg, b["token_ids"], keys,
                                 none_hash=ctx.none_hash) == digest


@pytest.mark.parametrize("ver,algo,case", CASES)
def test_incremental_equals_batch(ver: str, algo: str, case: dict[str, Any]) -> None:
    ctx = HashContext.create(ver, algo, 16, "0")
    whole = ctx.hash_tokens(case["prompt_token_ids"], _lora(case), case["cache_salt"])
    h = ctx.hasher(_lora(case), case["cache_salt"])
    got: list[bytes] = []
    toks = case["prompt_token_ids"]
    for i in range(0, len(toks), 5):  # chunks that straddle block boundaries
        got += h.extend(toks[i:i + 5])
    assert got == whole == h.block_hashes
    assert h.num_tokens == len(toks)


def test_unset_seed_deterministic_since_0_29() -> None:
    unset = VERSIONS["0.33.0"]["none_hash_when_PYTHONHASHSEED_unset"]["sha256_cbor"]
    assert unset["seed_used"] == "vllm-none-hash"

    def no_randomness(n: int) -> bytes:
        raise AssertionError("must not use randomness")

    for ver in ("0.29.0", "0.30.0", "0.33.0"):
        assert none_hash("sha256_cbor", None, ver, urandom=no_randomness).hex() == unset["none_hash_hex"]
        assert none_hash("sha256", None, ver, urandom=no_randomness) == get_hash_fn("sha256")("vllm-none-hash")


def test_unset_seed_random_cases() -> None:
    for ver in ("0.11.0", "0.23.0"):  # golden: random per process before 0.29
        assert VERSIONS[ver]["none_hash_when_PYTHONHASHSEED_unset"]["sha256_cbor"]["seed_used"] == "random"
    fake = bytes(range(32))
    # before 0.29: the random bytes themselves, for every algo
    for algo in ("sha256", "sha256_cbor"):
        assert none_hash(algo, None, "0.28.0", urandom=lambda n: fake[:n]) == fake
    assert none_hash("xxhash_cbor", None, "0.20.0", urandom=lambda n: fake[:n]) == fake
    # 0.29+ xxhash*: hash of the random bytes' hex string
    for algo in ("xxhash", "xxhash_cbor"):
        assert none_hash(algo, None, "0.33.0", urandom=lambda n: fake[:n]) == get_hash_fn(algo)(fake.hex())
    # the default source really is random
    assert none_hash("sha256_cbor", None, "0.23.0") != none_hash("sha256_cbor", None, "0.23.0")
    assert HashContext.create("0.11.0", "sha256_cbor", 16, None, urandom=lambda n: fake).none_hash == fake


def test_seed_is_a_string_even_when_empty() -> None:
    fn = get_hash_fn("sha256_cbor")
    assert none_hash("sha256_cbor", "", "0.33.0") == fn("")
    assert none_hash("sha256_cbor", "0", "0.11.0") == fn("0") != fn(0)


def test_extra_keys_per_era() -> None:
    lora = LoRA("sql-lora", 1, "/adapters/sql-lora")
    assert block_extra_keys("0.11.0", lora, "s", 0) == (1, "s")
    assert block_extra_keys("0.11.0", lora, "s", 16) == (1,)
    assert block_extra_keys("0.12.0", lora, "s", 0) == ("sql-lora", "s")
    assert block_extra_keys("0.30.9", None, "s", 0) == ("s",)
    assert block_extra_keys("0.31.0", lora, "s", 0) == (("lora", "sql-lora", "/adapters/sql-lora"),
                                                        ("cache_salt", "s"))
    assert block_extra_keys("0.33.0", None, "s", 32) is None
    assert block_extra_keys("0.33.0", None, "", 0) is None  # empty salt is falsy in vLLM
    with pytest.raises(ValueError, match="int id"):
        block_extra_keys("0.11.0", LoRA("x"), None, 0)
    with pytest.raises(ValueError, match="path"):
        block_extra_keys("0.31.0", LoRA("x", 3), None, 0)
    assert block_extra_keys("0.23.0", LoRA("x"), None, 0) == ("x",)  # name era needs nothing else


def test_event_extra_keys() -> None:
    tagged = (("lora", "sql-lora", "/adapters/sql-lora"), ("cache_salt", "tenant-a"))
    assert to_event_extra_keys(tagged, "0.33.0") == ("sql-lora", "tenant-a")  # path dropped
    assert to_event_extra_keys((("mm", "abc", 3),), "0.31.0") == (("abc", 3),)
    assert to_event_extra_keys(("sql-lora", "tenant-a"), "0.23.0") == ("sql-lora", "tenant-a")
    assert to_event_extra_keys(None, "0.33.0") is None
    assert event_extra_keys("0.16.0", [None, None]) is None  # field absent before 0.17
    assert event_extra_keys("0.17.0", [None, None]) == [None, None]
    assert event_extra_keys("0.33.0", [tagged, None]) == [("sql-lora", "tenant-a"), None]


def test_versions() -> None:
    assert as_version("0.33.0") == VllmVersion(0, 33, 0) == (0, 33, 0)
    assert as_version("v0.11") == (0, 11, 0)
    assert as_version("0.10.1.1") == (0, 10, 1)
    assert as_version("0.24.0rc2+cu128") == (0, 24, 0)
    assert as_version((0, 9)) < as_version("0.10.2") < as_version("0.33.0")
    assert str(as_version("0.9")) == "0.9.0"
    with pytest.raises(ValueError):
        as_version("latest")


def test_algo_validation() -> None:
    assert supported_algos("0.10.1") == ()
    assert supported_algos("0.12.0") == ("sha256", "sha256_cbor")
    assert "xxhash" in supported_algos("0.13.0")
    with pytest.raises(ValueError, match="xxhash"):
        HashContext.create("0.12.0", "xxhash", 16, "0")
    with pytest.raises(ValueError):
        HashContext.create("0.10.1", "sha256", 16, "0")  # int-hash era: not supported
    with pytest.raises(ValueError, match="unknown"):
        get_hash_fn("builtin")
    with pytest.raises(ValueError):
        HashContext.create("0.33.0", "sha256", 0, "0")
    with pytest.raises(ValueError, match="none_hash"):
        hash_block_tokens(get_hash_fn("sha256"), None, [1])


def test_hash_fn_definitions() -> None:
    x = (b"\x01" * 32, (1, 2, 3), None)
    assert get_hash_fn("sha256")(x) == hashlib.sha256(pickle.dumps(x, protocol=5)).digest()
    assert get_hash_fn("sha256_cbor")(x) == hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()
    assert len(get_hash_fn("xxhash")(x)) == len(get_hash_fn("xxhash_cbor")(x)) == 16


def test_missing_xxhash_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import llmgw.kv.hashing as hashing
    monkeypatch.setattr(hashing, "_xxhash_mod", None)
    monkeypatch.setitem(sys.modules, "xxhash", None)  # makes `import xxhash` fail
    with pytest.raises(ImportError, match="'xxhash' package"):
        get_hash_fn("xxhash_cbor")
    get_hash_fn("sha256_cbor")  # unaffected


@given(st.binary(min_size=8, max_size=32))
def test_event_hash_is_low_64_bits(digest: bytes) -> None:
    assert event_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert 0 <= event_hash(digest) < 2**64


@given(st.lists(st.integers(0, 2**31 - 1), max_size=80), st.integers(1, 40))
def test_chunking_never_changes_the_chain(tokens: list[int], cut: int) -> None:
    ctx = HashContext.create("0.33.0", "sha256_cbor", 8, "0")
    h = ctx.hasher(cache_salt="t")
    got = h.extend(tokens[:cut]) + h.extend(tokens[cut:])
    assert got == ctx.hash_tokens(tokens, cache_salt="t")
    assert len(got) == len(tokens) // 8
