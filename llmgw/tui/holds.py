"""The console's hold dialog language (pure, tested without a terminal): on a node,
``rack`` holds the node's rack, ``row drain PDU swap`` holds its row with drain and a reason,
``release rack`` ends the hold on its rack; a whole domain (``pdu=p7``) may be named instead of a
level. The daemon checks the rest (a domain no node is in, a reason too long)."""

from __future__ import annotations

from dataclasses import dataclass

from llmgw.fleet.domains import LEVELS, DomainError, parse_domain

__all__ = ["HoldEdit", "parse_hold_edit"]


@dataclass(frozen=True, slots=True)
class HoldEdit:
    action: str  # "hold" | "release"
    domain: str  # LEVEL=VALUE
    drain: bool = False
    reason: str = ""

    def describe(self) -> str:
        if self.action == "release":
            return f"released {self.domain}"
        return f"held {self.domain}" + (" with drain" if self.drain else "") + (f" ({self.reason})" if self.reason
                                                                                else "")


def parse_hold_edit(text: str, node_domains: list[str]) -> HoldEdit:
    """`node_domains`: the selected node's domains (LEVEL=VALUE). Raises ValueError for the operator."""
    words = text.split()
    action = "hold"
    if words and words[0] in ("hold", "release"):
        action = words.pop(0)
    if not words:
        raise ValueError("name a level of the node (site, room, row, rack, pdu) or a domain like rack=r12")
    target = words.pop(0)
    if target in LEVELS:
        domain = next((d for d in node_domains if d.startswith(target + "=")), None)
        if domain is None:
            raise ValueError(f"the node has no {target} label; its domains: {', '.join(node_domains) or 'none'}")
    else:
        try:
            domain = parse_domain(target)
        except DomainError as e:
            raise ValueError(str(e)) from None
    drain = bool(words) and words[0] == "drain"
    if drain:
        words.pop(0)
    reason = " ".join(words)
    if action == "release" and (drain or reason):
        raise ValueError("release takes only the domain")
    return HoldEdit(action, domain, drain, reason)
