"""The manual: the pages of docs/, shipped inside the package, for `llmgw help [TOPIC]`.

docs/ is the one source. Building the package (setup.py) copies its pages into
``llmgw/manual/pages/``; an installed llmgw reads them there, and a source checkout (or an
editable install), which has no copy, reads docs/ beside the package. A topic is a page's file
name without ``.md`` (``router``, ``admin-api``)."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Topic", "UnknownTopic", "pages_dir", "read", "topics"]

SHIPPED = Path(__file__).resolve().parent / "pages"
SOURCE = Path(__file__).resolve().parents[2] / "docs"
_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


class UnknownTopic(LookupError):
    """No page of that name; the message lists the close ones, or says how to list them all."""


@dataclass(frozen=True, slots=True)
class Topic:
    name: str
    title: str  # the page's first heading
    path: Path


def pages_dir() -> Path | None:
    """Where the pages are: the package's copy, else the source tree's docs/ (None: neither)."""
    for d in (SHIPPED, SOURCE):
        if d.is_dir() and any(d.glob("*.md")):
            return d
    return None


def _title(path: Path) -> str:
    try:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.startswith("# "):
                    return line[2:].strip()
    except (OSError, UnicodeDecodeError):
        pass
    return path.stem


def topics() -> list[Topic]:
    d = pages_dir()
    if d is None:
        return []
    return [Topic(p.stem, _title(p), p) for p in sorted(d.glob("*.md")) if _NAME.fullmatch(p.stem)]


def read(name: str) -> str:
    """The page of topic ``name`` (a name as `llmgw help` lists it; ``.md`` may be added)."""
    name = name.strip().lower().removesuffix(".md")
    known = {t.name: t for t in topics()}
    t = known.get(name)
    if t is None:
        if not known:
            raise UnknownTopic("this llmgw was installed without its manual (no llmgw/manual/pages, no docs/)")
        close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise UnknownTopic(f"no help topic {name[:80]!r}{hint} (`llmgw help` lists them)")
    return t.path.read_text(encoding="utf-8")
