"""[tenants]: API keys by tenant, quotas, priority bands and usage accounting (docs/tenants.md).

Tenants and their keys are made at run time (``llmgw ctl tenants``/``keys``) and kept in the store;
this section holds only how the router treats them."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.config.fields import in_range, nonempty, one_of, opt, positive

BANDS = ("batch", "low", "normal", "high", "critical")  # llmgw.tenants.model.BANDS


@dataclass(frozen=True, kw_only=True)
class TenantsConfig:
    # the tenant the keys of [server] api_keys belong to, and the band it waits in
    static_tenant: str = opt("static", check=nonempty)
    static_band: str = opt("normal", check=one_of(*BANDS))
    # who requests are counted under when no key is asked for (no [server] api_keys and no key made)
    anonymous_tenant: str = opt("default", check=nonempty)
    # tokens charged up front for a request that names no max_tokens (settled from its usage at the end)
    default_max_tokens: int = opt(1024, check=in_range(1))
    # ask engines for a stream's usage (stream_options.include_usage) and take the extra chunk out again
    # when the client did not ask for it; off: a stream's completion tokens are counted from its chunks
    stream_usage: bool = opt(True)
    usage_flush_s: float = opt(10.0, check=positive)  # this router's usage records to the store
    share_sync_s: float = opt(2.0, check=positive)  # several routers: quota shares and budgets re-read
    raw_retention_h: float = opt(48.0, check=positive)  # raw usage records kept (then only hourly roll-ups)
    hourly_retention_days: float = opt(400.0, check=positive)  # hourly roll-ups kept
