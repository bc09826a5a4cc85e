"""Usage accounting (pure): what each tenant, key and model used, minute by minute.

The router adds one entry per finished request to its :class:`UsageBook` (wall time passed in);
the shell drains the book every ``[tenants] usage_flush_s`` into the store (one
:class:`UsageRecord` per minute, tenant, key and model) and puts the records back when the store
could not take them, so nothing is lost or counted twice. Cumulative totals (for the Prometheus
counters) are kept apart and never drained.

:func:`aggregate` groups rows (the store's hour rows, or these records) by tenant, model, key, day
or hour, as ``llmgw ctl usage`` and ``GET /api/v1/usage`` show them. :func:`period_keys`,
:func:`period_start` and :func:`period_end` name the UTC day and calendar month a budget counts in
(``day:2026-12-02``, ``month:2026-12``)."""

from __future__ import annotations

import calendar
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .model import TenantError

__all__ = ["AGGREGATE_BY", "COUNTERS", "UsageBook", "UsageRecord", "aggregate", "period_end", "period_keys",
           "period_start"]

COUNTERS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors")
AGGREGATE_BY = ("tenant", "model", "key", "day", "hour")


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One minute's use by one (tenant, key, model) on one router."""
    minute: int  # Unix time // 60 * 60 (the store's hour rows: the hour's start)
    tenant: str
    key: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those the engine had cached
    completion_tokens: int = 0
    errors: int = 0  # requests answered with a status other than 2xx

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


_Slot = tuple[int, str, str, str]  # minute, tenant, key, model


