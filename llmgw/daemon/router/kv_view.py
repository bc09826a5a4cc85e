"""Tier 2 as the admin API shows it (``GET /api/v1/kv``, ``llmgw ctl kv``, the console's cache
view): per replica its KV index, its KV-event feed, the decisions each tier made for it and its
parity self-check; per model the parity mismatch rate. Read at once from the live objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from llmgw.admin.schema import KvModelParity, KvReplica, KvReplicaParity, KvSummary
from llmgw.daemon.router.kv_index import BYTES_PER_BLOCK, RouterKvIndex
from llmgw.kv.parity import ReplicaParity
from llmgw.route.kv_scorer import KvDecisionStats

__all__ = ["kv_summary"]


def _rate(passed: int, failed: int) -> float | None:
    return failed / (passed + failed) if passed + failed else None


def _parity(rp: ReplicaParity | None) -> KvReplicaParity:
    if rp is None:
        return KvReplicaParity(passed=0, failed=0, unknown=0, mismatch_rate=None, status="unchecked", pending=0)
    return KvReplicaParity(passed=rp.passed, failed=rp.failed, unknown=rp.unknown,
                           mismatch_rate=rp.mismatch_rate, status=rp.status,  # type: ignore[arg-type]
                           pending=len(rp.open))


def kv_summary(kv: RouterKvIndex | None, stats: KvDecisionStats, routed: Iterable[tuple[str, str, str | None]],
               now: float) -> KvSummary:
    """``routed``: (replica, model, node) of every routed replica of a kv_events model."""
    rows: dict[str, tuple[str, str | None]] = {rid: (model, node) for rid, model, node in routed}
    decisions = dict(stats.outcomes)
    if kv is None:
        replicas = [_row(rid, model, node, None, stats.by_replica, now) for rid, (model, node) in rows.items()]
        return KvSummary(enabled=False, blocks=0, bytes=0, messages=0, gaps=0, refused={}, decisions=decisions,
                         replicas=replicas, models=[])
    for rid, feed in kv.feeds.items():
        if rid not in rows and not feed.removed:
            rp = kv.parity.replicas.get(rid)
            rows[rid] = (rp.model if rp is not None else rid.rsplit("/", 1)[0], None)
    replicas = [_row(rid, model, node, kv, stats.by_replica, now) for rid, (model, node) in sorted(rows.items())]
    models = [KvModelParity(model=m, passed=p, failed=f, unknown=u, mismatch_rate=_rate(p, f))
              for m, (p, f, u) in sorted(kv.parity.totals_by_model().items())]
    blocks = len(kv.index)
    return KvSummary(enabled=True, blocks=blocks, bytes=blocks * BYTES_PER_BLOCK, messages=kv.messages,
                     gaps=kv.gaps, refused=dict(kv.refused), decisions=decisions, replicas=replicas,
                     models=models)


def _row(rid: str, model: str, node: str | None, kv: RouterKvIndex | None,
         by_replica: Mapping[str, list[int]], now: float) -> KvReplica:
    tier1, tier2 = by_replica.get(rid, (0, 0))
    feed = kv.feeds.get(rid) if kv is not None else None
    blocks = kv.index.size(rid) if kv is not None else 0
    return KvReplica(
        replica=rid, model=model, node=node, blocks=blocks, bytes=blocks * BYTES_PER_BLOCK,
        overflowed=kv.index.overflowed(rid) if kv is not None else False,
        messages=feed.messages if feed else 0, block_events=feed.block_events if feed else 0,
        resets=feed.resets if feed else 0, gaps=feed.gaps if feed else 0,
        event_seq=feed.event_seq if feed else None,
        lag_s=round(max(0.0, now - feed.last_at), 3) if feed and not feed.removed and feed.last_at is not None
        else None,
        tier1_decisions=tier1, tier2_decisions=tier2,
        parity=_parity(kv.parity.replicas.get(rid) if kv is not None else None))
