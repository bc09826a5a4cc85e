"""Incremental output text with stop strings, as vLLM's detokenizer does it: text that could be
the start of a stop string is held back until it is known not to be one, and the stop string
itself is cut from the output unless the request asks to keep it."""

from __future__ import annotations

__all__ = ["TextStream"]


class TextStream:
    __slots__ = ("stops", "keep_stop", "_text", "_sent", "_hold", "stopped_on")

    def __init__(self, stops: tuple[str, ...] = (), keep_stop: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.keep_stop = keep_stop
        self._text = ""
        self._sent = 0
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.stopped_on: str | None = None

    @property
    def text(self) -> str:
        """The full output text so far (after a stop: cut as the response will show it)."""
        return self._text

    def feed(self, piece: str) -> str:
        """Add decoded text; return what can be sent now ('' while it could still be a stop)."""
        if self.stopped_on is not None:
            return ""
        start = max(0, len(self._text) - self._hold)
        self._text += piece
        for s in self.stops:
            i = self._text.find(s, start)
            if i >= 0:
                self.stopped_on = s
                self._text = self._text[: i + len(s)] if self.keep_stop else self._text[:i]
                return self._flush(len(self._text))
        return self._flush(len(self._text) - self._hold if self.stops else len(self._text))

    def finish(self) -> str:
        """The request ended: release whatever was held back."""
        return self._flush(len(self._text))

    def _flush(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out = self._text[self._sent : upto]
        self._sent = upto
        return out
