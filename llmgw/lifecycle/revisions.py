"""Revisions: a model has a live revision and at most one candidate. An update makes the
candidate from the live definition and the changed parts; promote makes it live (the previous
live one is kept for a rollback within the grace period); rollback discards the candidate, or
brings the previous revision back. Pure rules over plain data; the control plane applies them.

The candidate's replicas are placed under the routing key ``NAME#candidate`` (:func:`candidate_key`),
which no client request resolves to (llmgw.route.replicas): only the eval runner, with the
router's internal token, and the canary share reach them."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass
from typing import Any

from llmgw.config.names import CANDIDATE_SUFFIX, candidate_key
from llmgw.inputs.nesting import MAX_DEPTH, TooDeep, deepest, render_path, toml_loads

__all__ = ["CANDIDATE_SUFFIX", "ROLLBACK_GRACE_S", "LifecycleError", "ModelRevisions", "Revision", "candidate_key",
           "merge_definition", "parse_sets", "promote_problem", "revisions_from_dict", "rollback_action"]

ROLLBACK_GRACE_S = 3600.0  # after a promote, rollback brings the previous revision back for this long
MAX_SETS = 64


class LifecycleError(Exception):
    """A lifecycle request that cannot be done now: `status` is the HTTP status (404 no such
    thing, 409 not in this state, 400 bad input); the message says why and what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Revision:
    id: str  # "r1", "r2", … per model
    definition: dict[str, Any]  # the whole model definition (as PUT /models/{name} takes it)
    created_at: float  # Unix time
    canary: float = 0.0  # the share of the model's client traffic it takes while a candidate (0–1)
    # A rollback's revision: the id whose definition it brings back. A revision id names one
    # creation, never reused: results and jobs keyed by r1 stay r1's.
    restored_from: str = ""


@dataclass
class ModelRevisions:
    model: str
    live_id: str = "r1"
    next_number: int = 2
    candidate: Revision | None = None
    previous: Revision | None = None  # the live revision before the last promote
    promoted_at: float | None = None  # Unix time of the last promote
    live_restored_from: str = ""  # the live revision's restored_from

    def new_id(self) -> str:
        rid = f"r{self.next_number}"
        self.next_number += 1
        return rid

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def revisions_from_dict(d: dict[str, Any]) -> ModelRevisions:
    def rev(x: Any) -> Revision | None:
        if x is None:
            return None
        return Revision(str(x["id"]), dict(x["definition"]), float(x["created_at"]), float(x.get("canary", 0.0)),
                        str(x.get("restored_from", "")))
    return ModelRevisions(str(d["model"]), str(d["live_id"]), int(d["next_number"]), rev(d.get("candidate")),
                          rev(d.get("previous")), None if d.get("promoted_at") is None else float(d["promoted_at"]),
                          str(d.get("live_restored_from", "")))


def merge_definition(current: dict[str, Any], change: dict[str, Any] | None) -> dict[str, Any]:
    """The candidate's definition: `current` with `change` merged in (tables merge key by key,
    anything else is replaced). No change: the current one again (a re-roll). The name may not
    change (LifecycleError 400)."""
    if not change:
        return dict(current)
    if "name" in change and change["name"] != current.get("name"):
        raise LifecycleError(400, f"name: an update cannot rename the model ({current.get('name')!r})")
    return _merge(current, change)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """`--set key.sub=value …` as a change: each value is read as a TOML value (`4`, `true`,
    `["--x", "1"]`, `"text"`), or else taken as a string. Raises ValueError naming the pair."""
    if len(pairs) > MAX_SETS:
        raise ValueError(f"at most {MAX_SETS} --set pairs")
    out: dict[str, Any] = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        parts = key.strip().split(".")
        if not eq or not all(p.strip() for p in parts):
            raise ValueError(f"--set {pair!r}: expected key=value (key may be dotted: deploy.count=2)")
        try:
            value = toml_loads(f"v = {raw}")["v"]
        except TooDeep as e:
            raise ValueError(f"--set {key.strip()}: {e.message}") from None
        except tomllib.TOMLDecodeError:
            value = raw
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p.strip(), {})
            if not isinstance(nxt, dict):
                raise ValueError(f"--set {pair!r}: {p} is set to a value and a table")
            node = nxt
        node[parts[-1].strip()] = value
    if (path := deepest(out)) is not None:  # many dotted parts, and a value deep enough
        raise ValueError(f"--set {render_path(path)}: nested deeper than {MAX_DEPTH} levels")
    return out


def promote_problem(revs: ModelRevisions | None, *, ready: int, wanted: int, required: list[str],
                    results: dict[str, dict[str, Any] | None]) -> str | None:
    """Why the candidate cannot be made live now, or None. `ready`/`wanted`: its replicas whose
    engines are ready, of its count; `results`: each required suite's last result on any revision
    (a pass counts only when it was on this candidate)."""
    if revs is None or revs.candidate is None:
        return "no candidate to promote: `llmgw ctl models update NAME` makes one"
    cand = revs.candidate
    if ready < wanted or wanted == 0:
        return f"candidate {cand.id} has {ready}/{wanted} replicas ready; wait for them (llmgw ctl replicas)"
    for suite in required:
        r = results.get(suite)
        if r is None or r.get("revision_id") != cand.id:
            return f"suite {suite!r} has not run on candidate {cand.id}: llmgw ctl eval {revs.model} --suite {suite}"
        if not r.get("passed"):
            return (f"suite {suite!r} failed on candidate {cand.id} ({r.get('pass_rate', 0):.0%} passed, "
                    f"{r.get('threshold', 1):.0%} needed)")
    return None


def rollback_action(revs: ModelRevisions | None, now: float, grace_s: float = ROLLBACK_GRACE_S) -> str:
    """"discard" (a candidate exists), "restore" (no candidate; the previous live revision within
    the grace period after its promote), or raise LifecycleError 409."""
    if revs is not None and revs.candidate is not None:
        return "discard"
    if revs is not None and revs.previous is not None and revs.promoted_at is not None:
        if now - revs.promoted_at <= grace_s:
            return "restore"
        raise LifecycleError(409, f"nothing to roll back: the promote of {revs.live_id} was more than "
                                  f"{grace_s:.0f} s ago; update to the revision you want instead")
    raise LifecycleError(409, "nothing to roll back: no candidate, and no promote to undo")
