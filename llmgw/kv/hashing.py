"""vLLM prefix-cache block hashing, reproduced bit for bit (pure: no I/O).

Spec: the shared vLLM wire notes (vllm-wire.md) §2. A block's hash is
``hash_fn((parent_digest or NONE_HASH, tuple(tokens), extra_keys))``; only full
blocks are hashed, each chained to the previous one. Every behaviour that
changed across releases is derived from a :class:`VllmVersion`, so the engine
simulator can impersonate any release from 0.10.2 on and the router can follow
whatever version a real engine runs.
"""

from __future__ import annotations

import hashlib
import pickle
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

import cbor2

__all__ = [
    "VllmVersion", "VersionLike", "as_version",
    "HashFn", "HASH_ALGOS", "get_hash_fn", "supported_algos",
    "sha256", "sha256_cbor", "xxhash", "xxhash_cbor",
    "DEFAULT_NONE_HASH_SEED", "none_hash", "hash_block_tokens",
    "LoRA", "block_extra_keys", "to_event_extra_keys", "event_extra_keys",
    "HashContext", "BlockHasher", "event_hash",
]


# --------------------------------------------------------------------------- versions

class VllmVersion(NamedTuple):
    """A vLLM release as a comparable tuple, e.g. ``VllmVersion(0, 33, 0)``."""

    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> VllmVersion:
        # Suffixes ("rc1", "+cu128", a 4th component) never changed wire behaviour.
        m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
        if not m:
            raise ValueError(f"not a vLLM version: {text!r}")
        return cls(int(m[1]), int(m[2]), int(m[3] or 0))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


VersionLike = VllmVersion | tuple[int, ...] | str


def as_version(v: VersionLike) -> VllmVersion:
    if isinstance(v, VllmVersion):
        return v
    if isinstance(v, str):
        return VllmVersion.parse(v)
    return VllmVersion(*v)


# Release boundaries (first released wheel with the change, per the spec).
BYTES_HASHES_SINCE = VllmVersion(0, 10, 2)  # BlockHash became raw digest bytes; int era unsupported
XXHASH_SINCE = VllmVersion(0, 13, 0)  # xxhash / xxhash_cbor choices added
LORA_NAME_KEY_SINCE = VllmVersion(0, 12, 0)  # LoRA extra key: lora_int_id -> lora_name
EVENT_EXTRA_KEYS_SINCE = VllmVersion(0, 17, 0)  # BlockStored.extra_keys field appears
FIXED_NONE_SEED_SINCE = VllmVersion(0, 29, 0)  # unset PYTHONHASHSEED -> "vllm-none-hash" (sha256*)
TAGGED_KEYS_SINCE = VllmVersion(0, 31, 0)  # ("lora", name, path), ("cache_salt", salt)


# --------------------------------------------------------------------------- hash functions

HashFn = Callable[[Any], bytes]

# == pickle.HIGHEST_PROTOCOL on every CPython vLLM runs on; pinned so our digests
# don't depend on the interpreter running the gateway.
_PICKLE_PROTOCOL = 5


def sha256(x: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(x, protocol=_PICKLE_PROTOCOL)).digest()


