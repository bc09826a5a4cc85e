"""A decision's best candidates as a fixed-size record, turned into :class:`~.types.Candidate`
objects only when someone reads them.

Every decision keeps its rationale (``ctl explain``, ``GET /decisions``, the console), but
almost none is ever read: the router makes thousands a second and shows a handful. So the
scheduler records, for its ``record_candidates`` best, only what it has already computed — the
scorer names, one short column of values per scorer, the ids, the totals and the flags — and
:class:`Ranked` builds the per-candidate ``{scorer: value}`` dicts and Candidates the first
time it is read (then keeps them). Its size is bounded by ``record_candidates`` whatever the
fleet's size: nothing of the n-long score columns is held in the decision ring.

``Ranked`` is a read-only sequence of Candidates: ``len``, indexing, iteration, and equality
with any sequence of Candidates (a list included) as its materialised list.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from .types import Candidate

__all__ = ["Ranked"]


@functools.lru_cache(maxsize=64)
def _score_dicts(names: tuple[str, ...]) -> Callable[..., list[dict[str, float]]]:
    # {name: value} per kept candidate from per-scorer columns, as one comprehension with a dict
    # display: dict(zip(names, row)) per candidate costs ~1.8x as much. The names are bound as
    # closure variables, never spliced into the source.
    k = len(names)
    n = ", ".join(f"n{i}" for i in range(k))
    c = ", ".join(f"c{i}" for i in range(k))
    x = "".join(f"x{i}, " for i in range(k))  # the trailing comma unpacks zip's 1-tuples too
    items = ", ".join(f"n{i}: x{i}" for i in range(k))
    ns: dict[str, Any] = {}
    exec(f"def bind({n}):\n    def dicts({c}):\n        return [{{{items}}} for {x} in zip({c})]\n"
         "    return dicts", ns)
    return ns["bind"](*names)


class Ranked(Sequence[Candidate]):
    """The best candidates of one decision, best first (see the module's docstring)."""

    __slots__ = ("_built", "_cols", "_flags", "_ids", "_names", "_totals")

    def __init__(self, names: tuple[str, ...], cols: list[Sequence[float]], ids: list[str], totals: list[float],
                 flags: list[tuple[str, ...]] | None) -> None:
        self._names, self._cols, self._ids, self._totals, self._flags = names, cols, ids, totals, flags
        self._built: list[Candidate] | None = None

    def _list(self) -> list[Candidate]:
        built = self._built
        if built is None:
            if self._names:
                dicts = _score_dicts(self._names)(*self._cols)
            else:
                dicts = [{} for _ in self._ids]
            flags = self._flags
            if flags is None:
                built = [Candidate(i, d, t) for i, d, t in zip(self._ids, dicts, self._totals)]
            else:
                built = [Candidate(i, d, t, f) for i, d, t, f in zip(self._ids, dicts, self._totals, flags)]
            self._built = built
            self._cols = []  # the dicts hold the values now
        return built

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, i: int) -> Candidate: ...

    @overload
    def __getitem__(self, i: slice) -> list[Candidate]: ...

    def __getitem__(self, i: int | slice) -> Candidate | list[Candidate]:
        return self._list()[i]

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ranked):
            return self._list() == other._list()
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return self._list() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a sequence compared by value

    def __repr__(self) -> str:
        return f"Ranked({self._list()!r})"
