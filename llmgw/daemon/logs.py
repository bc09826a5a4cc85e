"""How `llmgw daemon` and `llmgw sim` log: readable lines for a person at a terminal, JSON lines
for machines (a journal, a log shipper, a test reading stderr through a pipe).

- ``text``: ``14:03:07.512 INFO  router: request ok request_id=… model=m status=200 ttft_ms=41.2``
  — local time to the millisecond, the level, the logger without its ``llmgw.`` prefix, the
  message, then the structured extras the access log passes, as ``key=value``;
- ``json``: one object per line — ``ts`` (Unix seconds), ``level``, ``logger``, ``msg``, the
  same extras as keys, and ``exc`` with a traceback.

``auto`` (the default; or ``$LLMGW_LOG_FORMAT``) is text when stderr is a terminal, JSON otherwise. The level comes from
``--log-level``, else ``$LLMGW_LOG_LEVEL``, else the command's default; a level that is not one of
:data:`LEVELS` is refused with a message naming where it came from."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import IO, Any

__all__ = [
    "FORMATS",
    "LEVELS",
    "LEVEL_ENV",
    "JsonFormatter",
    "LogSetupError",
    "TextFormatter",
    "env_format",
    "env_level",
    "pick_format",
    "setup_logging",
]

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("auto", "text", "json")
LEVEL_ENV = "LLMGW_LOG_LEVEL"
FORMAT_ENV = "LLMGW_LOG_FORMAT"

# What a log record may carry besides its message (the access log's fields, a replica's id).
# `worker`: which of `llmgw daemon --workers N`'s processes logged it (daemon/workers.py tag_logs).
EXTRAS = ("request_id", "model", "endpoint", "status", "outcome", "ttft_ms", "latency_ms", "replica", "worker")


_LOWER = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error",
          logging.CRITICAL: "critical"}
_encode = json.JSONEncoder().encode  # json.dumps' own default encoder, without its argument checks


class LogSetupError(Exception):
    """A level or format that cannot be used; str() names where it came from and the choices."""


class JsonFormatter(logging.Formatter):
    """One JSON object per line: structured logs that carry the request id where there is one."""

    def format(self, record: logging.LogRecord) -> str:
        # The access log writes one of these a request: plain dict lookups, one encoder call.
        msg = record.msg if not record.args else record.getMessage()
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": _LOWER[record.levelno]
                               if record.levelno in _LOWER else record.levelname.lower(),
                               "logger": record.name, "msg": msg if type(msg) is str else str(msg)}
        d = record.__dict__
        for key in EXTRAS:
            if key in d:
                out[key] = d[key]
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return _encode(out)


class TextFormatter(logging.Formatter):
    """``HH:MM:SS.mmm LEVEL logger: message key=value …`` for a person reading a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.localtime(record.created)
        name = record.name.removeprefix("llmgw.")
        parts = [f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.{int(record.msecs):03d}",
                 f"{record.levelname:<7}", f"{name}:", record.getMessage()]
        for key in EXTRAS:
            value = getattr(record, key, None)
            if value is not None:
                parts.append(f"{key}={_compact(value)}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _compact(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text)
    return text


def env_level(env: Mapping[str, str], default: str) -> str:
    """The level $LLMGW_LOG_LEVEL asks for (any case), else ``default``; LogSetupError if it is
    not one of LEVELS."""
    raw = env.get(LEVEL_ENV)
    if raw is None or raw.strip() == "":
        return default
    level = raw.strip().lower()
    if level not in LEVELS:
        raise LogSetupError(f"${LEVEL_ENV}={raw!r}: expected one of {', '.join(LEVELS)}")
    return level


def env_format(env: Mapping[str, str]) -> str:
    """The format $LLMGW_LOG_FORMAT asks for, else ``auto``; LogSetupError if it is not one of FORMATS."""
    raw = env.get(FORMAT_ENV)
    if raw is None or raw.strip() == "":
        return "auto"
    fmt = raw.strip().lower()
    if fmt not in FORMATS:
        raise LogSetupError(f"${FORMAT_ENV}={raw!r}: expected one of {', '.join(FORMATS)}")
    return fmt


def pick_format(fmt: str, stream: IO[str]) -> str:
    """``text`` or ``json``: ``auto`` is text when ``stream`` is a terminal."""
    if fmt != "auto":
        return fmt
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError, OSError):  # a closed or odd stream: machines read it
        return "json"


def setup_logging(level: str, fmt: str, stream: IO[str]) -> str:
    """Route the root logger to ``stream`` at ``level`` in ``fmt`` (see pick_format); answers the
    format chosen."""
    chosen = pick_format(fmt, stream)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter() if chosen == "text" else JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # What no formatter here shows, the logging module need not find out for every record (the
    # logging HOWTO's "Optimization"): the caller's file and line (a walk up the stack), the
    # thread, the process. The access log's record a request costs a third less.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    return chosen