def sha256_cbor(x: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


_xxhash_mod: ModuleType | None = None


def _xxhash_module() -> ModuleType:
    # Optional dependency: only vLLM's xxhash* algorithms need it.
    global _xxhash_mod
    if _xxhash_mod is None:
        try:
            import xxhash as mod
        except ImportError as e:
            raise ImportError(
                "prefix-caching hash algo 'xxhash'/'xxhash_cbor' needs the 'xxhash' "
                "package (pip install 'llmgw[xxhash]' or pip install xxhash)"
            ) from e
        _xxhash_mod = mod
    return _xxhash_mod


def xxhash(x: Any) -> bytes:
    return _xxhash_module().xxh3_128_digest(pickle.dumps(x, protocol=_PICKLE_PROTOCOL))


def xxhash_cbor(x: Any) -> bytes:
    return _xxhash_module().xxh3_128_digest(cbor2.dumps(x, canonical=True))


HASH_ALGOS: dict[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash,
    "xxhash_cbor": xxhash_cbor,
}


def get_hash_fn(name: str) -> HashFn:
    """vLLM's ``get_hash_fn_by_name``. Fails early if xxhash is needed but missing."""
    try:
        fn = HASH_ALGOS[name]
    except KeyError:
        raise ValueError(f"unknown prefix-caching hash algo {name!r}; "
                         f"expected one of {sorted(HASH_ALGOS)}") from None
    if name.startswith("xxhash"):
        _xxhash_module()
    return fn


def supported_algos(version: VersionLike) -> tuple[str, ...]:
    """``--prefix-caching-hash-algo`` choices of a release (0.10.0/0.10.1 unsupported)."""
    v = as_version(version)
    if v < BYTES_HASHES_SINCE:
        return ()
    if v < XXHASH_SINCE:
        return ("sha256", "sha256_cbor")
    return ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


# --------------------------------------------------------------------------- NONE_HASH

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def none_hash(algo: str, pythonhashseed: str | None, version: VersionLike,
              *, urandom: Callable[[int], bytes] = secrets.token_bytes) -> bytes:
    """The parent digest of block 0 (vLLM's ``init_none_hash``).

    ``pythonhashseed`` is the raw env value; only ``None`` means unset (vLLM uses
    ``os.getenv``, so an empty string is a seed). ``urandom`` is injectable so the
    per-process random cases stay testable (the default, ``secrets.token_bytes``, is
    ``os.urandom``).
    """
    v = as_version(version)
    hash_fn = get_hash_fn(algo)
    if pythonhashseed is not None:
        return hash_fn(pythonhashseed)  # the *string* value, not an int
    if v >= FIXED_NONE_SEED_SINCE:
        if algo in ("sha256", "sha256_cbor"):
            return hash_fn(DEFAULT_NONE_HASH_SEED)
        return hash_fn(urandom(32).hex())
    return urandom(32)  # before 0.29 the random bytes are used as-is, unhashed


# --------------------------------------------------------------------------- one block

def hash_block_tokens(hash_fn: HashFn, parent: bytes | None, tokens: Sequence[int],
                      extra_keys: tuple[Any, ...] | None = None,
                      *, none_hash: bytes | None = None) -> bytes:
    """Digest of one block; a falsy ``parent`` means block 0 (uses ``none_hash``)."""
    if not parent:
        if none_hash is None:
            raise ValueError("block 0 needs none_hash (the engine's NONE_HASH)")
        parent = none_hash
    return hash_fn((parent, tuple(tokens), extra_keys))


# --------------------------------------------------------------------------- extra keys

class LoRA(NamedTuple):
    """A LoRA adapter as the hash needs it. Which parts are used depends on the era."""

    name: str
    int_id: int | None = None  # 0.10.2–0.11 only; assigned by the server in load order
    path: str | None = None  # 0.31+ only; the lora_path given at load time


def _lora_key(lora: LoRA, v: VllmVersion) -> Any:
    if v < LORA_NAME_KEY_SINCE:
        if lora.int_id is None:
            raise ValueError(f"vLLM {v} hashes the LoRA int id; LoRA.int_id is required")
        return lora.int_id
    if v < TAGGED_KEYS_SINCE:
        return lora.name
    if lora.path is None:
        raise ValueError(f"vLLM {v} hashes the LoRA path; LoRA.path is required")
    return ("lora", lora.name, lora.path)


def block_extra_keys(version: VersionLike, lora: LoRA | None, cache_salt: str | None,
                     start_token_idx: int) -> tuple[Any, ...] | None:
    """The hashed extra keys of the block starting at ``start_token_idx``.

    Order: LoRA key, then cache_salt (block 0 only); empty -> None. Multimodal and
    prompt-embeds keys are not supported (the gateway serves token prompts).
    """
    v = as_version(version)
    keys: list[Any] = []
    if lora:
        keys.append(_lora_key(lora, v))
    if start_token_idx == 0 and cache_salt:  # truthiness, like vLLM: "" adds nothing
        keys.append(("cache_salt", cache_salt) if v >= TAGGED_KEYS_SINCE else cache_salt)
    return tuple(keys) if keys else None


def to_event_extra_keys(extra_keys: tuple[Any, ...] | None,
                        version: VersionLike) -> tuple[Any, ...] | None:
    """One block's extra keys as a BlockStored event carries them.

    0.31+ publishes the untagged form (key[1]; key[1:] for "mm"), so the LoRA
    path never leaves the engine. Before 0.31 events carried the hashed keys.
    """
    if extra_keys is None or as_version(version) < TAGGED_KEYS_SINCE:
        return extra_keys
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in extra_keys)


