"""The router's side of tenants (docs/tenants.md): who sent a request, whether it may, and what
it used — the TenantBook, the Limiter and the UsageBook it holds, used on the OpenAI port.

- :meth:`Tenancy.authenticate` maps ``Authorization: Bearer`` to a
  :class:`~llmgw.tenants.book.Principal` (401 in OpenAI's envelope when it cannot). The book is
  at first the config's (``[server] api_keys``, no store keys); the control plane pushes the
  store's (:meth:`set_book`, RouterPort.set_tenants).
- :meth:`Tenancy.admit`, once the model is known: the key's and the tenant's model lists (403),
  then the quotas (429 with ``Retry-After`` and the ``x-ratelimit-*`` headers), charging the
  prompt's estimate + ``max_tokens`` up front. Its :class:`Admitted` is the request's until the
  end: the headers every answer carries, and what is settled.
- :meth:`Tenancy.end` at every end of an admitted request (once; later calls do nothing):
  the Limiter settles from the usage the tap read (:mod:`.usage_tap`) or from its estimate,
  releases the concurrency slot, and the UsageBook counts it.

Counted for ``/metrics`` (:class:`TenantMetrics`): tokens and requests per tenant and model,
refusals by reason, requests in flight per tenant. The model label is a model the router knows
(the planner resolved it), else ``-``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.config import Config
from llmgw.daemon.router.usage_tap import UsageTap, client_asked_usage, usage_tap, with_include_usage
from llmgw.http1.sinks import BodySink
from llmgw.route.openai_req import ApiError
from llmgw.route.plan import Plan
from llmgw.route.types import TenantTag
from llmgw.tenants.book import AuthRefused, Principal, TenantBook
from llmgw.tenants.limits import Grant, Limiter, QuotaRefused
from llmgw.tenants.model import BANDS, band_rank
from llmgw.tenants.usage import UsageBook

__all__ = ["Admitted", "Tenancy", "TenantMetrics", "quota_error"]

_RANKS = {b: band_rank(b) for b in BANDS}
REASONS = ("rpm", "tpm", "concurrency", "day", "month", "auth", "model")  # llmgw_ratelimited_total's


class Admitted:
    """An admitted request's tenancy, from admission to its end."""

    __slots__ = ("cost", "ended", "estimate", "grant", "headers", "model", "principal", "strip", "tap")

    def __init__(self, principal: Principal, grant: Grant, headers: list[tuple[str, str]], model: str,
                 estimate: int, cost: int, strip: bool) -> None:
        self.principal, self.grant, self.headers, self.model = principal, grant, headers, model
        self.estimate = estimate  # the prompt's token estimate (the planner's)
        self.cost = cost  # what was charged: the estimate + max_tokens (the fair queue's cost too)
        self.strip = strip  # the router asked for the stream's usage: its chunk is not the client's
        self.tap: UsageTap | None = None
        self.ended = False


def quota_error(e: QuotaRefused) -> ApiError:
    """A QuotaRefused as OpenAI's 429: its type says what ran out (``requests``, ``tokens``, or
    ``insufficient_quota`` for a budget), ``Retry-After`` in whole seconds, and the headers."""
    return ApiError(429, e.message, type_=e.type, code=e.code,
                    headers=[("retry-after", str(max(1, int(e.retry_after)))), *e.headers])


def auth_error(e: AuthRefused) -> ApiError:
    return ApiError(e.status, e.message, param=getattr(e, "param", None), code=e.code)


