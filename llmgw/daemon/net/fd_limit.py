"""File descriptors: the daemon's limit, and the connection cap the OpenAI endpoint derives from it.

The common default soft limit is 1,024 while the hard limit is far higher (often 524,288 or
more): a server that does not raise it runs out of descriptors with a thousand idle
connections. ``raise_nofile_limit()`` raises the soft limit to the hard one at start (the
only change an unprivileged process may make) and says what it got.

``connection_cap(nofile)`` is what the router's HTTP server may keep open: every client
connection being proxied needs an upstream connection too, and the rest of the daemon needs
some of its own (scrapes, the admin API, agent streams, the store, KV-event sockets, log
files), so ``(nofile - RESERVE) // 2``: 384 at a limit of 1,024; about 524,000 at 1,048,576.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["RESERVE", "NofileLimit", "connection_cap", "nofile_limit", "raise_nofile_limit"]

log = logging.getLogger("llmgw.daemon")

RESERVE = 256  # descriptors kept for all but client and upstream connections
_MIN_CAP = 16
_CEILING = 1 << 20  # where the hard limit is "unlimited" (macOS), ask for this much


@dataclass(frozen=True, slots=True)
class NofileLimit:
    before: int  # the soft limit we started with
    soft: int  # the soft limit now
    hard: int


def nofile_limit() -> int:
    """The soft limit on open files now (a large figure where there is none or no way to ask)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return _CEILING
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _CEILING if soft == resource.RLIM_INFINITY else soft


def raise_nofile_limit() -> NofileLimit | None:
    """Raise the soft limit on open files to the hard limit; log and return the figures (None
    where the platform has no such limit)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _CEILING if hard == resource.RLIM_INFINITY else hard
    got = soft
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            got = want
        except (ValueError, OSError) as e:  # e.g. macOS refuses more than kern.maxfilesperproc
            log.warning("file descriptors: cannot raise the soft limit from %d to %d (%s)", soft, want, e)
    limit = NofileLimit(soft, got, hard)
    if got < 4096:
        log.warning("file descriptors: limit %d (hard limit %d): the OpenAI endpoint keeps at most %d "
                    "connections; raise the hard limit (LimitNOFILE=, ulimit -Hn) for more",
                    got, hard, connection_cap(got))
    else:
        log.info("file descriptors: limit %d (was %d; hard limit %d)", got, soft, hard)
    return limit


def connection_cap(nofile: int) -> int:
    """The client connections a router with ``nofile`` descriptors keeps open at most."""
    return max(_MIN_CAP, (nofile - RESERVE) // 2)
