"""The console's admin-API client (httpx on asyncio: the console is its own process, and Textual
runs on asyncio) and the loop that keeps it on the event stream across daemon restarts.

Over the Unix socket no token is needed (the daemon checks the peer's uid); over TCP every
request carries ``Authorization: Bearer <token>``. Transport failures become DaemonUnreachable
and HTTP errors AdminRefused, each with a message fit for the console's banner."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import httpx

__all__ = ["AdminAPI", "AdminClient", "AdminError", "AdminRefused", "Backoff", "DaemonUnreachable", "follow"]

PREFIX = "/api/v1"
# The daemon pings every ~5 s: three missed pings and the stream is taken for dead.
IDLE_TIMEOUT_S = 15.0


class AdminError(Exception):
    """The admin API could not answer; str() is the reason, ready to show."""


class DaemonUnreachable(AdminError):
    """No connection, or the connection dropped."""


class AdminRefused(AdminError):
    """The daemon answered with an error status (a bad token, an invalid label...)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class AdminAPI(Protocol):
    """What the console needs of a daemon; tests hand it a fake with canned event lines."""

    where: str  # for the banner, e.g. "unix:/run/user/1000/llmgw-1000/admin.sock"

    def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """One connection to /events: its parsed lines; raises AdminError when it fails or drops."""
        ...

    async def set_labels(self, node: str, labels: dict[str, str]) -> dict[str, Any]: ...

    async def remove_labels(self, node: str, keys: list[str]) -> dict[str, Any]: ...

    async def trace(self, request_id: str) -> dict[str, Any]: ...

    async def hold(self, domain: str, reason: str, drain: bool) -> dict[str, Any]: ...

    async def release(self, domain: str) -> dict[str, Any]: ...

    async def facility(self) -> dict[str, Any]:
        """Domains with holds, replicas and draw vs cap (GET /api/v1/facility)."""
        return await self._call("GET", "/facility", None)

    async def explain_placement(self, target: str) -> dict[str, Any]: ...

    async def tenants(self) -> list[dict[str, Any]]:
        """Every tenant with its keys, today's use, quota use and queue share (GET /api/v1/tenants)."""
        ...

    async def autoscale(self) -> list[dict[str, Any]] | None:
        """The autoscaled models (GET /api/v1/autoscale); None from a daemon without the route."""
        ...

    # the model lifecycle (the Lifecycle view; docs/lifecycle.md)
    async def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """Any GET under /api/v1 (the Lifecycle view's jobs, revisions, suites)."""
        ...

    async def update_model(self, model: str) -> dict[str, Any]: ...

    async def eval_model(self, model: str, suite: str, revision: str) -> dict[str, Any]: ...

    async def promote(self, model: str, require_suites: list[str]) -> dict[str, Any]: ...

    async def rollback(self, model: str) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


def _reason(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, httpx.TimeoutException):
        return f"no answer in time ({text})"
    return text


def _error_message(r: httpx.Response) -> str:
    """The message of the daemon's OpenAI-style error envelope, or the bare status text."""
    try:
        body = r.json()
        msg = body["error"]["message"]
        if isinstance(msg, str) and msg:
            return msg
    except (ValueError, KeyError, TypeError):
        pass
    return r.reason_phrase or "error"