class Tenancy:
    """The router's TenantBook, Limiter and UsageBook, and the counts /metrics shows."""

    def __init__(self, cfg: Config, clock: Callable[[], float], wall: Callable[[], float]) -> None:
        tc = cfg.tenants
        self.cfg = tc
        self._clock, self._wall = clock, wall
        self.limiter = Limiter()
        self.usage = UsageBook()
        self.book = TenantBook((), (), static_keys=tuple(cfg.server.api_keys), static_tenant=tc.static_tenant,
                               static_band=tc.static_band, anonymous_tenant=tc.anonymous_tenant)
        self.limiter.set_book(self.book)
        self.refused: dict[tuple[str, str], int] = {}  # (tenant, model) → requests refused (403, 429)
        self.limited: dict[tuple[str, str], int] = {}  # (tenant, reason) → refusals
        self.inflight: dict[str, int] = {}  # tenant → admitted requests not ended

    def set_book(self, book: TenantBook) -> None:
        """The store's tenants and keys (with the config's static keys): in force from the next request."""
        self.book = book
        self.limiter.set_book(book)

    # -- a request ----------------------------------------------------------------------------
    def authenticate(self, authorization: str | None, *, count: bool = True) -> Principal:
        """The request's principal, or the 401 (ApiError) when its key is missing, unknown,
        revoked or expired (an open book: no key needed, the anonymous tenant). ``count``: a
        refusal counts in llmgw_ratelimited_total{reason="auth"} (not /ready's check)."""
        try:
            return self.book.authenticate(authorization, self._wall())
        except AuthRefused as e:
            if count:
                self._limit("-", "auth")
            raise auth_error(e) from None

    def allows(self, p: Principal, model: str, base: str | None) -> bool:
        """May `p` use `model` (an adapter of `base`)? For /v1/models."""
        try:
            self.book.allow_model(p, model, base)
        except AuthRefused:
            return False
        return True

    def tag(self, p: Principal, cost: int = 0) -> TenantTag:
        """`p` as the wait queue and the trace see it, with `cost` (the shell plans with cost 0 and
        sets the Admitted's once admitted)."""
        return TenantTag(p.tenant.name, p.key_id, _RANKS[p.band], p.band, p.weight, cost)

    def admit(self, p: Principal, plan: Plan) -> Admitted:
        """May `p` send this planned request? 403 (a model it may not use), 429 (a quota), each
        an ApiError; else charged up front and admitted."""
        info = plan.info
        tenant = p.tenant.name
        try:
            self.book.allow_model(p, info.model, info.base_model if info.adapter is not None else None)
        except AuthRefused as e:
            self._limit(tenant, "model")
            self._refuse(tenant, info.model)
            raise auth_error(e) from None
        body = plan.body or {}
        cost = info.prompt_tokens_estimate + _max_tokens(body, self.cfg.default_max_tokens)
        now = self._clock()
        try:
            g = self.limiter.admit(p, cost, now, self._wall())
        except QuotaRefused as e:
            self._limit(tenant, e.reason)
            self._refuse(tenant, info.model)
            raise quota_error(e) from None
        self.inflight[tenant] = self.inflight.get(tenant, 0) + 1
        strip = plan.stream and self.cfg.stream_usage and not client_asked_usage(body)
        return Admitted(p, g, self.limiter.headers(g, now), info.model, info.prompt_tokens_estimate, cost, strip)

    def upstream_body(self, adm: Admitted, raw: bytes, plan: Plan) -> bytes:
        """What goes to the engine: ``raw`` asking for the stream's usage when the router strips it."""
        if adm.strip and plan.body is not None:
            asked = with_include_usage(raw, plan.body)
            if asked is not None:
                return asked
            adm.strip = False
        return raw

    def tap(self, adm: Admitted, sink: BodySink, stream: bool) -> UsageTap:
        """The client's sink, wrapped to read the answer's usage."""
        adm.tap = usage_tap(sink, stream=stream, strip=adm.strip)
        return adm.tap

    def end(self, adm: Admitted | None, status: int | None, *, broken: bool = False) -> str:
        """The request ended (`status` as the client got it; None: no answer; `broken`: its body
        was cut off — the engine failed or the client left). Settles, releases and counts it,
        once. Returns "" or "usage estimated" (for the trace)."""
        if adm is None or adm.ended:
            return ""
        adm.ended = True
        tap = adm.tap
        note = ""
        if tap is not None and tap.usage is not None:
            prompt, cached, completion = tap.usage
        elif tap is not None and status is not None and status < 300:
            # an engine that gave none, a stream cut off: the prompt's estimate, one token an event
            prompt, cached, completion = adm.estimate, 0, max(0, tap.events - 1) if tap.stream else 0
            note = "usage estimated"
        else:  # refused or failed before an answer came, or an answer that is an error: nothing used
            prompt = cached = completion = 0
        p = adm.principal
        tenant = p.tenant.name
        wall = self._wall()
        self.limiter.settle(adm.grant, prompt + completion, self._clock(), wall)
        self.limiter.release(adm.grant)
        n = self.inflight.get(tenant, 0) - 1
        if n > 0:
            self.inflight[tenant] = n
        else:
            self.inflight.pop(tenant, None)
        self.usage.add(tenant, p.key_id, adm.model, wall=wall, prompt=prompt, cached=cached,
                       completion=completion, error=broken or status is None or not 200 <= status < 300)
        return note

    def _limit(self, tenant: str, reason: str) -> None:
        k = (tenant, reason)
        self.limited[k] = self.limited.get(k, 0) + 1

    def _refuse(self, tenant: str, model: str) -> None:
        k = (tenant, model)
        self.refused[k] = self.refused.get(k, 0) + 1


def _max_tokens(body: dict[str, Any], default: int) -> int:
    """The completion tokens a request may use: max_completion_tokens or max_tokens, else the default."""
    for k in ("max_completion_tokens", "max_tokens"):
        v = body.get(k)
        if type(v) is int and v >= 0:  # noqa: E721 - not bool
            return v
    return default


class TenantMetrics(Collector):
    """llmgw_tokens_total{tenant,model,kind}, llmgw_tenant_requests_total{tenant,model,outcome},
    llmgw_ratelimited_total{tenant,reason}, llmgw_tenant_inflight{tenant}."""

    def __init__(self, tenancy: Tenancy) -> None:
        self.t = tenancy

    def collect(self) -> Iterable[Metric]:
        t = self.t
        tok = CounterMetricFamily("llmgw_tokens", "Tokens used per tenant and model, by kind (prompt, cached — of "
                                  "the prompt's, served from the engine's cache —, completion), as the engines "
                                  "reported them (estimated when they did not).", labels=["tenant", "model", "kind"])
        for (tenant, model, kind), n in sorted(t.usage.totals().items()):
            tok.add_metric([tenant, model, kind], float(n))
        yield tok
        req = CounterMetricFamily("llmgw_tenant_requests", "Requests per tenant and model by outcome: ok (2xx), "
                                  "error (any other answer, or none), refused (403 model, 429 quota).",
                                  labels=["tenant", "model", "outcome"])
        for (tenant, model, outcome), n in sorted(t.usage.requests_total().items()):
            req.add_metric([tenant, model, outcome], float(n))
        for (tenant, model), n in sorted(t.refused.items()):
            req.add_metric([tenant, model, "refused"], float(n))
        yield req
        lim = CounterMetricFamily("llmgw_ratelimited", "Requests refused by tenancy, by reason: a quota (rpm, tpm, "
                                  "concurrency, day, month: 429), auth (401: tenant \"-\"), model (403).",
                                  labels=["tenant", "reason"])
        for (tenant, reason), n in sorted(t.limited.items()):
            lim.add_metric([tenant, reason], float(n))
        yield lim
        g = GaugeMetricFamily("llmgw_tenant_inflight", "Admitted requests not yet ended, per tenant.",
                              labels=["tenant"])
        for tenant, n in sorted(t.inflight.items()):
            g.add_metric([tenant], float(n))
        yield g
