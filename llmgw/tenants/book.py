"""Who sent a request (pure): the tenant book maps an ``Authorization`` header to a
:class:`Principal` — a tenant, the key it used, its band, weight and allowed models — or refuses
with an OpenAI-style :class:`AuthRefused` (401 for a missing, unknown, revoked or expired key; 403
for a model the key or its tenant may not use).

A :class:`TenantBook` is an immutable snapshot of the tenants and keys the store holds plus the
static keys of ``[server] api_keys``; the shell builds a new one on every change and swaps it in
whole (building one of 1,000 tenants and keys takes about a millisecond: dicts). Each key's
Principal is made once, when the book is built, so :meth:`TenantBook.authenticate` is a dict
lookup and one hash comparison.

Comparisons are in constant time in the stored secret: a key of the ``sk-llmgw-<id>-…`` form is
found by its id (not secret) and its hash compared with :func:`~.keys.matches`; any other string is
hashed once and compared with every static key's digest (``hmac.compare_digest``). No message
quotes the presented secret.

A book with no static key and no stored key at all (revoked and expired ones count as keys) is
**open**: every request is the anonymous tenant's (``[tenants] anonymous_tenant``), whatever its
header says — llmgw's behaviour before tenants. If the store holds a tenant of that name, its band,
weight, models and quotas apply to anonymous requests."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from llmgw.inputs.echo import echo

from .keys import key_id_of, matches
from .model import DEFAULT_BAND, ApiKey, Quota, Tenant, static_tenant

__all__ = ["AuthRefused", "Principal", "TenantBook", "STATIC_KEY_ID", "ANONYMOUS_KEY_ID", "iso_utc", "make_principal"]

STATIC_KEY_ID = "static"  # Principal.key_id of a static key of [server] api_keys
ANONYMOUS_KEY_ID = "-"  # Principal.key_id of a request of an open book (no key asked for)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request is from, as the router treats it. Made by the book (:meth:`TenantBook.authenticate`,
    :func:`make_principal`): ``allow`` and ``scopes`` are derived from the tenant and key there."""
    tenant: Tenant
    key: ApiKey | None  # None: a static key of [server] api_keys, or no auth (the anonymous tenant)
    band: str  # the key's band, else the tenant's (the static tenant: [tenants] static_band)
    weight: float  # the tenant's
    models: tuple[str, ...] | None  # what both lists allow (the key's ∩ the tenant's); None: no list
    # The lists allow_model checks, as sets: the tenant's and the key's (each must allow the model).
    allow: tuple[frozenset[str], ...] = field(default=(), compare=False, repr=False)
    # The quota scopes a request is checked against, each with its limits: ("tenant", name) and
    # ("key", id), those that have any limit (the Limiter's; made once with the book).
    scopes: tuple[tuple[tuple[str, str], Quota], ...] = field(default=(), compare=False, repr=False)

    @property
    def key_id(self) -> str:
        """``key.id``; ``"static"`` for a static key, ``"-"`` for an anonymous request."""
        if self.key is not None:
            return self.key.id
        return STATIC_KEY_ID if self.tenant.static else ANONYMOUS_KEY_ID


class AuthRefused(Exception):
    """A request refused before it is planned: 401 ``invalid_api_key`` or 403 ``model_not_allowed``.
    ``body()`` is OpenAI's error envelope."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def iso_utc(wall: float) -> str:
    """``2027-01-31T00:00:00Z``."""
    return datetime.fromtimestamp(wall, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_INVALID = "Invalid or missing API key."


def _refused(message: str = _INVALID) -> AuthRefused:
    return AuthRefused(401, message, "invalid_api_key")


def make_principal(tenant: Tenant, key: ApiKey | None = None, band: str | None = None) -> Principal:
    """A principal as the book makes them (allowed-model sets and quota scopes filled in): for
    tests and the shell's own requests; ``band`` overrides the key's and the tenant's."""
    return _principal(tenant, key, band)


def _principal(tenant: Tenant, key: ApiKey | None, band: str | None = None) -> Principal:
    lists = [m for m in (tenant.models, key.models if key is not None else None) if m is not None]
    if not lists:
        models = None
    elif len(lists) == 1:
        models = lists[0]
    else:
        other = set(lists[1])
        models = tuple(m for m in lists[0] if m in other)
    scopes: list[tuple[tuple[str, str], Quota]] = []
    if not tenant.quota.empty():
        scopes.append((("tenant", tenant.name), tenant.quota))
    if key is not None and not key.quota.empty():
        scopes.append((("key", key.id), key.quota))
    return Principal(tenant=tenant, key=key, band=band or (key.band if key is not None else None) or tenant.band,
                     weight=tenant.weight, models=models, allow=tuple(frozenset(m) for m in lists),
                     scopes=tuple(scopes))


