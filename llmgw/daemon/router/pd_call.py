"""The prefill step's exchange (docs/disaggregation.md): the shell's half of
:mod:`llmgw.route.pd_step`. The core gave an Attempt whose ``phase`` is ``"prefill"`` and whose
body is the prefill-only form; this sends it to the prefiller, reads its whole (small) answer and
reports it with ``RouterCore.prefilled`` — every failure included, which the core turns into
another prefiller's attempt (nothing was sent) or the decoder prefilling itself. The client sees nothing of this step but its time."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import trio

from llmgw.config import RouterConfig
from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool, UpstreamTimeout
from llmgw.daemon.router.proxy_wire import failure_of
from llmgw.route.admission import Ticket
from llmgw.route.attempt import Attempt
from llmgw.route.breaker import FailureKind
from llmgw.route.dispatch import RouterCore
from llmgw.route.pd import MAX_ANSWER_BYTES
from llmgw.route.plan import Plan

__all__ = ["prefill"]

log = logging.getLogger("llmgw.router")


async def prefill(core: RouterCore, pool: UpstreamPool, rc: RouterConfig, plan: Plan, a: Attempt, target: str,
                  headers: Sequence[tuple[str, str]], wake: Callable[[Iterable[Ticket]], None]) -> None:
    """Send the prefill attempt ``a`` and report its end to the core (the decode step follows)."""
    rep = a.replica
    a.sent_at = trio.current_time()
    status: int | None = None
    data = b""
    failure: FailureKind | None = None
    detail = ""
    try:
        async with pool.stream(rep.view.url, "POST", target, [*headers, *a.trace_headers], a.body,
                               connect_timeout=rc.connect_timeout_s, first_byte_timeout=a.first_byte_timeout,
                               idle_timeout=rc.idle_timeout_s) as resp:
            a.connected_at, a.head_at = resp.connected_at, resp.head_at
            status = resp.status
            data = await resp.read(MAX_ANSWER_BYTES)
    except UpstreamError as e:
        failure = failure_of(e)
        detail = f"timed out ({e.phase})" if isinstance(e, UpstreamTimeout) else e.public
        log.warning("prefill on %s failed: %s (%s)", rep.id, e, e.url or rep.view.url,
                    extra={"request_id": plan.info.request_id, "model": plan.model, "endpoint": rep.id})
    except BaseException:  # the client left: the request ends here
        wake(core.prefilled(plan, a, trio.current_time(), FailureKind.CLIENT_CANCEL, status=None))
        raise
    now = trio.current_time()
    wake(core.prefilled(plan, a, now, failure, status=status, data=data, detail=detail))
    if log.isEnabledFor(logging.INFO):  # the access log: one line per attempt, this one too
        log.info("prefill %s", "ok" if plan.kv_params is not None else
                 "failed: another prefiller" if plan.pd == "prefill" else "gave no KV: the decoder prefills",
                 extra={"request_id": plan.info.request_id, "model": plan.model, "endpoint": rep.id,
                        "status": status, "outcome": "ok" if failure is None else failure.value,
                        "latency_ms": round((now - a.sent_at) * 1e3, 2)})
