"""Failure domains: the facility labels of a node, read as nested domains.

A node labelled ``llmgw.io/site=fra``, ``llmgw.io/row=r3``, ``llmgw.io/rack=r12``, ``llmgw.io/pdu=p7``
sits in the domains ``site=fra``, ``row=r3``, ``rack=r12`` and ``pdu=p7`` — outermost first (site,
room, row, rack, pdu). A domain is named ``LEVEL=VALUE`` (the short key; ``llmgw.io/rack=r12`` is
the same domain), so a value names one domain per level: two racks called ``r12`` in different rows
are one domain to placement. A node without a level's label is in no domain of that level.

Pure: no I/O. Used by placement (spread, holds, power budgets), the control plane (holds, the
facility listing) and ``llmgw ctl`` (short label keys).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from llmgw.inputs.echo import echo

__all__ = ["LABEL_PREFIX", "LEVELS", "DomainError", "check_label_value", "domain_key", "expand_key",
           "expand_labels", "label_clash", "node_domains", "parse_domain"]

LABEL_PREFIX = "llmgw.io/"
LEVELS: tuple[str, ...] = ("site", "room", "row", "rack", "pdu")  # outermost first
_LEVEL_KEYS = {f"{LABEL_PREFIX}{lv}": lv for lv in LEVELS}
# A facility label's value: what a domain is named by (and printed as) — no spaces, no '=' or '/'.
_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class DomainError(ValueError):
    """A domain name that does not parse, or that no node is in (the message says which exist)."""


def expand_key(key: str) -> str:
    """A label key as stored: the short facility keys (``rack``) become ``llmgw.io/rack``."""
    k = key.strip()
    return f"{LABEL_PREFIX}{k}" if k in LEVELS else k


def expand_labels(labels: dict[str, str]) -> dict[str, str]:
    """Labels as stored: every key through :func:`expand_key` (what `ctl label`, the console and an
    agent's `[agent] labels` all do)."""
    return {expand_key(k): v for k, v in labels.items()}


def label_clash(keys: Iterable[str]) -> str | None:
    """Why these label keys cannot be set together: two of them (``rack`` and ``llmgw.io/rack``)
    name the same label once expanded. None: they can."""
    seen: dict[str, str] = {}
    for k in keys:
        full = expand_key(k)
        if full in seen:
            return f"{seen[full]!r} and {k!r} are the same label ({full}): give it once"
        seen[full] = k
    return None


def check_label_value(key: str, value: str) -> str | None:
    """Why a facility label's value is bad (None: fine, or not a facility label)."""
    if key in _LEVEL_KEYS and not _VALUE.fullmatch(value):
        return (f"label {key}={value!r}: a facility label's value is 1-63 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit")
    return None


def domain_key(level: str, value: str) -> str:
    return f"{level}={value}"


def node_domains(labels: dict[str, str]) -> tuple[str, ...]:
    """The node's domain at each level of LEVELS, in order ("" where it has no such label, or one
    whose value is not a valid name: the config and the admin API refuse those, an agent's are ignored)."""
    return tuple(domain_key(lv, v) if (v := labels.get(LABEL_PREFIX + lv)) and _VALUE.fullmatch(v) else ""
                 for lv in LEVELS)


def parse_domain(text: str, known: Iterable[str] | None = None) -> str:
    """``rack=r12`` or ``llmgw.io/rack=r12`` → ``rack=r12``. With `known` (the domains nodes are in),
    a domain not among them is refused, naming them (the first 20)."""
    key, eq, value = text.strip().partition("=")
    key = key.strip()
    level = _LEVEL_KEYS.get(key, key)
    if not eq or level not in LEVELS:
        raise DomainError(f"domain {echo(text)}: expected LEVEL=VALUE with LEVEL one of {', '.join(LEVELS)} "
                          "(e.g. rack=r12)")
    value = value.strip()
    if not _VALUE.fullmatch(value):
        raise DomainError(f"domain {echo(text)}: the value must be 1-63 letters, digits, '.', '_' or '-'")
    d = domain_key(level, value)
    if known is not None:
        names = sorted(set(known))
        if d not in names:
            same = [n for n in names if n.startswith(level + "=")] or names
            listed = ", ".join(same[:20]) + (f" (and {len(same) - 20} more)" if len(same) > 20 else "")
            raise DomainError(f"no node is in domain {d}; known: {listed or 'none (no node has facility labels)'}")
    return d
