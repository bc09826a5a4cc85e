"""The admin API's HTTP shell: one application (AdminApp) on two listeners (serve_admin).

The Unix socket is the owner's: it lives in a 0700 directory we own, is itself 0600, and on Linux
a peer of another uid is answered 403 (SO_PEERCRED); it needs no token. The TCP listener exists
only with a token, and every request on it must carry ``Authorization: Bearer <token>``, compared
in constant time; a missing or wrong one gets the same 401, before any routing, so an outsider
learns nothing of the routes either. Requests tell the two apart by ``Request.client``, which is
None on a Unix socket.

Dispatch is by the route table (llmgw.admin.routes): 404 for an unknown path, 405 with Allow for a
known path and another method, 400 naming the field or parameter for invalid input, 503 naming the
reason when a change must persist and the store cannot write (the change is not made). Handlers
register by the table's names; AdminApp refuses to start if one is missing or left over."""

from __future__ import annotations

import errno
import hmac
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import parse_qsl, quote

import trio

from llmgw.inputs.nesting import TooDeep, json_loads
from llmgw.admin.openapi import render
from llmgw.admin.routes import PREFIX, ROUTES, Resolver, Route
from llmgw.admin.schema import (
    CacheSummary,
    EndpointStatus,
    HistoryEvent,
    NodeRevoked,
    NodeView,
    Problem,
    RequestDecisions,
)
from llmgw.admin.schema_traces import trace_summary, trace_view
from llmgw.admin.validate import Invalid, from_json, query_value
from llmgw.admin.views import decision_view, dumps
from llmgw.config import AdminConfig, ConfigError, model_to_dict, node_name
from llmgw.daemon.control.admin.errors import TYPES, AdminFail, admin_error_body, invalid
from llmgw.daemon.control.admin.autoscale import AUTOSCALE_HANDLERS
from llmgw.daemon.control.admin.events import EventStream
from llmgw.daemon.control.admin.config import CONFIG_HANDLERS
from llmgw.daemon.control.admin.facility import FACILITY_HANDLERS
from llmgw.daemon.control.admin.forward import Forwarder, answer_of, request_of
from llmgw.daemon.control.admin.routers import ROUTER_HANDLERS
from llmgw.daemon.control.admin.tenants import TENANT_HANDLERS
from llmgw.daemon.control.admin.lifecycle import LIFECYCLE_HANDLERS, BodyProblems
from llmgw.daemon.control.agents.identity import RotateError
from llmgw.daemon.control.plane.plane import ControlPlane, ModelError
from llmgw.daemon.control.store.guard import NotLeader, StoreUnavailable
from llmgw.daemon.net.httpserver import (
    Request,
    Response,
    json_response,
    serve_tcp,
    serve_unix,
)
from llmgw.daemon.router.control_port import RouterPort
from llmgw.lifecycle.revisions import LifecycleError
from llmgw.inputs.echo import echo
from llmgw.lifecycle.suite_json import suite_json_schema

log = logging.getLogger("llmgw.admin")

__all__ = ["AdminApp", "AdminSetupError", "admin_error_body", "serve_admin"]

_NDJSON = "application/x-ndjson"
STORE_RETRY_AFTER_S = 5


class AdminSetupError(Exception):
    """The admin listeners cannot start safely (the message says why)."""


@dataclass(slots=True)
class _Call:
    route: Route
    params: dict[str, str]
    query: dict[str, Any]
    body: Any


_Handler = Callable[["AdminApp", _Call], Awaitable[Any]]
_HANDLERS: dict[str, _Handler] = {}


def _handles(name: str) -> Callable[[_Handler], _Handler]:
    def register(fn: _Handler) -> _Handler:
        if name in _HANDLERS:
            raise ValueError(f"two admin handlers for {name}")
        _HANDLERS[name] = fn
        return fn
    return register


_HANDLERS.update(LIFECYCLE_HANDLERS)  # the model lifecycle's (admin/lifecycle.py)
_HANDLERS.update(FACILITY_HANDLERS)  # the facility's (admin/facility.py)
_HANDLERS.update(CONFIG_HANDLERS)  # the config file's check and reload (admin/config.py)
_HANDLERS.update(ROUTER_HANDLERS)  # the routers sharing the store (admin/routers.py)
_HANDLERS.update(TENANT_HANDLERS)  # tenants, API keys, usage (admin/tenants.py)
_HANDLERS.update(AUTOSCALE_HANDLERS)  # scale, pin and release, the autoscalers' explanations (admin/autoscale.py)