class TenantBook:
    """Immutable snapshot: rebuilt whole on every change (cheap: dicts). ``generation`` is the
    shell's count of books, for its logs and tests."""

    __slots__ = ("generation", "static_tenant_name", "anonymous_tenant_name", "_tenants", "_keys",
                 "_by_key", "_static_digests", "_static", "_anonymous", "_open")

    def __init__(self, tenants: Iterable[Tenant], keys: Iterable[ApiKey], *, static_keys: Sequence[str] = (),
                 static_tenant: str = "static", static_band: str = "normal",
                 anonymous_tenant: str = "default", generation: int = 0) -> None:
        self.generation = generation
        self.static_tenant_name = static_tenant
        self.anonymous_tenant_name = anonymous_tenant
        # The static tenant's name cannot be made in the store; a document of that name is ignored.
        self._tenants: dict[str, Tenant] = {t.name: t for t in tenants if t.name != static_tenant}
        self._keys: dict[str, ApiKey] = {k.id: k for k in keys}
        self._by_key: dict[str, Principal] = {}
        for k in self._keys.values():
            t = self._tenants.get(k.tenant)
            if t is not None:
                self._by_key[k.id] = _principal(t, k)
        self._static_digests = tuple(hashlib.sha256(s.encode("utf-8", "surrogatepass")).digest()
                                     for s in dict.fromkeys(static_keys))
        st = static_tenant_from(static_tenant, static_band)
        self._static = _principal(st, None, static_band) if self._static_digests else None
        anon = self._tenants.get(anonymous_tenant) or Tenant(name=anonymous_tenant, band=DEFAULT_BAND)
        self._anonymous = _principal(anon, None)
        self._open = not self._static_digests and not self._keys

    # ------------------------------------------------------------------------------ reading
    @property
    def open(self) -> bool:
        """No static key and no key in the store: requests need no key (the anonymous tenant's)."""
        return self._open

    @property
    def anonymous(self) -> Principal:
        """The principal of every request of an open book."""
        return self._anonymous

    def tenants(self) -> dict[str, Tenant]:
        """The store's tenants, and the static tenant when there are static keys."""
        out = dict(self._tenants)
        if self._static is not None:
            out[self._static.tenant.name] = self._static.tenant
        return out

    def keys(self) -> dict[str, ApiKey]:
        """The store's keys by id (revoked and expired ones too; never the static keys)."""
        return dict(self._keys)

    def tenant(self, name: str) -> Tenant | None:
        if self._static is not None and name == self._static.tenant.name:
            return self._static.tenant
        return self._tenants.get(name)

    def principal_of_key(self, key_id: str) -> Principal | None:
        """The principal a stored key authenticates as (None: unknown key or its tenant gone)."""
        return self._by_key.get(key_id)

    # ------------------------------------------------------------------------------ checks
    def authenticate(self, authorization: str | None, now_wall: float) -> Principal:
        """The principal of an ``Authorization`` header (``Bearer <key>``, the scheme in any case),
        or :class:`AuthRefused` 401. An open book takes every request as the anonymous tenant's."""
        if self._open:
            return self._anonymous
        if not authorization or authorization[:7].lower() != "bearer ":
            raise _refused()
        secret = authorization[7:].strip()
        if not secret:
            raise _refused()
        kid = key_id_of(secret)
        if kid is not None:
            key = self._keys.get(kid)
            if key is not None and matches(secret, key.hash):
                if key.revoked_at is not None:
                    raise _refused("This API key has been revoked.")
                if key.expires_at is not None and now_wall >= key.expires_at:
                    raise _refused(f"This API key expired at {iso_utc(key.expires_at)}.")
                p = self._by_key.get(kid)
                if p is None:
                    raise _refused("This API key's tenant no longer exists.")
                return p
        if self._static is not None:
            digest = hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()
            found = False
            for d in self._static_digests:  # every one compared: the time does not say which matched
                found |= hmac.compare_digest(digest, d)
            if found:
                return self._static
        raise _refused()

    def allow_model(self, p: Principal, model: str, base: str | None = None) -> None:
        """Nothing when both the tenant's and the key's lists allow ``model`` (as the client named
        it); a LoRA adapter's ``base`` model named by a list allows the adapter too. Else
        :class:`AuthRefused` 403 ``model_not_allowed``, ``param`` "model"."""
        if not p.allow:
            return
        for i, allowed in enumerate(p.allow):
            if model in allowed or (base is not None and base in allowed):
                continue
            by_key = p.key is not None and (i == 1 or p.tenant.models is None)
            who = "This API key" if by_key else f"Tenant `{p.tenant.name}`"
            raise AuthRefused(403, f"{who} may not use the model {echo(model, quote='`')}.", "model_not_allowed",
                              param="model")


def static_tenant_from(name: str, band: str) -> Tenant:
    """The tenant of [server] api_keys, in ``band``."""
    t = static_tenant(name)
    return t if t.band == band else Tenant(name=t.name, band=band, description=t.description, static=True)
