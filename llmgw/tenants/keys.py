"""API key secrets (pure; randomness injected): their format, their hash, and the comparison.

A key reads ``sk-llmgw-<id>-<secret>``: ``id`` is 10 characters of a-z0-9 (visible, the store's
key, what `ctl keys list` shows), ``secret`` 48 hex digits (192 random bits). Only the SHA-256 of
the whole string is stored. A fast hash is right here, unlike for passwords: the secret is random
and long, so there is nothing to guess from the hash (GitHub's and Stripe's tokens are kept the
same way); a slow KDF would cost milliseconds on every request.

Looking a key up: the id is read from the presented string (a dict lookup on a value that is not
secret), then the stored hash is compared with the presented string's in constant time
(``hmac.compare_digest``). A string that is not of the form is an unknown key. The static keys of
``[server] api_keys`` have no id: they are compared the same way, by hash.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable

__all__ = ["KEY_PREFIX", "hash_secret", "key_id_of", "matches", "new_key", "visible_prefix"]

KEY_PREFIX = "sk-llmgw-"
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_FORM = re.compile(r"sk-llmgw-([a-z0-9]{10})-[0-9a-f]{48}")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def matches(secret: str, stored_hash: str) -> bool:
    """Constant time in the stored hash (both sides are hashed first)."""
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def key_id_of(secret: str) -> str | None:
    """The id of a string of the key form, else None (an unknown key, or a static one)."""
    m = _FORM.fullmatch(secret)
    return m.group(1) if m else None


def visible_prefix(key_id: str) -> str:
    return f"{KEY_PREFIX}{key_id}-…"


def new_key(random_bytes: Callable[[int], bytes]) -> tuple[str, str, str]:
    """A new key: (secret, id, hash). ``random_bytes(n)`` gives n bytes from a CSPRNG
    (the shell passes ``secrets.token_bytes``)."""
    raw = random_bytes(10)
    kid = "".join(_ALPHABET[b % 36] for b in raw)  # 10 × log2(36) ≈ 51 bits: ids are not secret
    secret = f"{KEY_PREFIX}{kid}-{random_bytes(24).hex()}"
    return secret, kid, hash_secret(secret)
