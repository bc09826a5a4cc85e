"""The router's tenancy path per request, in process (no I/O, no engine): what
llmgw/daemon/router/tenancy.py and usage_tap.py add to a streamed request — authenticate, the
wait queue's tag, admit (403/429 checks and the charge), the body asking for usage, the usage tap
over a 20-chunk vLLM stream (its usage chunk read and stripped), and the end (settle, release,
usage counted).

    .venv/bin/python bench/bench_tenancy_path.py [--requests 10000] [--rounds 7]

Cases, interleaved round by round (the machine is shared: CPU time, medians): no tenants (an
open book), a static key, 1,000 tenants and keys with every quota, and the tap alone. The whole
router's CPU per request, before and after, is bench_router.py's (--ab-code, --api-key)."""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from llmgw.config import parse_config
from llmgw.daemon.router.tenancy import Tenancy
from llmgw.daemon.router.usage_tap import usage_tap
from llmgw.tenants import ApiKey, Quota, Tenant, TenantBook, new_key
from llmgw.tenants.keys import visible_prefix

MODEL = '[[models]]\nname = "m"\nengine = "vllm"\n[[models.replicas]]\nurl = "http://127.0.0.1:1"\n'
STATIC = "sk-bench-static-key-0123456789"
CHUNK = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
         b'"text":" tok","logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":null,'
         b'"prompt_token_ids":null}]}\n\n')
USAGE = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],'
         b'"usage":{"prompt_tokens":4,"total_tokens":24,"completion_tokens":20}}\n\n')
PIECES = [CHUNK] * 20 + [USAGE, b"data: [DONE]\n\n"]
BODY = {"model": "m", "prompt": "Tell me a story", "max_tokens": 20, "ignore_eos": True, "stream": True}
RAW = json.dumps(BODY).encode()


class Sink:
    def send_nowait(self, data: bytes, end: bool = False) -> bool:
        return True

    def flush_nowait(self) -> None:
        pass

    async def drain(self) -> None:
        pass


def request_path(t: Tenancy, header: str | None) -> Callable[[], None]:
    plan = SimpleNamespace(info=SimpleNamespace(model="m", base_model="m", adapter=None, prompt_tokens_estimate=4),
                           body=BODY, stream=True, model="m", tenant=None)
    sink = Sink()

    def one() -> None:
        p = t.authenticate(header)
        plan.tenant = t.tag(p)
        adm = t.admit(p, plan)  # type: ignore[arg-type]
        plan.tenant = t.tag(p, adm.cost)
        t.upstream_body(adm, RAW, plan)  # type: ignore[arg-type]
        tap = t.tap(adm, sink, True)
        for piece in PIECES:
            tap.send_nowait(piece)
        tap.send_nowait(b"", True)
        t.end(adm, 200)
    return one


def tap_only() -> None:
    tap = usage_tap(Sink(), stream=True, strip=True)
    for piece in PIECES:
        tap.send_nowait(piece)
    tap.send_nowait(b"", True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    tenants, keys, secret = [], [], ""
    for i in range(1000):
        s, kid, digest = new_key(secrets.token_bytes)
        tenants.append(Tenant(f"t{i}", quota=Quota(rpm=10**9, tpm=10**12, concurrency=10**6, tokens_per_day=10**15)))
        keys.append(ApiKey(id=kid, tenant=f"t{i}", hash=digest, prefix=visible_prefix(kid),
                           quota=Quota(rpm=10**9, tpm=10**12)))
        secret = secret or s
    many = Tenancy(parse_config(MODEL), time.monotonic, time.time)
    many.set_book(TenantBook(tenants, keys))
    cases: dict[str, Callable[[], Any]] = {
        "no tenants (open book)": request_path(Tenancy(parse_config(MODEL), time.monotonic, time.time), None),
        "a static key": request_path(Tenancy(parse_config(f'[server]\napi_keys = ["{STATIC}"]\n{MODEL}'),
                                             time.monotonic, time.time), f"Bearer {STATIC}"),
        "1,000 tenants and keys, every quota": request_path(many, f"Bearer {secret}"),
        "the usage tap alone": tap_only,
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    for f in cases.values():
        for _ in range(1000):
            f()
    for _ in range(a.rounds):
        for name, f in cases.items():
            t0 = time.process_time()
            for _ in range(a.requests):
                f()
            times[name].append((time.process_time() - t0) / a.requests)
    for name, v in times.items():
        print(f"{name:40s} {1e6 * statistics.median(v):6.1f} µs per streamed request (20 chunks), "
              f"median of {a.rounds} rounds (min {1e6 * min(v):.1f})")


if __name__ == "__main__":
    main()