# Changes that are this router's own, not the fleet's: made where they are asked, never forwarded.
# The join token lives in each router's join_token_file (docs/ha.md: give the routers the same one).
ROUTER_LOCAL = frozenset({"rotate_join_token"})


class AdminApp:
    def __init__(self, control: ControlPlane, router: RouterPort, *, token: str | None = None,
                 events_tick_s: float = 1.0, ping_s: float = 5.0, decisions_poll_s: float = 0.1) -> None:
        names = {r.name for r in ROUTES}
        if names != set(_HANDLERS):
            raise RuntimeError(f"admin routes without a handler: {sorted(names - set(_HANDLERS))}; "
                               f"handlers without a route: {sorted(set(_HANDLERS) - names)}")
        self.control, self.router = control, router
        self.token = token.encode() if token else None
        self.resolver = Resolver(ROUTES)
        self.events_tick_s, self.ping_s, self.decisions_poll_s = events_tick_s, ping_s, decisions_poll_s
        self._openapi = render().encode()
        self.forwarder: Forwarder | None = None  # several routers: a follower's changes go to the leader

    async def run_forwarded(self, request: dict[str, Any]) -> dict[str, Any]:
        """A change another router queued for this one, the leader (admin/forward.py): run as a local
        caller's, its answer as the follower returns it."""
        try:
            req = request_of(request)
        except (KeyError, TypeError, ValueError) as e:
            return answer_of(json_response(400, {"error": {"message": f"A forwarded request that cannot be read: {e}",
                                                           "type": "invalid_request_error", "param": None,
                                                           "code": None}}))
        resp = await self.handle(req)
        if not isinstance(resp.body, bytes):  # no change answers with a stream
            resp = json_response(500, {"error": {"message": "the answer cannot be forwarded", "type": "server_error",
                                                 "param": None, "code": None}})
        return answer_of(resp)

    @staticmethod
    def handler_names() -> frozenset[str]:
        return frozenset(_HANDLERS)

    # -- the entry point ----------------------------------------------------------------------------
    async def handle(self, req: Request) -> Response:
        try:
            try:
                resp = await self._dispatch(req)
            except LifecycleError as e:
                raise AdminFail(e.status, str(e)) from None
            except BodyProblems as e:
                raise invalid([Problem(f, m) for f, m in e.problems], e.code) from None
            except ConfigError as e:
                raise invalid([Problem(p.key, p.message) for p in e.problems], "invalid_body") from None
            except NotLeader as e:
                raise AdminFail(503, "This router does not lead the control plane (any more), so this change was not "
                                 f"made ({e.detail}). Retry: a router that follows hands changes to the leader "
                                 "(`llmgw ctl routers` shows which leads).",
                                headers=[("retry-after", "2")]) from None
            except StoreUnavailable as e:
                raise AdminFail(503, f"The router's store cannot write ({e.reason}: {e.detail}), so this change was not "
                                 "made. The router keeps running from memory; retry once `llmgw ctl status` shows "
                                 "the store ok.", headers=[("retry-after", str(STORE_RETRY_AFTER_S))]) from None
        except AdminFail as e:
            body = {"error": {"message": e.message, "type": TYPES.get(e.status, "server_error"), "param": e.param,
                              "code": e.code}}
            if e.problems:
                body["error"]["problems"] = [{"field": p.field, "message": p.message} for p in e.problems]
            return json_response(e.status, body, e.headers)
        if req.method != "GET" and resp.status < 400:  # the audit trail of operator changes
            via = req.header("x-llmgw-forwarded-from") if req.client is None else None
            log.info("admin %s %s -> %d (%s)", req.method, req.path, resp.status,
                     f"forwarded by router {via}" if via else
                     "unix socket" if req.client is None else f"{req.client[0]}:{req.client[1]}")
        return resp

    async def _dispatch(self, req: Request) -> Response:
        if req.client is not None:  # TCP: the token first, so outsiders learn nothing, not even routes
            self._authorize(req)
        res = self.resolver.resolve(req.method, req.path)
        route = res.route
        if route is None:
            if res.allow:
                raise AdminFail(405, f"Method {echo(req.method, quote='')} not allowed here; "
                                 f"allowed: {', '.join(res.allow)}",
                            headers=[("allow", ", ".join(res.allow))])
            raise AdminFail(404, f"Unknown route {echo(req.path, quote='')}")
        call = _Call(route, res.params, self._query(route, req), self._body(route, req))
        if (route.method != "GET" and route.name not in ROUTER_LOCAL and self.forwarder is not None
                and not self.control.leading()):
            return await self.forwarder.forward(req)  # a follower: the leader makes changes (admin/forward.py)
        out = await _HANDLERS[route.name](self, call)
        if isinstance(out, Response):
            return out
        if route.response is None:
            return Response(route.status)
        return Response(route.status, [("content-type", "application/json")], dumps(out).encode())

    def _authorize(self, req: Request) -> None:
        auth = req.header("authorization") or ""
        scheme, _, given = auth.partition(" ")
        ok = (self.token is not None and scheme.lower() == "bearer"
              and hmac.compare_digest(given.strip().encode(), self.token))
        if not ok:  # one answer for missing and wrong: no hint of the token
            raise AdminFail(401, "Missing or invalid admin token.", headers=[("www-authenticate", "Bearer")])

    @staticmethod
    def _query(route: Route, req: Request) -> dict[str, Any]:
        raw = dict(parse_qsl(req.query, keep_blank_values=True))
        out: dict[str, Any] = {}
        known = {q.name for q in route.query}
        problems = [Problem(k, "unknown query parameter") for k in raw if k not in known]  # a typo filters nothing
        for q in route.query:
            value = raw.get(q.name, "")
            if value == "":  # absent or empty: the default
                out[q.name] = q.default
                continue
            try:
                out[q.name] = query_value(q.name, q.type, value, q.constraints)
            except Invalid as e:
                problems += e.problems
        if problems:
            raise invalid(problems, "invalid_query")
        return out

    @staticmethod
    def _body(route: Route, req: Request) -> Any:
        if route.body is None:
            return None
        if not req.body.strip():
            if route.body_optional:
                return None
            raise AdminFail(400, "A JSON body is required.", code="invalid_body")
        try:
            data = json_loads(req.body)
        except TooDeep as e:
            raise invalid([Problem(e.where, e.message)], "invalid_body") from None
        except ValueError as e:
            raise AdminFail(400, f"The body is not valid JSON: {e}", code="invalid_json") from None
        try:
            return from_json(route.body, data)
        except Invalid as e:
            raise invalid(e.problems, "invalid_body") from None

    # -- status, nodes ------------------------------------------------------------------------------
    @_handles("get_status")
    async def _status(self, call: _Call) -> Any:
        return self.control.summary()

    @_handles("list_nodes")
    async def _nodes(self, call: _Call) -> Any:
        return self.control.node_views()

    def _node_view(self, name: str) -> NodeView:
        for n in self.control.node_views():
            if n.name == name:
                return n
        raise AdminFail(404, f"No node {echo(name)}.")

    @staticmethod
    def _node_name(call: _Call) -> str:
        name = call.params["name"]
        if (msg := node_name(name)) is not None:
            raise invalid([Problem("name", msg)], "invalid_path")
        return name

    @_handles("get_node")
    async def _node(self, call: _Call) -> Any:
        return self._node_view(self._node_name(call))

    @_handles("set_node_labels")
    async def _set_labels(self, call: _Call) -> Any:
        name = self._node_name(call)
        self.control.actions.set_labels(name, call.body.labels)
        return self._node_view(name)

    @_handles("remove_node_labels")
    async def _remove_labels(self, call: _Call) -> Any:
        name = self._node_name(call)
        if name not in self.control.nodes.nodes:
            raise AdminFail(404, f"No node {echo(name)}.")
        self.control.actions.remove_labels(name, call.body.keys)
        return self._node_view(name)

    # -- node identity ------------------------------------------------------------------------------
    @_handles("revoke_node")
    async def _revoke_node(self, call: _Call) -> Any:
        name = self._node_name(call)
        agents = self.control.agents
        if name not in self.control.nodes.nodes and name not in agents.identities.records:
            raise AdminFail(404, f"No node {echo(name)}.")
        had, connected, withdrawn, store_error = agents.revoke(name)
        return NodeRevoked(node=name, had_credential=had, was_connected=connected, replicas_withdrawn=withdrawn,
                           persisted=store_error is None)

    @_handles("get_join_info")
    async def _join_info(self, call: _Call) -> Any:
        return self.control.agents.join_info()

    @_handles("rotate_join_token")
    async def _rotate_join_token(self, call: _Call) -> Any:
        try:
            self.control.agents.join_token.rotate()
        except RotateError as e:
            raise AdminFail(409, str(e)) from None
        log.warning("join token rotated by an operator: the old one admits no new node from now on")
        return self.control.agents.join_info()

    # -- models -------------------------------------------------------------------------------------
    @_handles("list_models")
    async def _models(self, call: _Call) -> Any:
        return self.control.model_views()

    def _save(self, data: dict[str, Any]) -> dict[str, Any]:
        try:
            m = self.control.actions.put_model(data, source="api")
        except ConfigError as e:
            raise invalid([Problem(p.key, p.message) for p in e.problems], "invalid_body") from None
        except ModelError as e:
            raise AdminFail(409, str(e)) from None
        return model_to_dict(m)

    @_handles("create_model")
    async def _create_model(self, call: _Call) -> Any:
        name = call.body.get("name")
        if isinstance(name, str) and name in self.control.models:
            raise AdminFail(409, f"Model {echo(name)} exists; PUT {PREFIX}/models/{{name}} replaces it.")
        out = self._save(call.body)
        return json_response(201, out, [("location", f"{PREFIX}/models/{quote(out['name'], safe='')}")])

    @_handles("get_model")
    async def _model(self, call: _Call) -> Any:
        m = self.control.models.get(call.params["name"])
        if m is None:
            raise AdminFail(404, f"No model {echo(call.params['name'])}.")
        return model_to_dict(m)

    @_handles("put_model")
    async def _put_model(self, call: _Call) -> Any:
        name, data = call.params["name"], call.body
        # The whole definition, name included (as GET answers it): the document requires it.
        if "name" not in data:
            raise invalid([Problem("name", f"missing: the whole definition, with name {echo(name)}")], "invalid_body")
        if data["name"] != name:
            raise invalid([Problem("name", f"must equal the name in the path, {echo(name)}")], "invalid_body")
        return self._save(data)

    @_handles("delete_model")
    async def _delete_model(self, call: _Call) -> Any:
        name = call.params["name"]
        try:
            self.control.actions.delete_model(name)
        except KeyError:
            raise AdminFail(404, f"No model {echo(name)}.") from None
        except ModelError as e:
            raise AdminFail(409, str(e)) from None
        return None

    # -- replicas, endpoints ------------------------------------------------------------------------
    @_handles("list_replicas")
    async def _replicas(self, call: _Call) -> Any:
        model, node = call.query["model"], call.query["node"]
        return [r for r in self.control.replica_views()
                if (model is None or r.model == model) and (node is None or r.node == node)]

    @_handles("restart_replica")
    async def _restart(self, call: _Call) -> Any:
        rid = call.params["id"]
        try:
            self.control.actions.restart_replica(rid)
        except KeyError:
            raise AdminFail(404, f"No placed replica {echo(rid)} (static endpoints are not restarted "
                                 "by llmgw).") from None
        return next(r for r in self.control.replica_views() if r.replica == rid)

    def _endpoints(self, model: str | None = None) -> list[EndpointStatus]:
        return self.router.endpoints(model)

    @_handles("list_endpoints")
    async def _list_endpoints(self, call: _Call) -> Any:
        return self._endpoints(call.query["model"])

    # -- decisions, cache ---------------------------------------------------------------------------
    @_handles("list_decisions")
    async def _decisions(self, call: _Call) -> Any:
        model, replica, limit = call.query["model"], call.query["replica"], call.query["limit"]
        out = []
        for d in reversed(self.router.decisions()):
            if (model is None or d.model == model) and (replica is None or d.chosen == replica):
                out.append(decision_view(d))
                if len(out) >= limit:
                    break
        return out

    @_handles("get_decision")
    async def _decision(self, call: _Call) -> Any:
        rid = call.params["request_id"]
        decisions = [decision_view(d) for d in self.router.decisions() if d.request_id == rid]
        if not decisions:
            raise AdminFail(404, f"No recent decision for request {echo(rid)}.")
        return RequestDecisions(request_id=rid, decisions=decisions)

    @_handles("list_traces")
    async def _traces(self, call: _Call) -> Any:
        q = call.query
        return [trace_summary(t) for t in self.router.traces().recent(q["limit"], kind=q["kind"], model=q["model"],
                                                                       outcome=q["outcome"])]

    @_handles("get_trace")
    async def _trace(self, call: _Call) -> Any:
        rid = call.params["request_id"]
        t = self.router.traces().get(rid)
        if t is None:  # a job's trace is kept with the job, after the ring has forgotten it
            job = self.control.lifecycle.jobs.get(rid)
            t = job.trace if job is not None else None
        if t is None:
            raise AdminFail(404, f"No recent trace for request {echo(rid)} (the router keeps the last "
                             f"router.traces.kept; a job's trace is kept with the job).")
        return trace_view(t, trio.current_time())

    def _cache(self, window_s: float | None = None) -> CacheSummary:
        return self.router.cache_summary(window_s)

    @_handles("list_adapters")
    async def _list_adapters(self, call: _Call) -> Any:
        return self.router.adapters(call.query["model"])

    @_handles("get_cache")
    async def _get_cache(self, call: _Call) -> Any:
        return self._cache(call.query["window_s"])

    @_handles("get_kv")
    async def _get_kv(self, call: _Call) -> Any:
        return self.router.kv_summary()

    @_handles("list_history")
    async def _history(self, call: _Call) -> Any:
        q = call.query
        try:
            rows = self.control.guard.read("history", lambda st: st.history(
                limit=q["limit"], replica=q["replica"], model=q["model"], node=q["node"]))
        except StoreUnavailable as e:
            raise AdminFail(503, f"The router's store cannot be read ({e.reason}: {e.detail}).",
                        headers=[("retry-after", str(STORE_RETRY_AFTER_S))]) from None
        return [HistoryEvent(id=r.id, ts=r.ts, event=r.event, replica=r.replica, model=r.model, node=r.node,
                             detail=r.detail) for r in rows]

    # -- the event stream (admin/events.py), the document ---------------------------------------------
    @_handles("events")
    async def _events(self, call: _Call) -> Any:
        return Response(200, [("content-type", _NDJSON), ("cache-control", "no-cache")],
                        EventStream(self).lines())

    @_handles("get_openapi")
    async def _openapi_doc(self, call: _Call) -> Any:
        return Response(200, [("content-type", "application/json")], self._openapi)

    @_handles("get_suite_schema")
    async def _suite_schema(self, call: _Call) -> Any:
        return suite_json_schema()


