"""The label editor's little language, kubectl-style: ``key=value`` sets an operator label,
``key-`` removes one (a valid key never ends in "-"); several are separated by spaces or commas.
The facility's short keys (``rack=r12``, as ``llmgw ctl label`` takes them) stand for
``llmgw.io/rack``; a facility label's value must be a name. Pure, so the parsing is tested without
a terminal."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llmgw.config import label_keys
from llmgw.config.fields import facility_label_values
from llmgw.fleet.domains import expand_key, label_clash

__all__ = ["LabelEdit", "parse_label_edit"]


@dataclass(frozen=True, slots=True)
class LabelEdit:
    set: dict[str, str] = field(default_factory=dict)
    remove: list[str] = field(default_factory=list)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.set.items()] + [f"{k}-" for k in self.remove]
        return " ".join(parts)


def parse_label_edit(text: str) -> LabelEdit:
    """Raises ValueError with a message for the operator."""
    sets: dict[str, str] = {}
    removes: list[str] = []
    raw: list[str] = []  # the keys as written: `rack` and `llmgw.io/rack` together are one label twice
    for token in re.split(r"[\s,]+", text.strip()):
        if not token:
            continue
        key, eq, value = token.partition("=")
        if eq:
            if not key:
                raise ValueError(f"{token!r}: a label needs a key before '='")
            if (clash := label_clash([*raw, key])) is not None:
                raise ValueError(clash)
            raw.append(key)
            sets[expand_key(key)] = value
        elif token.endswith("-") and len(token) > 1:
            removes.append(expand_key(token[:-1]))
        else:
            raise ValueError(f"{token!r}: write key=value to set a label, key- to remove one")
    if not sets and not removes:
        raise ValueError("nothing to change: write key=value or key-")
    if (msg := label_keys({k: "" for k in [*sets, *removes]}) or facility_label_values(sets)) is not None:
        raise ValueError(msg)
    both = set(sets) & set(removes)
    if both:
        raise ValueError(f"both set and removed: {', '.join(sorted(both))}")
    return LabelEdit(sets, removes)