class UsageBook:
    """A router's usage since its last flush, and its cumulative totals since start."""

    __slots__ = ("_pending", "_tokens", "_requests")

    def __init__(self) -> None:
        self._pending: dict[_Slot, list[int]] = {}  # slot -> [requests, prompt, cached, completion, errors]
        self._tokens: dict[tuple[str, str, str], int] = {}
        self._requests: dict[tuple[str, str, str], int] = {}

    def add(self, tenant: str, key: str, model: str, *, wall: float, prompt: int, cached: int, completion: int,
            error: bool) -> None:
        """One finished request (``error``: not answered 2xx) in the minute of ``wall``."""
        slot = (int(wall) // 60 * 60, tenant, key, model)
        c = self._pending.get(slot)
        if c is None:
            c = self._pending[slot] = [0, 0, 0, 0, 0]
        c[0] += 1
        c[1] += prompt
        c[2] += cached
        c[3] += completion
        if error:
            c[4] += 1
        tokens = self._tokens
        for kind, n in (("prompt", prompt), ("cached", cached), ("completion", completion)):
            k = (tenant, model, kind)
            tokens[k] = tokens.get(k, 0) + n
        k = (tenant, model, "error" if error else "ok")
        self._requests[k] = self._requests.get(k, 0) + 1

    def drain(self) -> list[UsageRecord]:
        """Everything added (or put back) since the last drain, oldest minute first; the book is
        empty after."""
        out = self.peek()
        self._pending = {}
        return out

    def peek(self) -> list[UsageRecord]:
        """What :meth:`drain` would give, without draining (the admin API's current minute)."""
        return [UsageRecord(s[0], s[1], s[2], s[3], *c) for s, c in sorted(self._pending.items())]

    def put_back(self, records: Iterable[UsageRecord]) -> None:
        """Records of a flush that failed: kept for the next one, merged with what came since.
        The cumulative totals are not touched (they counted these already)."""
        for r in records:
            slot = (r.minute, r.tenant, r.key, r.model)
            c = self._pending.get(slot)
            if c is None:
                c = self._pending[slot] = [0, 0, 0, 0, 0]
            c[0] += r.requests
            c[1] += r.prompt_tokens
            c[2] += r.cached_tokens
            c[3] += r.completion_tokens
            c[4] += r.errors

    def __len__(self) -> int:
        """Records waiting for the next flush."""
        return len(self._pending)

    def totals(self) -> dict[tuple[str, str, str], int]:
        """Cumulative since start: (tenant, model, kind) → tokens; kind prompt, cached, completion."""
        return dict(self._tokens)

    def requests_total(self) -> dict[tuple[str, str, str], int]:
        """Cumulative since start: (tenant, model, outcome ok|error) → requests."""
        return dict(self._requests)


# ------------------------------------------------------------------------------ grouping
def _field(row: Any, name: str) -> Any:
    return row[name] if isinstance(row, Mapping) else getattr(row, name)


def _hour(minute: int) -> str:
    return datetime.fromtimestamp(minute, timezone.utc).strftime("%Y-%m-%dT%H:00Z")


def _day(minute: int) -> str:
    return datetime.fromtimestamp(minute, timezone.utc).strftime("%Y-%m-%d")


def aggregate(rows: Iterable[UsageRecord | Mapping[str, Any]], by: str) -> list[dict[str, Any]]:
    """The counters of ``rows`` (:class:`UsageRecord` or mappings with its fields) summed per
    group. ``by``: ``tenant``, ``model``, ``key`` (groups carry ``tenant`` and ``key``), ``day``
    (``day`` "2026-12-02" and ``start``, its Unix time) or ``hour`` (``hour`` "2026-12-02T13:00Z",
    ``start``). Each dict: the group's fields, the five counters and ``total_tokens``; groups by
    name, or oldest first for day and hour. An unknown ``by`` raises :class:`TenantError`."""
    if by not in AGGREGATE_BY:
        raise TenantError("by", f"must be one of {', '.join(AGGREGATE_BY)}; got {by!r}"[:200])
    groups: dict[tuple[Any, ...], list[int]] = {}
    for r in rows:
        if by == "tenant":
            g: tuple[Any, ...] = (_field(r, "tenant"),)
        elif by == "model":
            g = (_field(r, "model"),)
        elif by == "key":
            g = (_field(r, "tenant"), _field(r, "key"))
        else:
            m = int(_field(r, "minute"))
            g = (m // 86400 * 86400,) if by == "day" else (m // 3600 * 3600,)
        c = groups.get(g)
        if c is None:
            c = groups[g] = [0, 0, 0, 0, 0]
        for i, name in enumerate(COUNTERS):
            c[i] += int(_field(r, name))
    out = []
    for g, c in sorted(groups.items()):
        if by == "key":
            d: dict[str, Any] = {"tenant": g[0], "key": g[1]}
        elif by == "day":
            d = {"day": _day(g[0]), "start": float(g[0])}
        elif by == "hour":
            d = {"hour": _hour(g[0]), "start": float(g[0])}
        else:
            d = {by: g[0]}
        d.update(zip(COUNTERS, c))
        d["total_tokens"] = c[1] + c[3]
        out.append(d)
    return out


# ------------------------------------------------------------------------------ budget periods
def period_keys(wall: float) -> tuple[str, str]:
    """The UTC day and month of ``wall``: ``("day:2026-12-02", "month:2026-12")``."""
    d = datetime.fromtimestamp(wall, timezone.utc)
    return f"day:{d:%Y-%m-%d}", f"month:{d:%Y-%m}"


def _parse(period: str) -> tuple[str, datetime]:
    kind, _, rest = period.partition(":") if isinstance(period, str) else ("", "", "")
    try:
        if kind == "day":
            return kind, datetime.strptime(rest, "%Y-%m-%d").replace(tzinfo=timezone.utc)
        if kind == "month":
            return kind, datetime.strptime(rest, "%Y-%m").replace(tzinfo=timezone.utc)
    except ValueError:
        pass
    raise TenantError("period", f"must be day:YYYY-MM-DD or month:YYYY-MM; got {str(period)[:100]!r}")


def period_start(period: str) -> float:
    """Unix time the period starts (UTC midnight)."""
    return _parse(period)[1].timestamp()


def period_end(period: str) -> float:
    """Unix time the period ends: the start of the next one."""
    kind, start = _parse(period)
    if kind == "day":
        return start.timestamp() + 86400
    return start.timestamp() + 86400 * calendar.monthrange(start.year, start.month)[1]
