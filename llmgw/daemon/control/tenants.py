"""The control plane's tenants and API keys (docs/tenants.md, "Tenants and keys"): kept in the store
as documents (kinds ``tenant`` and ``api_key``), held here in memory, and given to the router as a
TenantBook (llmgw.tenants.book) — rebuilt whole on every change and pushed through the router's
control port (``set_tenants``).

Every change an operator makes (the admin API's handlers call these methods) is written first
(``StoreGuard.must_write``: a store that cannot write refuses it, 503; a router that follows
hands it to the leader, admin/forward.py), then made in memory and pushed to this router. The
other routers read it with their next follow (plane/follow.py calls ``reload``): a revoked key is
refused by every router within ``[store] poll_s``.

Deleting a tenant deletes its keys (its usage records stay). The static tenant — the keys of
``[server] api_keys`` — is the config's, not the store's: its name cannot be made here.

The usage loops (flush, quota shares, budgets, the roll-up) are daemon/control/usage_sync.py's."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from llmgw.daemon.control.usage_sync import UsageSync
from llmgw.tenants.book import TenantBook
from llmgw.tenants.keys import new_key, visible_prefix
from llmgw.tenants.model import (
    ApiKey,
    Tenant,
    TenantError,
    key_doc,
    key_from_doc,
    tenant_doc,
    tenant_from_doc,
    update_key,
    update_tenant,
)

log = logging.getLogger("llmgw.tenants")

__all__ = ["TENANT_KINDS", "TenantConflict", "TenantsManager", "UnknownTenant"]

TENANT_KINDS = ("tenant", "api_key")  # the store's document kinds
TENANT_FIELDS = ("name", "band", "weight", "quota", "models", "description")


class UnknownTenant(KeyError):
    """No such tenant or key (the admin API's 404); ``str()`` says which."""

    def __str__(self) -> str:
        return str(self.args[0])


class TenantConflict(Exception):
    """The change clashes with what exists (the admin API's 409)."""


class TenantsManager:
    def __init__(self, plane: Any, *, wall: Callable[[], float] = time.time,
                 random_bytes: Callable[[int], bytes] = secrets.token_bytes) -> None:
        """`plane`: the ControlPlane (its cfg, guard, store and router)."""
        self.plane = plane
        self.wall = wall
        self.random_bytes = random_bytes
        self.tenants: dict[str, Tenant] = {}
        self.keys: dict[str, ApiKey] = {}
        self.generation = 0  # books pushed so far
        self.book: TenantBook | None = None
        self.sync = UsageSync(plane, wall=wall)  # the usage and quota loops (the daemon runs sync.run)

    # -- the store ----------------------------------------------------------------------------------
    def load(self, docs: dict[str, dict[str, dict[str, Any]]] | None = None) -> None:
        """Tenants and keys from the store (`docs`: as a follower's snapshot read them; None reads
        them now), then the book pushed. A document that cannot be read is logged and skipped."""
        if docs is None:
            st = self.plane.store
            docs = {k: st.docs(k) for k in TENANT_KINDS}
        tenants, keys = {}, {}
        for name, d in docs.get("tenant", {}).items():
            try:
                tenants[name] = tenant_from_doc(d)
            except TenantError as e:
                log.error("stored tenant %r is invalid and is ignored: %s", name, e)
        for kid, d in docs.get("api_key", {}).items():
            try:
                keys[kid] = key_from_doc(d)
            except TenantError as e:
                log.error("stored API key %r is invalid and is ignored (requests with it are refused): %s", kid, e)
        changed = self.book is None or tenants != self.tenants or keys != self.keys
        self.tenants, self.keys = tenants, keys
        if changed:
            self.push()

    reload = load  # a follower's follow, a new leader's take-over (plane/follow.py)

    def rewrite(self, st: Any) -> None:
        """Everything into `st` (the StoreGuard's write-back after the store could not write)."""
        for name, t in self.tenants.items():
            st.put_doc("tenant", name, tenant_doc(t))
        for kid, k in self.keys.items():
            st.put_doc("api_key", kid, key_doc(k))

    def make_book(self) -> TenantBook:
        c, api_keys = self.plane.cfg.tenants, self.plane.cfg.server.api_keys
        return TenantBook(self.tenants.values(), self.keys.values(), static_keys=tuple(api_keys),
                          static_tenant=c.static_tenant, static_band=c.static_band,
                          anonymous_tenant=c.anonymous_tenant, generation=self.generation)

    def push(self) -> None:
        """The book rebuilt and given to the router (cheap: dicts)."""
        self.generation += 1
        self.book = self.make_book()
        self.plane.router.set_tenants(self.book)

    # -- tenants ------------------------------------------------------------------------------------
    def tenant(self, name: str) -> Tenant:
        t = self.tenants.get(name)
        if t is None:
            raise UnknownTenant(f"No tenant {name!r}.")
        return t

    def create_tenant(self, body: dict[str, Any]) -> Tenant:
        """A new tenant from the admin API's body (TenantError names a bad field)."""
        extra = sorted(set(body) - set(TENANT_FIELDS))
        if extra:
            raise TenantError(str(extra[0])[:64], f"unknown field (known: {', '.join(TENANT_FIELDS)})")
        if "name" not in body:
            raise TenantError("name", "required")
        t = tenant_from_doc({**body, "created_at": self.wall()})
        if t.name == self.plane.cfg.tenants.static_tenant:
            raise TenantConflict(f"Tenant {t.name!r} is the static keys' tenant ([tenants] static_tenant): it is "
                                 "the config's and cannot be made here.")
        if t.name in self.tenants:
            raise TenantConflict(f"Tenant {t.name!r} exists; PATCH changes it.")
        self._put_tenant(t)
        log.info("tenant %s created (band %s, weight %g)", t.name, t.band, t.weight)
        return t

    def update_tenant(self, name: str, changes: dict[str, Any]) -> Tenant:
        t = update_tenant(self.tenant(name), changes)
        self._put_tenant(t)
        return t

    def delete_tenant(self, name: str) -> list[str]:
        """The tenant and its keys (one transaction); the ids of the keys deleted."""
        self.tenant(name)
        mine = sorted(k for k, v in self.keys.items() if v.tenant == name)
        self.plane.guard.must_write("write_docs", [], [("api_key", k) for k in mine] + [("tenant", name)])
        self.tenants.pop(name, None)
        for k in mine:
            self.keys.pop(k, None)
        self.push()
        log.info("tenant %s deleted with %d keys", name, len(mine))
        return mine

    def _put_tenant(self, t: Tenant) -> None:
        self.plane.guard.must_write("put_doc", "tenant", t.name, tenant_doc(t))
        self.tenants[t.name] = t
        self.push()

    # -- keys ---------------------------------------------------------------------------------------
    def key(self, kid: str) -> ApiKey:
        k = self.keys.get(kid)
        if k is None:
            raise UnknownTenant(f"No API key {kid!r}.")
        return k

    def create_key(self, tenant: str, body: dict[str, Any]) -> tuple[str, ApiKey]:
        """A new key of `tenant` with the body's settings (name, expires_at, models, quota, band):
        (the secret — shown once, never stored —, the key)."""
        secret, k = self._new_key(tenant, body)
        self._put_key(k)
        log.info("API key %s of tenant %s created", k.id, tenant)
        return secret, k

    def _new_key(self, tenant: str, body: dict[str, Any], rotated_from: str | None = None) -> tuple[str, ApiKey]:
        self.tenant(tenant)
        secret, kid, digest = new_key(self.random_bytes)
        while kid in self.keys:  # 51 bits: a clash is as good as impossible, and harmless here
            secret, kid, digest = new_key(self.random_bytes)
        base = ApiKey(kid, tenant, digest, visible_prefix(kid), created_at=self.wall(), rotated_from=rotated_from)
        return secret, update_key(base, body)

    def update_key(self, kid: str, changes: dict[str, Any]) -> ApiKey:
        k = update_key(self.key(kid), changes)
        self._put_key(k)
        return k

    def revoke_key(self, kid: str) -> ApiKey:
        """Refused from now on (revoking a revoked key keeps its first time)."""
        k = self.key(kid)
        if k.revoked_at is None:
            k = replace(k, revoked_at=self.wall())
            self._put_key(k)
            log.info("API key %s of tenant %s revoked", kid, k.tenant)
        return k

    def rotate_key(self, kid: str, grace_s: float = 0.0) -> tuple[str, ApiKey]:
        """A new key of the same tenant with the same settings (`rotated_from` the old id); the old
        one is revoked now, or with `grace_s` expires then. One transaction: both or neither."""
        old = self.key(kid)
        if old.revoked_at is not None:
            raise TenantConflict(f"API key {kid!r} is revoked: make a new key instead.")
        if grace_s < 0:
            raise TenantError("grace_s", f"must be ≥ 0; got {grace_s!r}")
        now = self.wall()
        secret, new = self._new_key(old.tenant, {"name": old.name, "expires_at": old.expires_at,
                                                 "models": old.models, "band": old.band}, rotated_from=kid)
        new = replace(new, quota=old.quota)
        ended = (replace(old, revoked_at=now) if grace_s == 0 else
                 replace(old, expires_at=min(now + grace_s, old.expires_at or float("inf"))))
        self.plane.guard.must_write("write_docs", [("api_key", new.id, key_doc(new)),
                                                   ("api_key", old.id, key_doc(ended))], [])
        self.keys[new.id], self.keys[old.id] = new, ended
        self.push()
        log.info("API key %s of tenant %s rotated: %s replaces it%s", kid, old.tenant, new.id,
                 f", which expires in {grace_s:g}s" if grace_s else ", revoked now")
        return secret, new

    def _put_key(self, k: ApiKey) -> None:
        self.plane.guard.must_write("put_doc", "api_key", k.id, key_doc(k))
        self.keys[k.id] = k
        self.push()

    # -- views' helpers -----------------------------------------------------------------------------
    def active_keys(self, tenant: str) -> int:
        now = self.wall()
        return sum(1 for k in self.keys.values() if k.tenant == tenant and k.state(now) == "active")