def event_extra_keys(version: VersionLike,
                     hashed: Sequence[tuple[Any, ...] | None]) -> list[Any] | None:
    """``BlockStored.extra_keys`` for blocks with these hashed keys.

    From 0.17 it is always a list with one entry per block (``[None, None]`` for
    plain requests); before 0.17 the field does not exist (None).
    """
    v = as_version(version)
    if v < EVENT_EXTRA_KEYS_SINCE:
        return None
    return [to_event_extra_keys(k, v) for k in hashed]


# --------------------------------------------------------------------------- chains

def _check_algo(v: VllmVersion, algo: str) -> None:
    if v < BYTES_HASHES_SINCE:
        raise ValueError(f"vLLM {v} used int block hashes (builtin/sha256_cbor_64bit); "
                         f"hashing is supported from {BYTES_HASHES_SINCE} on")
    if algo not in supported_algos(v):
        raise ValueError(f"vLLM {v} has no prefix-caching hash algo {algo!r} "
                         f"(choices: {', '.join(supported_algos(v))})")


@dataclass(frozen=True)
class HashContext:
    """Engine-wide hashing state: one per engine process (NONE_HASH is per process)."""

    version: VllmVersion
    algo: str
    block_size: int
    none_hash: bytes
    hash_fn: HashFn = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_algo(self.version, self.algo)
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        object.__setattr__(self, "hash_fn", get_hash_fn(self.algo))

    @classmethod
    def create(cls, version: VersionLike, algo: str = "sha256", block_size: int = 16,
               pythonhashseed: str | None = None,
               *, urandom: Callable[[int], bytes] = secrets.token_bytes) -> HashContext:
        """Derive NONE_HASH the way that vLLM release does at engine start."""
        v = as_version(version)
        _check_algo(v, algo)  # before none_hash() hashes anything
        return cls(v, algo, block_size, none_hash(algo, pythonhashseed, v, urandom=urandom))

    def hasher(self, lora: LoRA | None = None, cache_salt: str | None = None) -> BlockHasher:
        return BlockHasher(self, lora, cache_salt)

    def hash_tokens(self, tokens: Sequence[int], lora: LoRA | None = None,
                    cache_salt: str | None = None) -> list[bytes]:
        """Digests of all full blocks of ``tokens`` (the router's prompt chain)."""
        return self.chain(None, tokens[:len(tokens) - len(tokens) % self.block_size], 0, lora, cache_salt)

    def chain(self, parent: bytes | None, tokens: Sequence[int], first_block: int,
              lora: LoRA | None = None, cache_salt: str | None = None) -> list[bytes]:
        """Digests of the full blocks of ``tokens`` (a multiple of the block size is used; a partial
        tail is ignored), block ``first_block`` onwards, chained to ``parent`` (the digest of block
        ``first_block - 1``; None for block 0). Token ids are ints.

        ``*_cbor`` algorithms take a fast path that writes the canonical CBOR of each block itself
        (the bytes ``cbor2.dumps(..., canonical=True)`` gives, checked against it and vLLM's golden
        vectors in the tests) — 3× cheaper than a cbor2 call per block; anything it does not cover
        (a token id outside 0..2^64-1) goes the generic way."""
        bs, v = self.block_size, self.version
        n = len(tokens) // bs
        if n == 0:
            return []
        if parent is None and first_block != 0:
            raise ValueError("a chain that starts after block 0 needs its parent digest")
        keys0 = block_extra_keys(v, lora, cache_salt, first_block * bs)
        keys_rest = block_extra_keys(v, lora, cache_salt, bs) if n > 1 else None
        digest = _CBOR_DIGESTS.get(self.algo)
        if digest is not None:
            try:
                return _cbor_chain(digest, parent or self.none_hash, tokens, bs, n, keys0, keys_rest)
            except _NotFast:
                pass
        out: list[bytes] = []
        for i in range(n):
            parent = self.hash_fn((parent or self.none_hash, tuple(tokens[i * bs:(i + 1) * bs]),
                                   keys0 if i == 0 else keys_rest))
            out.append(parent)
        return out


