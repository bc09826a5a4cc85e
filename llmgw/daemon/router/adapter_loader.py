"""LoRA adapters on demand, as I/O: vLLM's runtime API (``POST /v1/unload_lora_adapter`` to make
room, ``POST /v1/load_lora_adapter``, then ``GET /v1/models`` to see it listed) through the
router's upstream client, and the metrics of it all. What to load where is the core's
(:mod:`llmgw.route.adapter_routing`, :mod:`llmgw.route.adapters`).

One task per load (single flight: every request for the adapter waits on its event), run in the
router's own nursery so that a client that leaves does not cancel a load others wait for. Each
load ends within ``[router] adapter_load_timeout_s`` whatever the engine does; every answer is
read under a small cap; an engine's words reach the client bounded and as text. A waiter never
outlives the load by more than a second (its own deadline), and a load always reports its end
to the core exactly once (its slot becomes a holding or is given back).

Adapters the model no longer serves are unloaded here too (``POST /v1/unload_lora_adapter``),
each once it is idle: the core pokes :meth:`AdapterLoader.run`'s loop (``on_retire``), which
also looks once a second (a failed unload is tried again after its backoff)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from llmgw.daemon.net.log_limit import LogLimiter, repeats
from llmgw.daemon.net.upstream import UpstreamError, UpstreamPool, UpstreamTimeout
from llmgw.route.adapter_port import AdapterPort
from llmgw.route.adapters import LATENCY_BUCKETS, Load, Unload
from llmgw.route.plan import Plan
from llmgw.route.engine_answers import MAX_MODELS_BYTES, BadAnswer, adapters_of

log = logging.getLogger("llmgw.router")

__all__ = ["AdapterLoader", "AdapterMetrics", "MAX_ANSWER_BYTES", "MAX_REASON"]

MAX_ANSWER_BYTES = 64 << 10  # a load or unload answer (vLLM's is one line)
MAX_REASON = 300  # characters of an engine's reason passed on to a client
RETIRE_EVERY_S = 1.0  # adapters no longer served are looked for at least this often


class AdapterLoader:
    def __init__(self, port: AdapterPort, pool: UpstreamPool, wake: Callable[[Iterable[Any]], None]) -> None:
        self.port = port  # the core's adapter state machine, as RouterCore.adapter_port() offers it
        self.pool = pool
        self.wake = wake
        self.timeout = port.load_timeout_s
        self._events: dict[Load, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        self._faults = LogLimiter(60.0)
        self._retire = trio.Event()

    async def run(self) -> None:
        """The nursery loads and unloads run in (started by the daemon beside the scrape loop);
        it begins the unloads of adapters the model no longer serves."""
        port = self.port
        async with trio.open_nursery() as n:
            self._nursery = n
            port.watch_retire(self._poke)
            try:
                while True:
                    with trio.move_on_after(RETIRE_EVERY_S):
                        await self._retire.wait()
                    self._retire = trio.Event()
                    for u in port.retire_due(trio.current_time()):
                        n.start_soon(self._unload, u)
            finally:
                self._nursery = None
                port.watch_retire(None)

    def _poke(self) -> None:
        self._retire.set()

    async def _unload(self, u: Unload) -> None:
        """Unload an adapter the model no longer serves; the core takes the end (exactly once)."""
        ok, why = False, ""
        try:
            url = self.port.replica_url(u.replica)
            if url is None:
                why = "the replica is gone"
            else:
                with trio.fail_after(self.timeout):
                    status, text = await self._post(url, "/v1/unload_lora_adapter", {"lora_name": u.adapter})
                ok = status == 200 or status == 404  # 404: "cannot be found", it is gone already
                why = "" if ok else f"the engine answered {status}: {text}"
        except (trio.TooSlowError, UpstreamTimeout):
            why = f"no answer within {self.timeout:g}s"
        except UpstreamError as e:
            why = _bounded(e.public)
        except (OSError, BadAnswer) as e:
            why = _bounded(str(e) or type(e).__name__)
        except Exception as e:  # noqa: BLE001 — a bug must not leave the slot held for good
            log.exception("adapter %s on %s: unload failed", u.adapter, u.replica)
            why = f"internal error: {type(e).__name__}"
        finally:
            self.wake(self.port.unload_done(u, trio.current_time(), ok=ok))
        if ok:
            log.info("adapter %s unloaded from %s: model %s no longer serves it", u.adapter, u.replica, u.model,
                     extra={"endpoint": u.replica})
        else:
            n = self._faults.hit((u.replica, u.adapter), trio.current_time())
            if n is not None:
                log.warning("adapter %s on %s: unload failed: %s%s", u.adapter, u.replica, why, repeats(n),
                            extra={"endpoint": u.replica})

    async def wait(self, plan: Plan, ld: Load) -> None:
        """Wait for ``ld`` (starting it when nobody has); then the core says how it went (raises
        the request's error when it failed)."""
        ev = self._events.get(ld)
        if ev is None:
            ev = self._events[ld] = trio.Event()
            if self._nursery is not None:
                self._nursery.start_soon(self._load, ld, ev)
            else:  # no router nursery (an embedded router): the first waiter runs it, shielded
                with trio.CancelScope(shield=True):
                    await self._load(ld, ev)
        routing = self.port
        try:
            with trio.move_on_at(ld.started + self.timeout + 1.0):
                await ev.wait()
        except BaseException:
            routing.waited(plan, trio.current_time(), cancelled=True)
            raise
        routing.waited(plan, trio.current_time())

    async def _load(self, ld: Load, ev: trio.Event) -> None:
        routing = self.port
        failure: tuple[str, int, str] | None = None
        try:
            with trio.fail_after(self.timeout):
                failure = await self._calls(ld)
        except (trio.TooSlowError, UpstreamTimeout):
            failure = (f"no answer within {self.timeout:g}s", 504, "timeout")
        except UpstreamError as e:  # its message may name the engine's address: the client gets .public
            log.debug("adapter %s on %s: %s", ld.adapter, ld.replica, e)
            failure = (_bounded(e.public), 502, "failed")
        except (OSError, BadAnswer) as e:
            failure = (_bounded(str(e) or type(e).__name__), 502, "failed")
        except Exception as e:  # noqa: BLE001 — a bug must not leave the slot or the waiters stuck
            log.exception("adapter %s on %s: load failed", ld.adapter, ld.replica)
            failure = (f"internal error: {type(e).__name__}", 500, "failed")
        finally:
            now = trio.current_time()
            if ld.unload is not None and not ld.unload_reported:
                routing.unloaded(ld, now, ok=False)
            self.wake(routing.load_done(ld, now, failure))
            self._events.pop(ld, None)
            ev.set()
        if failure is None:
            log.info("adapter %s loaded on %s in %.2fs%s", ld.adapter, ld.replica, trio.current_time() - ld.started,
                     f" (unloaded {ld.unload})" if ld.unload else "", extra={"endpoint": ld.replica})
        else:
            n = self._faults.hit((ld.replica, ld.adapter), trio.current_time())
            if n is not None:
                log.warning("adapter %s on %s: load failed (%s): %s%s", ld.adapter, ld.replica, failure[2],
                            failure[0], repeats(n), extra={"endpoint": ld.replica})

    async def _calls(self, ld: Load) -> tuple[str, int, str] | None:
        target = self.port.load_target(ld)
        if target is None:
            return ("the replica or the adapter's declaration is gone", 503, "failed")
        url, source = target
        if ld.unload is not None:
            status, text = await self._post(url, "/v1/unload_lora_adapter", {"lora_name": ld.unload})
            ok = status == 200 or status == 404  # 404: "cannot be found", it is gone already
            ld.unload_reported = True
            self.port.unloaded(ld, trio.current_time(), ok=ok)
            if not ok:
                return (f"unloading {ld.unload!r} to make room: the engine answered {status}: {text}", 502, "failed")
        status, text = await self._post(url, "/v1/load_lora_adapter", {"lora_name": ld.adapter,
                                                                        "lora_path": source})
        if status != 200 and not (status == 400 and "already been loaded" in text):
            return (f"the engine answered {status}: {text}", 502, "failed")
        reply = await self.pool.request(url, "GET", "/v1/models", connect_timeout=self.timeout,
                                        first_byte_timeout=self.timeout, idle_timeout=self.timeout,
                                        max_body_bytes=MAX_MODELS_BYTES)
        if reply.status != 200:
            return (f"/v1/models answered {reply.status} after the load", 502, "not_listed")
        if ld.adapter not in adapters_of(reply.body):
            return ("the engine answered 200 but does not list the adapter afterwards", 502, "not_listed")
        return None

    async def _post(self, url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
        """POST a runtime LoRA call: the status and the engine's reason (its error message, or its
        plain-text answer), bounded."""
        reply = await self.pool.request(url, "POST", path, [("content-type", "application/json")],
                                        json.dumps(body).encode(), connect_timeout=self.timeout,
                                        first_byte_timeout=self.timeout, idle_timeout=self.timeout,
                                        max_body_bytes=MAX_ANSWER_BYTES)
        return reply.status, _reason(reply.body)


def _reason(body: bytes) -> str:
    """An engine's answer in words: its error envelope's message (0.10.1+ nested, 0.10.0 flat),
    else the body as text; bounded, printable."""
    text = body.decode("utf-8", errors="replace")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        inner = obj.get("error") if isinstance(obj.get("error"), dict) else obj
        msg = inner.get("message")
        if isinstance(msg, str):
            text = msg
    return _bounded(text.strip())


def _bounded(text: str) -> str:
    text = "".join(c if c.isprintable() else " " for c in text[:MAX_REASON * 2])
    return text if len(text) <= MAX_REASON else text[:MAX_REASON - 1] + "…"


class AdapterMetrics(Collector):
    """llmgw_adapters_loaded{replica}, llmgw_adapter_loads_total{outcome},
    llmgw_adapter_unloads_total{outcome}, llmgw_adapter_load_seconds,
    llmgw_adapter_load_waiting, llmgw_adapter_load_waits_total."""

    def __init__(self, port: AdapterPort) -> None:
        self.port = port

    def collect(self) -> Iterable[Metric]:
        book = self.port.book()
        g = GaugeMetricFamily("llmgw_adapters_loaded", "LoRA adapters the router counts as loaded on each vLLM "
                              "replica (its loads in progress included).", labels=["replica"])
        for rid, h in sorted(book.replicas.items()):
            g.add_metric([rid], float(h.used()))
        yield g
        c = CounterMetricFamily("llmgw_adapter_loads", "LoRA adapter loads by outcome (ok, failed, timeout, "
                                "not_listed: answered 200 but not listed afterwards).", labels=["outcome"])
        for o, n in book.loads_total.items():
            c.add_metric([o], float(n))
        yield c
        c = CounterMetricFamily("llmgw_adapter_unloads", "LoRA adapter unloads (to make room, or of an adapter "
                                "the model no longer serves) by outcome.",
                                labels=["outcome"])
        for o, n in book.unloads_total.items():
            c.add_metric([o], float(n))
        yield c
        h = HistogramMetricFamily("llmgw_adapter_load_seconds", "Time a LoRA adapter load took, the unload "
                                  "that made room included (every outcome).")
        acc, buckets = 0, []
        for le, n in zip([str(b) for b in LATENCY_BUCKETS] + ["+Inf"], book.latency_counts):
            acc += n
            buckets.append((le, float(acc)))
        h.add_metric([], buckets, book.latency_sum)
        yield h
        yield GaugeMetricFamily("llmgw_adapter_load_waiting", "Requests waiting for a LoRA adapter load.",
                                value=float(book.waiting()))
        yield CounterMetricFamily("llmgw_adapter_load_waits", "Requests that waited for a LoRA adapter load "
                                  "(one that waited for two loads counts twice).", value=float(book.waits_total))
