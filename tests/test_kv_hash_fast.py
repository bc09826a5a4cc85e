"""The hand-written CBOR chain (``HashContext.chain``'s fast path for ``*_cbor`` algorithms) gives
exactly the digests of vLLM's definition, ``hash_fn((parent, tuple(block), extra_keys))`` with
``cbor2.dumps(..., canonical=True)``, for every token width, block size, LoRA and salt era, and
for a chain resumed in the middle (the router's cache by token prefix)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kv.hashing import HashContext, LoRA, block_extra_keys, hash_block_tokens

# every CBOR uint width and its edges
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 151644, (1 << 32) - 1, 1 << 32, (1 << 64) - 1]
LORA = LoRA("sql-lora", 1, "/adapters/sql-lora")


def reference(ctx: HashContext, tokens: list[int], lora: LoRA | None, salt: str | None) -> list[bytes]:
    """vLLM's loop, one generic ``hash_block_tokens`` call per block (no fast path)."""
    bs, out, parent = ctx.block_size, [], None
    for i in range(len(tokens) // bs):
        keys = block_extra_keys(ctx.version, lora, salt, i * bs)
        parent = hash_block_tokens(ctx.hash_fn, parent, tokens[i * bs:(i + 1) * bs], keys,
                                   none_hash=ctx.none_hash)
        out.append(parent)
    return out


# (version, algo): every algo each release has (xxhash_cbor only from 0.13)
_ERAS = [(v, a) for v in ("0.11.0", "0.23.0", "0.33.0") for a in ("sha256_cbor", "xxhash_cbor", "sha256")
         if not (a == "xxhash_cbor" and v == "0.11.0")]


@pytest.mark.parametrize(("version", "algo"), _ERAS)
@pytest.mark.parametrize("extra", ["plain", "salt", "lora", "lora+salt"])
def test_fast_chain_equals_the_definition(version: str, algo: str, extra: str) -> None:
    ctx = HashContext.create(version, algo, 4, "0")
    lora = LORA if "lora" in extra else None
    salt = "tenant-a" if "salt" in extra else None
    tokens = EDGES + list(range(20)) + EDGES[::-1]
    assert ctx.hash_tokens(tokens, lora, salt) == reference(ctx, tokens, lora, salt)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(EDGES) | st.integers(0, (1 << 64) - 1), max_size=80),
       st.sampled_from([1, 3, 16, 23, 24, 300]), st.integers(0, 6), st.booleans())
def test_any_tokens_any_block_size_and_a_resumed_chain(tokens: list[int], bs: int, cut: int, salted: bool) -> None:
    ctx = HashContext.create("0.33.0", "sha256_cbor", bs, "0")
    salt = "s" if salted else None
    whole = ctx.hash_tokens(tokens, None, salt)
    assert whole == reference(ctx, tokens, None, salt)
    cut = min(cut, len(whole))
    if cut:  # resume after `cut` blocks, as the router does from a cached token prefix
        assert whole[:cut] + ctx.chain(whole[cut - 1], tokens[cut * bs:], cut, None, salt) == whole


def test_a_token_the_fast_path_cannot_write_goes_the_generic_way() -> None:
    ctx = HashContext.create("0.33.0", "sha256_cbor", 2, "0")
    tokens: list[Any] = [-1, 5, 7, 1 << 70]  # cbor2 writes these (a negative int, a bignum)
    assert ctx.hash_tokens(tokens) == reference(ctx, tokens, None, None)


def test_a_chain_after_block_0_needs_its_parent() -> None:
    ctx = HashContext.create("0.33.0", "sha256_cbor", 2, "0")
    with pytest.raises(ValueError, match="parent"):
        ctx.chain(None, [1, 2], 3)