# -- the listeners --------------------------------------------------------------------------------
def _private_dir(path: str) -> None:
    """Create the socket's directory 0700, or accept an existing one only if it is ours and closed to
    group and others: between bind() and chmod() the socket has umask permissions, and a directory
    someone else controls could swap the socket under us."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise AdminSetupError(f"{path} is not a directory: refusing to put the admin socket there")
    if st.st_uid != os.getuid():
        raise AdminSetupError(f"{path} belongs to uid {st.st_uid}, not to us (uid {os.getuid()}): "
                              "refusing to put the admin socket there")
    if st.st_mode & 0o077:
        raise AdminSetupError(f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; the admin socket's directory "
                              f"must be private: chmod 700 {path}")


async def _bound(key: str, where: str, starting: Any) -> Any:
    """Await a listener's start; one it cannot bind is an AdminSetupError naming `key` and `where`."""
    try:
        return await starting
    except BaseException as e:
        seen: BaseException = e
        while isinstance(seen, BaseExceptionGroup) and len(seen.exceptions) == 1:
            seen = seen.exceptions[0]
        if not isinstance(seen, OSError) or isinstance(seen, ConnectionError):
            raise
        hint = " (another llmgw daemon is serving there?)" if seen.errno == errno.EADDRINUSE else ""
        raise AdminSetupError(f"{key}: cannot listen on {where}: {seen.strerror or seen}{hint}") from None


