"""The admin API's handlers for the facility (docs/placement.md): the domains with their holds and
power, holding and releasing a domain, and a placement's explanation. Each is
``async (app, call) -> answer``; admin/server.py registers them by route name."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from llmgw.admin.schema import Problem
from llmgw.admin.schema_facility import PlacementCandidate, PlacementExplanation, PlacementRecord
from llmgw.daemon.control.admin.errors import AdminFail, invalid
from llmgw.fleet.domains import DomainError
from llmgw.inputs.echo import echo

__all__ = ["FACILITY_HANDLERS"]

Handler = Callable[[Any, Any], Awaitable[Any]]


async def get_facility(app: Any, call: Any) -> Any:
    return app.control.actions.facility_view()


async def hold_domain(app: Any, call: Any) -> Any:
    try:
        view = app.control.actions.hold(call.params["domain"], call.body.reason, call.body.drain)
    except DomainError as e:  # unknown domains are 404, naming the known ones; bad syntax is 400
        raise (AdminFail(404, str(e)) if str(e).startswith("no node") else
               invalid([Problem("domain", str(e))], "invalid_path")) from None
    except ValueError as e:
        raise invalid([Problem("reason", str(e))], "invalid_body") from None
    return next((h for h in app.control.actions.facility_view().holds if h.domain == view.domain), view)


async def release_domain(app: Any, call: Any) -> Any:
    try:
        app.control.actions.release(call.params["domain"])
    except DomainError as e:
        raise invalid([Problem("domain", str(e))], "invalid_path") from None
    except KeyError:
        raise AdminFail(404, f"Domain {echo(call.params['domain'])} is not held.") from None
    return None


async def explain_placement(app: Any, call: Any) -> Any:
    target = call.params["target"]
    try:
        e = app.control.actions.explain_placement(target)
    except KeyError:
        raise AdminFail(404, f"No placed replica or deployed model {echo(target)}.") from None
    return PlacementExplanation(
        model=e.model, replica=e.replica, node=e.node, domains=list(e.domains), why=e.why, counts=e.counts,
        truncated=e.truncated, warnings=e.warnings,
        candidates=[PlacementCandidate(c.node, c.verdict, c.detail, [d for d in c.domains if d])
                    for c in e.candidates],
        at_placement=None if (r := e.at_placement) is None else PlacementRecord(
            at=r.at, node=r.node, why=r.why, counts=dict(r.counts), truncated=r.truncated,
            candidates=[PlacementCandidate(c.node, c.verdict, c.detail, [d for d in c.domains if d])
                        for c in r.candidates]))


FACILITY_HANDLERS: dict[str, Handler] = {
    "get_facility": get_facility,
    "hold_domain": hold_domain,
    "release_domain": release_domain,
    "explain_placement": explain_placement,
}
