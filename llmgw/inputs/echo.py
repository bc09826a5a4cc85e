"""What an error message may echo of a client's input: a bounded copy.

A client may send a ``model`` of a megabyte, a path of kilobytes, a field name of any length; an
error that quotes it whole is an amplifier (the answer, and every log line holding it, as big as
the input) and unreadable. Every place the OpenAI surface and the admin API put client input
into an error message goes through :func:`echo`: at most ``ECHO_LIMIT`` characters, then an
ellipsis and the whole length, so the reader still sees what was sent and that it was cut. Pure."""

from __future__ import annotations

__all__ = ["ECHO_LIMIT", "echo"]

ECHO_LIMIT = 100  # characters of client input an error message quotes


def echo(value: object, *, quote: str = "'", limit: int = ECHO_LIMIT) -> str:
    """``value`` as an error message quotes it: between ``quote`` marks, its first ``limit``
    characters and, when longer, ``…`` and its length after the closing mark:
    ``'aaaa…' (1048576 characters)``."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return f"{quote}{text}{quote}"
    return f"{quote}{text[:limit]}…{quote} ({len(text)} characters)"
