"""`llmgw ctl`: the operator's command line over the admin API.

Which daemon it talks to (a Unix socket, or a URL with a token) comes from the flags, then the
environment, then `--config`'s [admin] section, then the local daemon's default socket: the
resolution `llmgw console` uses too (llmgw.admin_client.target). Every listing prints a table
or, with `-o json`, the API's own JSON; `explain` prints the rationale as the console lays it out
(llmgw.admin_client.rationale). No Textual here: `ctl` must start fast (a test checks it never
imports the console)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast
from urllib.parse import quote

import httpx

from llmgw.admin_client.facility import explanation_text, facility_text
from llmgw.admin_client.printable import printable
from llmgw.admin_client.target import TOKEN_ENV, TargetError, add_target_arguments, resolve_target
from llmgw.cli.ctl.autoscale import register as register_autoscale
from llmgw.cli.ctl.config import register as register_config
from llmgw.cli.ctl.lifecycle import MODEL_ACTIONS, add_model_options, model_action, register
from llmgw.cli.ctl.output import CtlError, age, emit, table
from llmgw.cli.ctl.routing import register as register_routing
from llmgw.cli.ctl.tenants import register as register_tenants
from llmgw.cli.ctl.views import groups_text, model_text, routers_text, status_text, store_line
from llmgw.fleet.domains import expand_key, label_clash

__all__ = ["CtlError", "main", "store_line"]



# -- the connection ---------------------------------------------------------------------------
class Admin:
    def __init__(self, ns: argparse.Namespace) -> None:
        try:
            target = resolve_target(url=ns.url, socket=ns.socket, token=ns.token, config=ns.config)
        except TargetError as e:
            raise CtlError(str(e)) from None
        headers = {"accept": "application/json"}
        self.origin = target.origin
        if target.url:
            url = target.url
            headers["authorization"] = f"Bearer {target.token}"
            self.where = url
            self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=ns.timeout)
        else:
            sock = target.socket
            assert sock is not None
            self.where = sock
            if not os.path.exists(sock):
                raise CtlError(f"no llmgw admin socket at {sock} ({target.origin}): is the daemon running? "
                               "Start it with `llmgw daemon`, or point at it with --socket PATH, --config FILE, "
                               "or --url URL --token TOKEN")
            self.client = httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://llmgw",
                                       headers=headers, timeout=ns.timeout)

    def call(self, method: str, path: str, *, params: dict[str, Any] | None = None,
             body: Any = None) -> Any:
        params = {k: v for k, v in (params or {}).items() if v is not None}
        try:
            r = self.client.request(method, "/api/v1" + path, params=params,
                                    json=body if body is not None else None)
        except httpx.TransportError as e:
            raise CtlError(f"cannot reach the llmgw admin API at {self.where}: {e}. Is the daemon "
                           "running?") from None
        if r.status_code == 401:
            raise CtlError("the admin API refused the token: pass the daemon's [admin] token with --token "
                           f"(or {TOKEN_ENV})")
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                msg = err.get("message") or r.text
            except (ValueError, KeyError, TypeError):
                msg = r.text.strip() or r.reason_phrase
            raise CtlError(f"{method} {path}: {r.status_code}: {msg}")
        if r.status_code == 204 or not r.content:
            return None
        return r.json()


# -- commands ---------------------------------------------------------------------------------
def _domain_filter(domain: str | None) -> Callable[[dict[str, Any]], bool]:
    """--domain rack=r12 (a facility key, short or llmgw.io/…) or --domain fra/hall-1 (a location prefix)."""
    if not domain:
        return lambda n: True
    if "=" in domain:
        key, _, value = domain.partition("=")
        key = expand_key(key)
        return lambda n: n.get("labels", {}).get(key) == value
    prefix = domain.strip("/")
    return lambda n: n.get("location", "") == prefix or n.get("location", "").startswith(prefix + "/")


def cmd_nodes(api: Admin, ns: argparse.Namespace) -> None:
    if ns.target is not None:
        if ns.name != "revoke":
            raise CtlError(f"nodes {ns.name} {ns.target}: expected `nodes [NAME]` or `nodes revoke NODE`")
        cmd_revoke(api, ns)
        return
    if ns.name:
        emit(ns, api.call("GET", f"/nodes/{quote(ns.name, safe='')}"), _render_node)
        return
    keep = _domain_filter(ns.domain)
    nodes = [n for n in api.call("GET", "/nodes") if keep(n)]

    def render(nodes: list[dict[str, Any]]) -> str:
        rows = []
        for n in nodes:
            gpus = n.get("facts", {}).get("gpus", [])
            rows.append([n["name"], n["state"], n.get("location") or "-", len(gpus),
                         len(n.get("replicas", [])), n.get("held") or "-", age(n.get("since_s")),
                         n.get("reason", "")])
        return table(rows, ["NAME", "STATE", "LOCATION", "GPUS", "ENGINES", "HELD", "SINCE", "REASON"])

    emit(ns, nodes, render)


def _render_node(n: dict[str, Any]) -> str:
    facts = n.get("facts", {})
    lines = [f"node       {n['name']}", f"state      {n['state']} for {age(n.get('since_s'))} ({n.get('reason', '')})",
             f"location   {n.get('location') or '-'}"
             + (f"  (held: {', '.join(map(str, n['held']))})" if n.get("held") else ""),
             (f"facts      {facts.get('cpus', 0)} CPUs, {facts.get('memory_mb', 0)} MB memory, "
             f"{len(facts.get('gpus', []))} GPUs")]
    for g in facts.get("gpus", []):
        lines.append(f"  gpu {g['index']}    {g['name']} {g['memory_mb']} MB")
    ops = n.get("operator_labels", {})
    for k, v in sorted(n.get("labels", {}).items()):
        lines.append(f"label      {k}={v}" + ("  (operator)" if k in ops else ""))
    for r in n.get("replicas", []):
        lines.append(f"replica    {r}")
    return "\n".join(lines)


def cmd_revoke(api: Admin, ns: argparse.Namespace) -> None:
    node = ns.target

    def render(d: dict[str, Any]) -> str:
        lines = [f"node {node} revoked: its credential is refused from now on"]
        lines.append("its agent's connection was closed" if d.get("was_connected") else "its agent was not connected")
        reps = d.get("replicas_withdrawn") or []
        lines.append(f"{len(reps)} replicas withdrawn from routing, to be placed elsewhere"
                     + (f": {', '.join(reps)}" if reps else ""))
        if not d.get("persisted", True):
            lines.append("WARNING: the store could not record the revocation; it holds until the router restarts "
                         "(revoke again then)")
        lines.append("To let the node join again: delete node-credential.json in its agent's state_dir; it then "
                     "joins with the join token as a new node. To keep it out, rotate the join token too "
                     "(`llmgw ctl join-token rotate`): the node knows it.")
        return "\n".join(lines)

    emit(ns, api.call("POST", f"/nodes/{quote(node, safe='')}/revoke"), render)


def _join_info_text(d: dict[str, Any], router: str | None) -> str:
    """What an agent needs, as an [agent] section to paste into its config file."""
    addr = router or d.get("router")
    if not addr:
        raise CtlError("this router has no control listener: agents cannot join it (set control.join_token or "
                       "control.join_token_file)")
    lines = ["# Join a node to this router: put this [agent] section in the node's config file, set its",
             "# node name and advertise_host, and run `llmgw daemon --role agent --config FILE`.",
             "# The join token admits new nodes: keep it secret. Once joined, a node proves itself with",
             "# its own credential (in its state_dir), and the join token may be removed from its config.",
             "[agent]", f"router = {json.dumps(addr)}"]
    if d.get("join_token"):
        lines.append(f"join_token = {json.dumps(d['join_token'])}")
    else:
        lines.append("# join_token = ...             # this router has none: agents cannot join it")
    if d.get("tls"):
        lines.append("tls = true")
        if d.get("ca_pem"):
            lines.append(f"tls_server_name = {json.dumps(d.get('server_name'))}")
            lines.append(f'tls_ca_pem = """\n{d["ca_pem"].strip()}\n"""')
            lines.append(f"# CA certificate sha256 fingerprint: {d.get('ca_sha256')}")
        else:
            lines.append("# tls_ca = \"/etc/llmgw/router-ca.pem\"   # the CA that signed the router's control.tls_cert,"
                         " if not a public one")
    else:
        lines.append("tls = false                      # the router's control stream is plain TCP (loopback or "
                     "control.tls = false)")
    return "\n".join(lines)


def cmd_join_info(api: Admin, ns: argparse.Namespace) -> None:
    data = api.call("GET", "/join-info")
    if ns.router:
        data["router"] = ns.router
    emit(ns, data, lambda d: _join_info_text(d, ns.router))


def cmd_join_token(api: Admin, ns: argparse.Namespace) -> None:
    data = api.call("POST", "/join-token/rotate")
    emit(ns, data, lambda d: f"join token rotated: the old one admits no new node from now on; nodes that joined "
                             f"keep their credentials.\nnew join token: {d['join_token']}")


def cmd_facility(api: Admin, ns: argparse.Namespace) -> None:
    if ns.action is None:
        if ns.domain is not None:
            raise CtlError(f"facility {ns.domain}: expected `facility`, `facility hold DOMAIN` or "
                           "`facility release DOMAIN`")
        emit(ns, api.call("GET", "/facility"), facility_text)
        return
    if ns.domain is None:
        raise CtlError(f"facility {ns.action}: which domain? e.g. `llmgw ctl facility {ns.action} rack=r12`")
    if ns.action == "release" and (ns.drain or ns.reason):
        raise CtlError("facility release: --drain and --reason go with hold")
    path = f"/facility/holds/{quote(ns.domain, safe='=')}"
    if ns.action == "hold":
        api.call("PUT", path, body={"reason": ns.reason or "", "drain": ns.drain})
    else:
        api.call("DELETE", path)
    emit(ns, api.call("GET", "/facility"), facility_text)


def cmd_explain_placement(api: Admin, ns: argparse.Namespace) -> None:
    emit(ns, api.call("GET", f"/placement/{quote(ns.target, safe='')}"), explanation_text)


def cmd_label(api: Admin, ns: argparse.Namespace) -> None:
    sets: dict[str, str] = {}
    removes: list[str] = []
    for item in ns.labels:
        if item.endswith("-") and "=" not in item:
            removes.append(expand_key(item[:-1]))
        elif "=" in item and item.split("=", 1)[0]:
            k, _, v = item.partition("=")
            sets[expand_key(k)] = v
        else:
            raise CtlError(f"label {item!r}: expected key=value to set, or key- to remove")
    if (clash := label_clash([i.partition("=")[0] for i in ns.labels if "=" in i])) is not None:
        raise CtlError(f"label: {clash}")
    node = quote(ns.node, safe="")
    if sets:
        api.call("PUT", f"/nodes/{node}/labels", body={"labels": sets})
    if removes:
        api.call("DELETE", f"/nodes/{node}/labels", body={"keys": removes})
    emit(ns, api.call("GET", f"/nodes/{node}"), _render_node)


def cmd_models(api: Admin, ns: argparse.Namespace) -> None:
    if ns.name in MODEL_ACTIONS and ns.target:
        model_action(api, ns)
        return
    if ns.target is not None:
        raise CtlError(f"models {ns.name} {ns.target}: expected `models [NAME]` or `models "
                       f"{'|'.join(MODEL_ACTIONS)} NAME`")
    if ns.name:
        definition = api.call("GET", f"/models/{quote(ns.name, safe='')}")
        if ns.output == "json":
            emit(ns, definition, str)
            return
        view = next((m for m in api.call("GET", "/models") if m.get("name") == ns.name), None)
        emit(ns, definition, lambda d: model_text(d, view))
        return

    def render(models: list[dict[str, Any]]) -> str:
        rows = [[m["name"], m.get("engine"), m.get("source"),
                 (f"{m.get('ready', 0)}/{m['desired_replicas']}" if m.get("desired_replicas") is not None
                  else f"{m.get('static_replicas', 0)} static")
                 + (f" ({groups})" if (groups := groups_text(m)) else ""),  # prefill 1/1, decode 2/2
                 len((m.get("definition") or {}).get("adapters") or ()) or "",  # LoRA adapters declared
                 m.get("unplaceable") or ""] for m in models]
        return table(rows, ["MODEL", "ENGINE", "SOURCE", "READY", "ADAPTERS", "PROBLEM"])

    emit(ns, api.call("GET", "/models"), render)


def cmd_replicas(api: Admin, ns: argparse.Namespace) -> None:
    def render(reps: list[dict[str, Any]]) -> str:
        roles = any(r.get("role", "both") != "both" for r in reps)  # a disaggregated model's: the ROLE column
        rows = [[r["replica"], r["node"], r["state"] + ("" if r.get("desired") == "run" else f" ({r['desired']})"),
                 *([r.get("role", "both")] if roles else []),
                 r.get("url"), r.get("pid"), r.get("restarts", 0), r.get("gpus"), r.get("inflight", 0),
                 r.get("detail", "")] for r in reps]
        return table(rows, ["REPLICA", "NODE", "STATE", *(["ROLE"] if roles else []), "URL", "PID", "RESTARTS", "GPUS",
                            "INFLIGHT", "DETAIL"])

    emit(ns, api.call("GET", "/replicas", params={"model": ns.model, "node": ns.node}), render)


def cmd_restart(api: Admin, ns: argparse.Namespace) -> None:
    api.call("POST", f"/replicas/{quote(ns.replica, safe='')}/restart")
    print(f"replica {ns.replica}: restart requested")


def cmd_status(api: Admin, ns: argparse.Namespace) -> None:
    data = api.call("GET", "/status")
    if ns.output != "json":  # which daemon answered: the socket or URL, and what chose it
        print(f"{'admin API':20s} {printable(str(api.where))} ({api.origin})")
    emit(ns, data, status_text)


def cmd_routers(api: Admin, ns: argparse.Namespace) -> None:
    data = api.call("GET", "/routers")
    emit(ns, data, routers_text)


# -- argument parsing -------------------------------------------------------------------------
COMMON_TITLE = "output and connection (before or after the command)"

EPILOG = """\
examples:
  llmgw ctl status                      the daemon's summary
  llmgw ctl replicas --model llama-8b   one model's replicas and their engines' state
  llmgw ctl explain REQUEST_ID          why a request went where it did
  llmgw ctl trace REQUEST_ID            where its time went: phases, attempts, retries
  llmgw ctl nodes -o json               the admin API's own answer, for scripts

