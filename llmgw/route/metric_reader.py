"""One replica's /metrics readings, read as cheaply as the engine allows.

Pure: a body in, a :class:`~llmgw.route.contract.ScrapeResult` out — the same result
:func:`~llmgw.route.contract.scrape` gives for that body, with the work skipped that cannot change
it:

- a body byte for byte the last one (an idle llama.cpp's) is not looked at again: the last result
  is the answer (bodies up to ``KEEP_BODY_BYTES`` are kept for the comparison; a vLLM body is
  never the same twice, its http_requests_total counts every read of /metrics);
- otherwise only the lines the contract reads are picked out (``prom.select``, one scan of the
  body), and when they are the last reading's lines the last result is the answer again: nothing
  is parsed or evaluated (an idle vLLM: its gauges and counters stand still).

``changed`` says whether the last :meth:`MetricReader.read` gave a new result object; a reused
result is the same object, so ``result is previous`` tells a caller that nothing the contract
reads has moved. Results are shared between readings: callers must not change them.
The reading is still a fresh reading: the caller keeps its own time stamps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .contract import NameOverrides, ScrapeResult, contract_for, evaluate
from .prom import NotPrometheusText, parse_selected, select

__all__ = ["MetricReader", "KEEP_BODY_BYTES"]

KEEP_BODY_BYTES = 16 << 10  # a body this small is kept for the byte-for-byte check (512 replicas: 8 MB)


class MetricReader:
    """The readings of one replica's /metrics against its engine's contract (with the model's
    name overrides). A reader whose engine kind or overrides change starts afresh
    (:meth:`for_engine`)."""

    __slots__ = ("kind", "overrides", "_names", "_body", "_lines", "result", "changed")

    def __init__(self, kind: str, overrides: NameOverrides | Mapping[str, Any] | None) -> None:
        self.kind, self.overrides = kind, overrides
        self._names = contract_for(kind, overrides).names()  # an unknown kind raises here, as scrape() does
        self._body: bytes | None = None  # the last body, when small
        self._lines: list[str] | None = None  # the contract's lines of the last body that parsed
        self.result: ScrapeResult | None = None
        self.changed = True

    def for_engine(self, kind: str, overrides: NameOverrides | Mapping[str, Any] | None) -> MetricReader:
        """This reader, or a new one when the engine kind or the overrides are not the ones it reads by."""
        if kind == self.kind and overrides is self.overrides:
            return self
        return MetricReader(kind, overrides)

    def read(self, body: bytes | str) -> ScrapeResult:
        """Evaluate one /metrics body (never raises for what the body holds: a body that is not
        Prometheus text is an error on the result, as with ``scrape``)."""
        last = self.result
        if last is not None and self._body is not None and body == self._body:
            self.changed = False
            return last
        keep = body if isinstance(body, bytes) and len(body) <= KEEP_BODY_BYTES else None
        try:
            lines = select(body, self._names)
            if lines and lines == self._lines and last is not None:
                self._body, self.changed = keep, False
                return last
            result = evaluate(self.kind, self.overrides, parse_selected(lines, self._names, body))
        except NotPrometheusText as e:
            result, lines = ScrapeResult(kind=self.kind, errors=[f"not Prometheus text: {e}"]), []
        self._body, self._lines = keep, lines or None
        self.result, self.changed = result, True
        return result
