"""Admin writes on a router that does not lead: handed to the leader through the store (docs/ha.md).

Every router answers the admin API. Reads are answered from the router's own memory (a
follower's lags the store by at most `[store] poll_s`). A change (any method but GET) must be made
by the leader — it alone writes the fleet's state — so a follower, once the request has passed its
own token check and validation, queues it in the store's `admin_queue` for the leader's epoch and
waits: the leader takes queued requests every `poll_s`, runs each through its own admin API as a
local caller, and stores the answer, which the follower returns as it is (status, headers, body).

The answer is deleted from the store as the follower reads it: it may hold a secret (a new API
key's, docs/tenants.md), which must not stay there. Through the store rather than a connection between routers: the store is what every router can
already reach, with its credentials; the request (which may carry a model's `env`, secrets
included) goes where those already are, and no listener or key is added.

When no router leads, or the leader changes before it answered, the follower answers 503 with
Retry-After and says which: a request the old leader never took was not made; one it took may
have been (check, then retry)."""

from __future__ import annotations

import base64
import logging
from typing import Any

import trio

from llmgw.daemon.control.admin.errors import AdminFail
from llmgw.daemon.net.http_types import Request, Response

log = logging.getLogger("llmgw.admin")

__all__ = ["FORWARD_TIMEOUT_S", "Forwarder", "answer_of", "request_of"]

FORWARD_TIMEOUT_S = 30.0
MAX_FORWARD_BODY = 4 << 20


def to_wire(req: Request, router_id: str) -> dict[str, Any]:
    return {"method": req.method, "target": req.target, "path": req.path, "query": req.query,
            "body": base64.b64encode(req.body).decode("ascii"), "from": router_id}


def request_of(d: dict[str, Any]) -> Request:
    """A queued request as the leader's admin API takes it: a local caller (the follower checked
    the token), marked with the router it came through."""
    return Request(method=str(d["method"]), target=str(d["target"]), path=str(d["path"]), query=str(d["query"]),
                   headers=[("x-llmgw-forwarded-from", str(d.get("from", "")))],
                   body=base64.b64decode(d.get("body", "")), client=None)


def answer_of(resp: Response) -> dict[str, Any]:
    body = resp.body if isinstance(resp.body, bytes) else b""
    return {"status": resp.status, "headers": [[k, v] for k, v in resp.headers if k.lower() != "content-length"],
            "body": base64.b64encode(body).decode("ascii")}


def response_of(answer: dict[str, Any]) -> Response:
    headers = [(str(k), str(v)) for k, v in answer.get("headers", [])]
    return Response(int(answer["status"]), headers, base64.b64decode(answer.get("body", "")))


class Forwarder:
    """A follower's side: `forward(req)` queues it for the leader and waits for its answer."""

    def __init__(self, leadership: Any, *, timeout_s: float = FORWARD_TIMEOUT_S) -> None:
        self.leadership = leadership
        self.timeout_s = timeout_s
        self.forwarded = 0
        self.failed = 0

    async def forward(self, req: Request) -> Response:
        ld = self.leadership
        leader = ld.leader_id
        live = ld.live_routers()
        if not leader or leader not in live:
            self.failed += 1
            raise AdminFail(503, "No router leads the control plane right now, so this change was not made; one "
                                 f"takes the lead within {ld.keeper.lease_s:g}s of the last leader's loss (`llmgw "
                                 "ctl routers` shows them). Retry then.", headers=[("retry-after", "2")])
        if len(req.body) > MAX_FORWARD_BODY:
            raise AdminFail(413, f"The body is over {MAX_FORWARD_BODY} bytes.")
        epoch = ld.epoch
        try:
            qid = await ld._call(ld.store.queue_admin, epoch, to_wire(req, ld.router_id))
        except Exception as e:  # noqa: BLE001 — the store's fault: said, never a traceback
            self.failed += 1
            raise AdminFail(503, f"This router does not lead the control plane and cannot hand the change to the "
                                 f"leader ({leader}) through the store ({_why(ld, e)}), so it was not made; retry "
                                 "once `llmgw ctl status` shows the store ok.", headers=[("retry-after", "5")]) from None
        log.info("admin %s %s handed to the leader %s (epoch %d, request %d)", req.method, req.path, leader, epoch, qid)
        delay = 0.02
        with trio.move_on_after(self.timeout_s):
            while True:
                await trio.sleep(delay)
                delay = min(delay * 2, 0.2)
                try:
                    # taken: deleted once read, since an answer may hold a new API key's secret
                    answer = await ld._call(ld.store.take_admin_answer, qid)
                except Exception:  # noqa: BLE001 — counted by _call; keep waiting until the timeout
                    continue
                if answer is not None:
                    self.forwarded += 1
                    return response_of(answer)
                if ld.epoch != epoch or ld.leader_id != leader:
                    self.failed += 1
                    raise AdminFail(503, f"The leader ({leader}, epoch {epoch}) lost the lead before it answered this "
                                         "change: it may or may not have been made. Check (`llmgw ctl status`, the "
                                         "object's GET), then retry.", headers=[("retry-after", "2")])
        self.failed += 1
        raise AdminFail(503, f"The leader ({leader}) did not answer this change within {self.timeout_s:g}s: it may or "
                             "may not have been made. Check, then retry.", headers=[("retry-after", "5")])


def _why(ld: Any, e: BaseException) -> str:
    try:
        return f"{ld.store.describe(e)}: {e}" if isinstance(e, ld.store.faults) else f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001
        return str(e)
