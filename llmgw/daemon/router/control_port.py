"""What the control plane and the admin API may do to the router, and read from it: the RouterPort
protocol, and RouterAdapter, which implements it over a Router.

The control plane keeps the router's models in step with its own, moves the replicas it placed
in and out of routing (add, drain, withdraw), reads one replica's routing state to know when
a drain is over, and feeds tier 2's index of what each engine holds (the router's own: the
agents' kv_events, and when a replica's holdings are void), and with several routers names the
other routers' peer feeds this one subscribes to (routing as one). The admin API reads the recent routing decisions and traces, the endpoints as the
scheduler sees them and the cache-hit summary. Nothing else of the router is theirs: the adapter
is the only code outside daemon/router/ that reaches into the Router and its registry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio

from llmgw.admin.schema import AdapterSummary, CacheSummary, EndpointStatus, KvSummary
from llmgw.admin.views import adapter_summary_view, breaker_view, cache_summary_view, scraped_metrics_view
from llmgw.config import ModelConfig, StrategyConfig
from llmgw.fleet.wire import KvEvents
from llmgw.daemon.router.kv_view import kv_summary
from llmgw.route.trace import TraceRing
from llmgw.route.types import Decision
from llmgw.tenants.book import TenantBook
from llmgw.tenants.usage import UsageRecord

if TYPE_CHECKING:
    from llmgw.daemon.router.proxy import Router

__all__ = ["ReplicaState", "RouterAdapter", "RouterPort"]


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """A replica's routing state, as the control plane may see it."""

    routable: bool  # in the scheduler and taking new requests (false while it drains)
    inflight: int  # requests the router has on it now


