"""PrefixChains: hashes taken from a remembered chain are exactly the hashes of the new tokens
(checked against HashContext.hash_tokens on random conversations that share, diverge and grow),
only the new blocks are hashed, and the memory stays within its bounds."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.kv.hashing import HashContext, LoRA, event_hash
from llmgw.kv.prefix_chains import PrefixChains

CTX = HashContext.create("0.33.0", "sha256_cbor", 4, "0")


def want(tokens: list[int], lora: LoRA | None = None, salt: str | None = None) -> tuple[int, ...]:
    return tuple(event_hash(d) for d in CTX.hash_tokens(tokens, lora, salt))  # type: ignore[misc]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 30), st.integers(0, 40)), min_size=1, max_size=12),
       st.sampled_from([None, "s"]))
def test_always_exactly_the_hash_chain(steps: list[tuple[int, int, int]], salt: str | None) -> None:
    rng = random.Random(len(steps))
    pc = PrefixChains(max_chains=5, max_tokens=300, per_head=2)
    convs: list[list[int]] = [[1, 2, 3, 4, 5, 6, 7, 8] for _ in range(4)]  # a shared "system prompt"
    for conv, keep, grow in steps:
        toks = convs[conv][:len(convs[conv]) - min(keep, len(convs[conv]))] if keep % 3 == 0 else convs[conv]
        toks = toks + [rng.randrange(3) for _ in range(grow)]
        convs[conv] = toks
        assert pc.hashes(CTX, toks, None, salt) == want(toks, None, salt)
        assert pc.chains <= 5 and pc.tokens <= 300
        assert all(len(g) <= 2 for g in pc.groups.values())


def test_a_growing_conversation_hashes_each_block_once() -> None:
    pc = PrefixChains()
    toks: list[int] = []
    for turn in range(10):
        toks = toks + list(range(turn * 100, turn * 100 + 37))
        assert pc.hashes(CTX, toks) == want(toks)
    assert pc.hashed_blocks == len(toks) // 4 and pc.chains == 1  # one chain, extended each turn
    assert pc.hashes(CTX, toks[:50]) == want(toks[:50])  # an earlier head: nothing to hash
    assert pc.hashed_blocks == len(toks) // 4


def test_lora_salt_and_context_partition_the_chains() -> None:
    pc = PrefixChains()
    toks = list(range(40))
    lora = LoRA("a", None, "/p")
    assert pc.hashes(CTX, toks) == want(toks)
    assert pc.hashes(CTX, toks, lora) == want(toks, lora)
    assert pc.hashes(CTX, toks, None, "salt") == want(toks, None, "salt")
    other = HashContext.create("0.33.0", "sha256_cbor", 4, "1")  # another PYTHONHASHSEED
    assert pc.hashes(other, toks) == tuple(event_hash(d) for d in other.hash_tokens(toks))  # type: ignore[misc]
    assert pc.reused_blocks == 0 and len(pc.groups) == 4


def test_short_prompts_and_oversized_chains() -> None:
    pc = PrefixChains(max_tokens=16)
    assert pc.hashes(CTX, [1, 2, 3]) == () and pc.chains == 0
    big = list(range(40))
    assert pc.hashes(CTX, big) == want(big) and pc.chains == 0  # too big to keep, still hashed