class AdminClient:
    def __init__(self, *, socket: str | None = None, url: str | None = None, token: str | None = None,
                 timeout_s: float = 5.0, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        if (socket is None) == (url is None):
            raise ValueError("give exactly one of socket= and url=")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        if socket is not None:
            self.where = f"unix:{socket}"
            transport = httpx.AsyncHTTPTransport(uds=socket)
            # the host is a placeholder: the socket decides where requests go
            self._http = httpx.AsyncClient(transport=transport, base_url="http://llmgw", headers=headers,
                                           timeout=timeout_s)
        else:
            assert url is not None
            self.where = url.rstrip("/")
            self._http = httpx.AsyncClient(base_url=self.where, headers=headers, timeout=timeout_s)
        self._stream_timeout = httpx.Timeout(timeout_s, read=idle_timeout_s)

    async def events(self) -> AsyncGenerator[dict[str, Any], None]:
        try:
            async with self._http.stream("GET", f"{PREFIX}/events", timeout=self._stream_timeout) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise AdminRefused(r.status_code, _error_message(r))
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue  # one garbled line is not worth a reconnection
                    if isinstance(obj, dict):
                        yield obj
        except httpx.HTTPError as e:
            raise DaemonUnreachable(_reason(e)) from e
        except OSError as e:
            raise DaemonUnreachable(_reason(e)) from e

    async def _request(self, method: str, path: str, body: Any, params: dict[str, Any] | None = None) -> Any:
        try:
            r = await self._http.request(method, f"{PREFIX}{path}", json=body,
                                         params={k: v for k, v in (params or {}).items() if v is not None})
        except (httpx.HTTPError, OSError) as e:
            raise DaemonUnreachable(_reason(e)) from e
        if r.status_code >= 400:
            raise AdminRefused(r.status_code, _error_message(r))
        try:
            return r.json() if r.content else {}
        except ValueError as e:
            raise DaemonUnreachable(f"the daemon's answer is not JSON ({e})") from e

    async def _call(self, method: str, path: str, body: Any) -> dict[str, Any]:
        out = await self._request(method, path, body)
        return out if isinstance(out, dict) else {}

    async def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        return await self._request("GET", path, None, params)

    async def update_model(self, model: str) -> dict[str, Any]:
        """A re-roll: a candidate of the model's current definition (the update job)."""
        return await self._call("POST", f"/models/{quote(model, safe='')}/update", None)

    async def eval_model(self, model: str, suite: str, revision: str) -> dict[str, Any]:
        return await self._call("POST", f"/models/{quote(model, safe='')}/eval", {"suite": suite, "revision": revision})

    async def promote(self, model: str, require_suites: list[str]) -> dict[str, Any]:
        return await self._call("POST", f"/models/{quote(model, safe='')}/promote", {"require_suites": require_suites})

    async def rollback(self, model: str) -> dict[str, Any]:
        return await self._call("POST", f"/models/{quote(model, safe='')}/rollback", None)

    async def set_labels(self, node: str, labels: dict[str, str]) -> dict[str, Any]:
        return await self._call("PUT", f"/nodes/{quote(node, safe='')}/labels", {"labels": labels})

    async def remove_labels(self, node: str, keys: list[str]) -> dict[str, Any]:
        return await self._call("DELETE", f"/nodes/{quote(node, safe='')}/labels", {"keys": keys})

    async def trace(self, request_id: str) -> dict[str, Any]:
        """A request's trace (AdminRefused 404 once it has left the router's ring)."""
        return await self._call("GET", f"/traces/{quote(request_id, safe='')}", None)

    async def hold(self, domain: str, reason: str, drain: bool) -> dict[str, Any]:
        return await self._call("PUT", f"/facility/holds/{quote(domain, safe='=')}", {"reason": reason, "drain": drain})

    async def release(self, domain: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/facility/holds/{quote(domain, safe='=')}", None)

    async def facility(self) -> dict[str, Any]:
        """Domains with holds, replicas and draw vs cap (GET /api/v1/facility)."""
        return await self._call("GET", "/facility", None)

    async def explain_placement(self, target: str) -> dict[str, Any]:
        return await self._call("GET", f"/placement/{quote(target, safe='')}", None)

    async def tenants(self) -> list[dict[str, Any]]:
        """Every tenant with its keys, today's use, quota use and queue share (GET /api/v1/tenants)."""
        got = await self._request("GET", "/tenants", None, None)
        return got if isinstance(got, list) else []

    async def autoscale(self) -> list[dict[str, Any]] | None:
        """The autoscaled models (GET /api/v1/autoscale); None from a daemon older than autoscaling
        (its 404), so the console shows nothing extra rather than an error."""
        try:
            got = await self._request("GET", "/autoscale", None, None)
        except AdminRefused as e:
            if e.status == 404:
                return None
            raise
        return got if isinstance(got, list) else []

    async def aclose(self) -> None:
        await self._http.aclose()


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delay before reconnection attempt N (1-based): doubling from ``first`` up to ``cap``. A
    restarted daemon is back within seconds, so the cap stays short."""

    first: float = 0.25
    factor: float = 2.0
    cap: float = 5.0

    def delay(self, attempt: int) -> float:
        return min(self.cap, self.first * self.factor ** max(0, attempt - 1))


class _Delays(Protocol):
    def delay(self, attempt: int) -> float: ...


async def follow(client: AdminAPI, on_event: Callable[[dict[str, Any]], None],
                 on_lost: Callable[[int, str], None], backoff: _Delays = Backoff()) -> None:
    """Stay on the event stream forever: every line goes to ``on_event``; each failed or dropped
    connection to ``on_lost(attempt, reason)``, then a backoff delay and a new connection (whose
    first line, a snapshot, resets the count). Returns only by cancellation."""
    attempt = 0
    while True:
        try:
            async with aclosing(client.events()) as stream:
                async for event in stream:
                    if event.get("type") == "snapshot":
                        attempt = 0
                    on_event(event)
            reason = "the daemon closed the event stream"
        except AdminError as e:
            reason = str(e)
        attempt += 1
        on_lost(attempt, reason)
        await asyncio.sleep(backoff.delay(attempt))