class RouterPort(Protocol):
    # -- the control plane --------------------------------------------------------------------
    def define_model(self, m: ModelConfig) -> None:
        """Make `m` known to the router, with its static replicas; redefining a model keeps its
        live replicas."""

    def forget_model(self, name: str) -> None:
        """Drop model `name` if it has no replica left (nothing otherwise, or if it is unknown)."""

    def add_replica(self, m: ModelConfig, rid: str, url: str, *, pool: str, weight: float,
                    node: str | None = None, role: str = "both") -> None:
        """Route `m`'s requests to replica `rid` at `url` too; a draining one takes requests again.
        A replica `rid` known at another url is replaced by a fresh one (fresh breaker, fresh
        metrics). `role`: its part in prefill/decode disaggregation ("both", "prefill", "decode")."""

    def withdraw_replica(self, rid: str) -> None:
        """Out of routing now (nothing if unknown)."""

    def drain_replica(self, rid: str) -> None:
        """No new requests; those in flight finish (nothing if unknown)."""

    def replica_state(self, rid: str) -> ReplicaState | None:
        """None when the router does not route to `rid` at all."""

    def set_strategies(self, strategies: Sequence[StrategyConfig]) -> None:
        """The config's [[strategies]] after a reload: in force from the next request."""

    def set_canary(self, model: str, share: float) -> None:
        """Send `share` (0–1) of `model`'s client requests to its candidate revision."""

    def set_revision(self, model: str, revision_id: str) -> None:
        """The revision id `model` (or a candidate's key) serves, said by its requests' traces."""

    def request_counts(self, model: str) -> tuple[int, int, float, int]:
        """`model`'s client requests so far (the eval runner's left out): (all, failed — 5xx and
        the router's own failures —, the sum of their times to the first byte in s, how many have one)."""

    def autoscale_load(self) -> dict[str, dict[str, Any]]:
        """Per model, this router's load for the autoscaler (llmgw.route.load_report: arrivals,
        inflight, queued, cold waiters, the engines' queues and KV use, TTFT histogram)."""

    # -- tier 2's index (the control plane checked the node may write the replica) -----------------
    def kv_events(self, msg: KvEvents) -> None:
        """An agent's kv_events for a replica it runs: applied to the router's index."""

    def kv_refused(self, reason: str) -> None:
        """A kv_events message was refused ("unknown_replica", "other_node"): counted."""

    def kv_dropped(self, replica: str | None, blocks: int) -> None:
        """A kv_events message over its node's event budget was dropped undecoded: `replica`'s
        index (None: not the node's replica) is void until its next reset."""

    def kv_session_started(self, replica: str) -> None:
        """`replica`'s agent began a new session: its next reset resends the whole mirror."""

    def kv_forget(self, replica: str) -> None:
        """`replica` left routing, or its agent's stream ended: its index is dropped."""

    # -- routing as one (several routers) -------------------------------------------------------
    def feed_address(self) -> str | None:
        """The address of this router's peer feed, for its row in the store's routers table
        (None: it runs none)."""

    def set_feed_peers(self, peers: Mapping[str, str]) -> None:
        """The other live routers' peer feeds, ``{router_id: "host:port"}``: this router
        subscribes to exactly these from now on (nothing when it runs no feed)."""

    # -- tenants: keys, quotas, usage (docs/tenants.md) ------------------------------------------
    def set_tenants(self, book: TenantBook) -> None:
        """The store's tenants and keys (and the config's static keys): who may send what, from the
        next request on. Quota state (buckets, budgets used) carries over."""

    def usage_drain(self) -> list[UsageRecord]:
        """This router's usage since the last drain, by minute, tenant, key and model (the flush)."""

    def usage_put_back(self, records: list[UsageRecord]) -> None:
        """A drained batch the store did not take: kept (merged) for the next flush."""

    def usage_peek(self) -> list[UsageRecord]:
        """What the next drain would give, left in place (the admin API adds it to the store's)."""

    def quota_demand(self) -> dict[tuple[str, str], float]:
        """Per quota scope, ``("tenant", name)`` or ``("key", id)``, this router's recent demand
        in requests per minute (several routers share limits by it)."""

    def set_quota_shares(self, shares: Mapping[tuple[str, str], float]) -> None:
        """This router's fraction (0–1] of each scope's rpm, tpm and concurrency (missing: 1)."""

    def set_spent(self, spent: Mapping[tuple[str, str, str], int], *, as_of: float | None = None) -> None:
        """Tokens the store knows as used per (kind, name, period: "day:YYYY-MM-DD" | "month:YYYY-MM");
        `as_of`: the wall time of the last successful flush's drain (Limiter.set_spent)."""

    def quota_use(self) -> dict[tuple[str, str], dict[str, Any]]:
        """Per scope: rpm/tpm {limit, remaining}, concurrency {limit, inflight}, day/month {limit, used}."""

    def queue_by_tenant(self) -> dict[str, dict[str, Any]]:
        """Per tenant, over every model's wait queue: {waiting, cost, share}."""

    # -- the admin API --------------------------------------------------------------------------
    def decisions(self) -> Sequence[Decision]:
        """The recent routing decisions, oldest first: the router's live ring, to read at once
        (it changes as requests arrive)."""

    def traces(self) -> TraceRing:
        """The recent requests' traces (and jobs' that were added to it), oldest first."""

    def endpoints(self, model: str | None = None) -> list[EndpointStatus]:
        """Every endpoint the scheduler knows (static and placed), or only `model`'s."""

    def cache_summary(self, window_s: float | None = None) -> CacheSummary:
        """The cache-hit counters over the last `window_s` (default: the whole window kept)."""

    def adapters(self, model: str | None = None) -> AdapterSummary:
        """Which vLLM replica holds which LoRA adapter (the router's adapter book)."""

    def kv_summary(self) -> KvSummary:
        """Tier 2: per replica its KV index, event feed, tier decisions and parity check."""


