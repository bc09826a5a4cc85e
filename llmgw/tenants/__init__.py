"""Tenants (pure core): who sends a request, what they may use, how much, and what they used.

- :mod:`.model` — tenants and API keys as data, and their checks (the store's documents, the admin
  API's bodies);
- :mod:`.keys` — key secrets: format, hash, constant-time comparison;
- :mod:`.book` — the tenant book: an ``Authorization`` header to a :class:`Principal`, or 401/403;
- :mod:`.limits` — quotas: rpm/tpm token buckets, concurrency, day/month budgets, 429s and headers
  (:mod:`.scope_state` one scope's state);
- :mod:`.shares` — several routers: each one's share of a scope's limits, and the bound;
- :mod:`.usage` — usage records per minute, tenant, key and model; grouping; budget periods.

No I/O, no clock, no randomness except injected (tests/test_import_contract.py)."""

from llmgw.tenants.book import AuthRefused, Principal, TenantBook, make_principal
from llmgw.tenants.keys import KEY_PREFIX, hash_secret, key_id_of, matches, new_key
from llmgw.tenants.limits import Grant, Limiter, QuotaRefused
from llmgw.tenants.model import BANDS, DEFAULT_BAND, ApiKey, Quota, Tenant, TenantError, band_rank
from llmgw.tenants.shares import floor_share, scope_key, scope_of, share_bound, shares
from llmgw.tenants.usage import UsageBook, UsageRecord, aggregate, period_end, period_keys, period_start

__all__ = ["BANDS", "DEFAULT_BAND", "KEY_PREFIX", "ApiKey", "AuthRefused", "Grant", "Limiter", "Principal", "Quota",
           "QuotaRefused", "Tenant",
           "TenantBook", "TenantError", "UsageBook", "UsageRecord", "aggregate", "band_rank", "floor_share", "hash_secret",
           "key_id_of", "make_principal", "matches", "new_key", "period_end", "period_keys", "period_start", "scope_key", "scope_of",
           "share_bound", "shares"]