class BlockHasher:
    """Per-request incremental chain (vLLM's ``get_request_block_hasher``).

    Feed prompt tokens, then output tokens as they arrive; each full block is
    hashed once, chained to the previous one. Only the partial tail is kept.
    """

    def __init__(self, ctx: HashContext, lora: LoRA | None = None,
                 cache_salt: str | None = None) -> None:
        self.ctx = ctx
        self.lora = lora
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.extra_keys: list[tuple[Any, ...] | None] = []  # hashed keys, per block
        self.num_tokens = 0
        self._tail: list[int] = []

    def extend(self, tokens: Sequence[int]) -> list[bytes]:
        """Append tokens; return the digests of the blocks they completed."""
        bs, ctx = self.ctx.block_size, self.ctx
        buf = self._tail + list(tokens)
        self.num_tokens += len(buf) - len(self._tail)
        full = len(buf) - len(buf) % bs
        first = len(self.block_hashes)
        parent = self.block_hashes[-1] if self.block_hashes else None
        new = ctx.chain(parent, buf[:full], first, self.lora, self.cache_salt)
        self.block_hashes += new
        self.extra_keys += [block_extra_keys(ctx.version, self.lora, self.cache_salt, (first + i) * bs)
                            for i in range(len(new))]
        self._tail = buf[full:]
        return new



# --------------------------------------------------------------------------- fast CBOR chain

class _NotFast(Exception):
    """A value the hand-written CBOR below does not cover: hash it the generic way."""


class _UintCbor(dict[int, bytes]):
    """token id -> its canonical CBOR (shortest unsigned int head), filled on first sight and bounded
    (a vocabulary is ~10^5 ids; past the cap an id is encoded again each time, never stored)."""

    CAP = 1 << 18

    def __missing__(self, t: int) -> bytes:
        if type(t) is not int or not 0 <= t < 1 << 64:
            raise _NotFast
        enc = _cbor_head(0, t)
        if len(self) < self.CAP:
            self[t] = enc
        return enc


def _cbor_head(major: int, n: int) -> bytes:
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 1 << 8:
        return bytes((m | 24, n))
    if n < 1 << 16:
        return bytes((m | 25,)) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes((m | 26,)) + n.to_bytes(4, "big")
    return bytes((m | 27,)) + n.to_bytes(8, "big")


_UINT = _UintCbor()


def _digest_sha256(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def _digest_xxh128(b: bytes) -> bytes:
    return _xxhash_module().xxh3_128_digest(b)


_CBOR_DIGESTS: dict[str, Callable[[bytes], bytes]] = {"sha256_cbor": _digest_sha256,
                                                        "xxhash_cbor": _digest_xxh128}


def _cbor_chain(digest: Callable[[bytes], bytes], parent: bytes, tokens: Sequence[int], bs: int, n: int,
                keys0: tuple[Any, ...] | None, keys_rest: tuple[Any, ...] | None) -> list[bytes]:
    """sha256/xxh3(canonical CBOR of ``(parent, tuple(block), extra_keys)``) for ``n`` blocks: an
    array of 3, the parent as a byte string, the block as an array of uints, the keys as cbor2
    writes them (a canonical item is the same alone or nested)."""
    arr = _cbor_head(4, bs)
    tail0 = b"\xf6" if keys0 is None else cbor2.dumps(keys0, canonical=True)
    tail = b"\xf6" if keys_rest is None else cbor2.dumps(keys_rest, canonical=True)
    plen = len(parent)
    bhead = b"\x83" + _cbor_head(2, plen)
    enc = _UINT.__getitem__
    join = b"".join
    out: list[bytes] = []
    for i in range(n):
        if len(parent) != plen:
            bhead = b"\x83" + _cbor_head(2, len(parent))
            plen = len(parent)
        parent = digest(join((bhead, parent, arr, join(map(enc, tokens[i * bs:(i + 1) * bs])),
                              tail0 if i == 0 else tail)))
        out.append(parent)
    return out


# --------------------------------------------------------------------------- event form

_U64 = (1 << 64) - 1


def event_hash(digest: bytes, use_int: bool = True) -> int | bytes:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits as an unsigned int when
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is on (the default "1"), else the digest."""
    return int.from_bytes(digest, "big") & _U64 if use_int else digest