class RouterAdapter:
    """RouterPort over a Router in this process."""

    def __init__(self, router: Router) -> None:
        self._router = router

    # -- the control plane --------------------------------------------------------------------
    def define_model(self, m: ModelConfig) -> None:
        self._router.registry.add_model(m)
        self._router.core.model_changed(m.name)  # its adapters or max_loaded_adapters may differ

    def forget_model(self, name: str) -> None:
        entry = self._router.registry.models.get(name)
        if entry is not None and not entry.replicas:
            self._router.registry.remove_model(name)

    def add_replica(self, m: ModelConfig, rid: str, url: str, *, pool: str, weight: float,
                    node: str | None = None, role: str = "both") -> None:
        self._router.add_replica(m, rid, url, pool=pool, weight=weight, node=node, role=role)

    def withdraw_replica(self, rid: str) -> None:
        self._router.remove_replica(rid)

    def drain_replica(self, rid: str) -> None:
        rep = self._router.registry.replicas.get(rid)
        if rep is not None:
            rep.draining = True

    def replica_state(self, rid: str) -> ReplicaState | None:
        rep = self._router.registry.replicas.get(rid)
        if rep is None:
            return None
        return ReplicaState(routable=not rep.draining, inflight=rep.view.inflight)

    def set_strategies(self, strategies: Sequence[StrategyConfig]) -> None:
        self._router.core.set_strategies(strategies)

    def set_canary(self, model: str, share: float) -> None:
        self._router.core.set_canary(model, share)

    def set_revision(self, model: str, revision_id: str) -> None:
        self._router.core.set_revision(model, revision_id)

    def request_counts(self, model: str) -> tuple[int, int, float, int]:
        return self._router.core.request_counts(model)

    def autoscale_load(self) -> dict[str, dict[str, Any]]:
        return self._router.core.autoscale_load()

    # -- tier 2's index ---------------------------------------------------------------------------
    def kv_events(self, msg: KvEvents) -> None:
        self._router.kv.apply(msg)

    def kv_refused(self, reason: str) -> None:
        self._router.kv.refuse(reason)

    def kv_dropped(self, replica: str | None, blocks: int) -> None:
        self._router.kv.dropped(replica, blocks)

    def kv_session_started(self, replica: str) -> None:
        self._router.kv.session_started(replica)

    def kv_forget(self, replica: str) -> None:
        self._router.kv.remove(replica)

    # -- routing as one ---------------------------------------------------------------------------
    def feed_address(self) -> str | None:
        feed = self._router.peer_feed
        return None if feed is None else feed.address

    def set_feed_peers(self, peers: Mapping[str, str]) -> None:
        feed = self._router.peer_feed
        if feed is not None:
            feed.set_peers(peers)

    # -- tenants ----------------------------------------------------------------------------------
    def set_tenants(self, book: TenantBook) -> None:
        self._router.tenancy.set_book(book)

    def usage_drain(self) -> list[UsageRecord]:
        return self._router.tenancy.usage.drain()

    def usage_put_back(self, records: list[UsageRecord]) -> None:
        self._router.tenancy.usage.put_back(records)

    def usage_peek(self) -> list[UsageRecord]:
        return self._router.tenancy.usage.peek()

    def quota_demand(self) -> dict[tuple[str, str], float]:
        return self._router.tenancy.limiter.demand(trio.current_time())

    def set_quota_shares(self, shares: Mapping[tuple[str, str], float]) -> None:
        self._router.tenancy.limiter.set_shares(shares, now=trio.current_time())

    def set_spent(self, spent: Mapping[tuple[str, str, str], int], *, as_of: float | None = None) -> None:
        self._router.tenancy.limiter.set_spent(spent, as_of=as_of)

    def quota_use(self) -> dict[tuple[str, str], dict[str, Any]]:
        return self._router.tenancy.limiter.use(trio.current_time())

    def queue_by_tenant(self) -> dict[str, dict[str, Any]]:
        return dict(self._router.core.queue_by_tenant())

    # -- the admin API --------------------------------------------------------------------------
    def decisions(self) -> Sequence[Decision]:
        return self._router.decisions

    def traces(self) -> TraceRing:
        return self._router.core.traces

    def endpoints(self, model: str | None = None) -> list[EndpointStatus]:
        reps = self._router.registry.replicas
        out = []
        for row in self._router.registry.snapshot():
            if model is not None and row["model"] != model:
                continue
            rep = reps.get(row["id"])
            out.append(EndpointStatus(
                id=row["id"], model=row["model"], url=row["url"], pool=row["pool"], inflight=row["inflight"],
                running=row["running"], waiting=row["waiting"], kv_usage=row["kv_usage"], stale=row["stale"],
                scrape_age_s=row["scrape_age_s"], scrape_error=row["scrape_error"], drain_rate=row["drain_rate"],
                breaker=breaker_view(row["breaker"]), adapters=row["adapters"], node=row["node"],
                draining=row["draining"], wall=row["wall"], role=row["role"],
                scrape=scraped_metrics_view(rep.last_scrape if rep is not None else None)))
        return out

    def adapters(self, model: str | None = None) -> AdapterSummary:
        book, models = self._router.adapter_port.holdings()
        return adapter_summary_view(book, trio.current_time(), models, model)

    def cache_summary(self, window_s: float | None = None) -> CacheSummary:
        return cache_summary_view(self._router.registry.cache_stats.summary(trio.current_time(), window_s))

    def kv_summary(self) -> KvSummary:
        r = self._router
        kv_models = {m.name for m in r.cfg.models if m.deploy is not None and m.deploy.kv_events}
        routed = [(rep.id, rep.view.model, rep.node) for rep in r.registry.all_replicas()
                  if rep.view.model in kv_models]
        return kv_summary(r.kv, r.core.kv_stats(), routed, trio.current_time())