async def serve_admin(cfg: AdminConfig, app: AdminApp, *,
                      task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``cfg.socket`` and, with ``cfg.tcp``, on TCP (which needs the app's token);
    ``started({"socket": path, "tcp": "host:port" or None})`` with the bound TCP port."""
    if cfg.tcp and app.token is None:
        raise AdminSetupError("admin.tcp requires admin.token: no token, no TCP listener")
    path = os.path.abspath(cfg.socket)
    _private_dir(os.path.dirname(path))
    options: dict[str, Any] = {"error_body": admin_error_body, "max_body_bytes": 1 << 20,
                               "max_connections": 128}  # each listener: within the fd limit's reserve
    async with trio.open_nursery() as nursery:
        await _bound("admin.socket", path, nursery.start(partial(serve_unix, app.handle, path, peer_uid=os.getuid(),
                                                                 **options)))
        tcp = None
        if cfg.tcp:
            host, _, port = cfg.tcp.rpartition(":")
            host = host.strip("[]")
            bound = await _bound("admin.tcp", cfg.tcp, nursery.start(partial(serve_tcp, app.handle, host, int(port),
                                                                             **options)))
            tcp = f"{host}:{bound}"
        log.info("admin API on %s%s", path, f" and {tcp} (token required)" if tcp else "")
        task_status.started({"socket": path, "tcp": tcp})