Without --socket, --url or --config it talks to the local daemon's admin socket.
`llmgw ctl COMMAND --help` describes a command."""


def _common(top: bool) -> argparse.ArgumentParser:
    """The shared options, accepted before or after the command. Below the command they default
    to SUPPRESS: otherwise a subparser's default would overwrite a value given before it."""
    def d(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group(COMMON_TITLE)
    group.add_argument("-o", "--output", choices=("table", "json"), default=d("table"),
                       help="table: text for people (a table, or key-value lines for one object); json: the "
                            "admin API's own answer, for scripts (default: table)")
    add_target_arguments(cast(argparse.ArgumentParser, group), default=d(None))
    group.add_argument("--timeout", type=float, metavar="SECONDS", default=d(10.0),
                       help="how long to wait for the daemon's answer (default: 10)")
    return common


def parser() -> argparse.ArgumentParser:
    common = _common(top=False)
    p = argparse.ArgumentParser(prog="llmgw ctl", parents=[_common(top=True)],
                                description="Inspect and operate a running llmgw daemon over its admin API.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")

    def add(name: str, fn: Callable[[Admin, argparse.Namespace], None], help_: str,
            description: str | None = None) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help_, description=description or help_)
        sp.set_defaults(fn=fn)
        return sp

    sp = add("status", cmd_status, "the daemon's summary",
             "The daemon's summary: version, nodes by state, replicas placed, the partition guard, models "
             "that cannot be placed and why, the store (ok, or degraded and why), and engines the store "
             "does not know.")
    sp = add("routers", cmd_routers, "the routers sharing this router's store, and which one leads",
             "Every router sharing the store (docs/ha.md): its role (leader, follower, gone), host and process, "
             "where clients, agents and the other routers reach it, and how fresh its row is; then the lease "
             "(leader, epoch, length) and how this router's calls to the store fare. A router alone on its store "
             "says so.")
    sp = add("nodes", cmd_nodes, "nodes with their state and location (or one node, by name); `nodes revoke NODE` "
                                 "cuts a node off")
    sp.add_argument("name", nargs="?", metavar="NAME | revoke",
                    help="one node's name: show it alone, in detail; or `revoke`, with the NODE to cut off")
    sp.add_argument("target", nargs="?", metavar="NODE", help="with revoke: the node to cut off")
    sp.add_argument("--domain", help="only nodes in a facility domain: rack=r12, site=fra, or a location "
                                     "prefix like fra/hall-1")
    sp = add("join-info", cmd_join_info, "what an agent needs to join this router (address, join token, CA), as an "
                                         "[agent] section; holds the join token")
    sp.add_argument("--router", metavar="HOST:PORT",
                    help="the address agents dial, if not the one the router reports (NAT, DNS name)")
    sp = add("join-token", cmd_join_token, "rotate the join token (it must come from control.join_token_file)")
    sp.add_argument("action", choices=["rotate"], help="rotate: a new random join token, in force at once")
    sp = add("label", cmd_label, "set (key=value) or remove (key-) operator labels on a node",
             "Set (key=value) or remove (key-) operator labels on a node: they override the agent's own "
             "and survive restarts. The facility's short keys site, room, row, rack and pdu stand for "
             "llmgw.io/site ... (rack=r12). Prints the node as it is then.")
    sp.add_argument("node", metavar="NODE", help="the node's name")
    sp.add_argument("labels", nargs="+", metavar="key=value|key-", help="set key to value, or remove key")
    sp = add("facility", cmd_facility, "failure domains with holds, replicas and power; hold or release a domain",
             "Without an action: every facility domain (from the llmgw.io/site, room, row, rack and pdu labels) "
             "with its nodes, replicas, hold, and power draw against its budget. `hold DOMAIN`: nothing new is "
             "placed there (--drain: its replicas move elsewhere first, each stopped once its replacement is "
             "ready); `release DOMAIN` ends a hold. DOMAIN is LEVEL=VALUE, e.g. rack=r12 (docs/placement.md).")
    sp.add_argument("action", nargs="?", choices=["hold", "release"], help="hold or release a domain")
    sp.add_argument("domain", nargs="?", metavar="DOMAIN", help="LEVEL=VALUE, e.g. rack=r12 or pdu=p7")
    sp.add_argument("--drain", action="store_true", help="with hold: move the domain's replicas elsewhere")
    sp.add_argument("--reason", metavar="TEXT", help="with hold: why (shown with the hold)")
    sp = add("explain-placement", cmd_explain_placement, "why a replica is on its node, or where a model's next "
             "replica would go (every node's verdict)",
             "For a replica (MODEL/ID): its node and domains and why, then every other node with the rule that "
             "refused it (held, selector, gpus, gpu_memory, memory, power, spread, not_ready) or how it ranks. "
             "For a model: the same for its next replica, or why none can be placed.")
    sp.add_argument("target", metavar="MODEL|REPLICA", help="a model's name or a replica's id")
    sp = add("models", cmd_models, "models and their replicas' readiness (or one model in detail)",
             "Models with their ready/desired replicas and why any cannot be placed. With a name: that "
             "model's readiness, then its whole definition as the config file's keys (-o json: the "
             "definition alone).")
    sp.add_argument("name", nargs="?", metavar="NAME | " + " | ".join(MODEL_ACTIONS),
                    help="one model's name: show it in detail; or update, promote, rollback, revisions with the "
                         "MODEL to act on (docs/lifecycle.md)")
    sp.add_argument("target", nargs="?", metavar="MODEL", help="with an action: the model")
    add_model_options(sp)
    register_autoscale(add)
    sp = add("replicas", cmd_replicas, "replicas placed on agents, with their engine state")
    sp.add_argument("--model", help="only this model's replicas")
    sp.add_argument("--node", help="only the replicas on this node")
    sp = add("restart", cmd_restart, "restart a replica's engine (clears a crash loop)")
    sp.add_argument("replica", metavar="REPLICA", help="the replica's id, as `llmgw ctl replicas` shows it")
    register_routing(add)
    register(add)
    register_config(add)
    register_tenants(add)
    return p


def main(argv: Sequence[str]) -> int:
    ns = parser().parse_args(list(argv))
    try:
        if (check := getattr(ns, "check", None)) is not None:  # bad input is named before connecting
            check(ns)
        api = Admin(ns)
        ns.fn(api, ns)
    except CtlError as e:
        print(f"llmgw ctl: {printable(str(e), keep_newlines=True)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    return 0
