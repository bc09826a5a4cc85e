"""What tenants cost a request in the pure core: authenticate + admit + settle + release, in µs,
with 1,000 tenants and 1,000 keys against a book with none (and with one static key).

    python bench/bench_tenants_core.py [--n 200000] [--tenants 1000]

Each request presents a different key, picked at random among the thousand (so dict lookups
are not all in cache). "quotas" gives every tenant rpm, tpm, concurrency and a daily budget and
every key an rpm limit, all high enough that nothing is refused; "no quotas" has the tenants and
keys but no limits. A second part simulates N routers sharing an rpm limit by their demands
(``shares``) and prints the most any 60 s window admitted, against the limit and the bound."""

from __future__ import annotations

import argparse
import random
import time

from llmgw.tenants import Limiter, Quota, QuotaRefused, Tenant, TenantBook, share_bound, shares
from llmgw.tenants.keys import new_key, visible_prefix
from llmgw.tenants.model import ApiKey

WALL = 1_796_083_200.0


def _book(n: int, quotas: bool) -> tuple[TenantBook, list[str]]:
    rng = random.Random(1)
    tq = Quota(rpm=10**9, tpm=10**12, concurrency=10**6, tokens_per_day=10**15) if quotas else Quota()
    kq = Quota(rpm=10**9) if quotas else Quota()
    tenants = [Tenant(f"t{i}", quota=tq) for i in range(n)]
    keys, secrets = [], []
    for i in range(n):
        s, kid, h = new_key(lambda k: bytes(rng.getrandbits(8) for _ in range(k)))
        keys.append(ApiKey(id=kid, tenant=f"t{i}", hash=h, prefix=visible_prefix(kid), quota=kq))
        secrets.append(f"Bearer {s}")
    return TenantBook(tenants, keys), secrets


def _run(book: TenantBook, headers: list[str | None], n: int) -> float:
    """µs per request (best of 5 rounds of n)."""
    lim = Limiter()
    lim.set_book(book)
    rng = random.Random(2)
    order = [headers[rng.randrange(len(headers))] for _ in range(n)]
    best = []
    for _ in range(5):
        now = 0.0
        t0 = time.perf_counter()
        for h in order:
            now += 0.000001
            p = book.authenticate(h, WALL)
            g = lim.admit(p, 1100, now, WALL)
            lim.settle(g, 900, now, WALL)
            lim.release(g)
        best.append((time.perf_counter() - t0) / n * 1e6)
    return min(best)


def _cost(n: int, tenants: int) -> None:
    none = TenantBook([], [])
    static = TenantBook([], [], static_keys=["a-static-key-of-the-config"])
    plain, plain_h = _book(tenants, quotas=False)
    limited, limited_h = _book(tenants, quotas=True)
    rows = [("no tenants (open book)", _run(none, [None], n)),
            ("one static key", _run(static, ["Bearer a-static-key-of-the-config"], n)),
            (f"{tenants} tenants + {tenants} keys, no quotas", _run(plain, plain_h, n)),
            (f"{tenants} tenants + {tenants} keys, quotas", _run(limited, limited_h, n))]
    base = rows[0][1]
    print(f"authenticate + admit + settle + release, best of 5 × {n} requests")
    for name, us in rows:
        print(f"  {name:<44} {us:7.2f} µs   (+{us - base:5.2f} µs over none)")
    t0 = time.perf_counter()
    _book(tenants, quotas=True)
    print(f"  building a book of {tenants} tenants + {tenants} keys: {(time.perf_counter() - t0) * 1e3:.1f} ms "
          "(key generation included)")


def _routers(limit: int, n_routers: int, seconds: float, seed: int, pattern: str) -> tuple[int, float]:
    """N routers, an rpm limit shared by demand (synced every 2 s), clients asking 5× the limit:
    the most admitted in any 60 s window, and the long-run rate per minute."""
    book = TenantBook([Tenant("a", quota=Quota(rpm=limit))], [], anonymous_tenant="a")
    names = [f"r{i}" for i in range(n_routers)]
    lims = {r: Limiter() for r in names}
    for lim in lims.values():
        lim.set_book(book)
    rng = random.Random(seed)
    rate = 5 * limit / 60  # requests per second asked, all routers
    now, next_sync, times = 0.0, 2.0, []
    while now < seconds:
        now += rng.expovariate(rate)
        while now >= next_sync:
            demands = {r: lims[r].demand(next_sync) for r in names}
            for r in names:
                lims[r].set_shares(shares([("tenant", "a")], r, demands, names), now=next_sync)
            next_sync += 2.0
        if pattern == "uniform":
            r = names[rng.randrange(n_routers)]
        elif pattern == "one":
            r = names[0]
        else:  # "switch": all to one router, moving to the next every 45 s
            r = names[int(now // 45) % n_routers]
        try:
            lims[r].admit(book.anonymous, 1, now, WALL)
        except QuotaRefused:
            continue
        times.append(now)
    most, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - 60:
            j += 1
        most = max(most, i - j + 1)
    steady = [t for t in times if t >= 120]
    return most, len(steady) / ((seconds - 120) / 60)


def _bound(limit: int) -> None:
    print(f"\nseveral routers sharing rpm = {limit}, clients asking 5× the limit, 30 simulated minutes")
    print(f"  {'routers':>7} {'pattern':>8} {'max in any 60 s':>16} {'per minute after 2 min':>23} "
          f"{'bound S':>8} {'window bound':>13}")
    for n in (1, 2, 3, 4):
        for pattern in ("uniform", "one", "switch"):
            most, steady = _routers(limit, n, 1800.0, 7, pattern)
            s = share_bound(n)
            print(f"  {n:>7} {pattern:>8} {most:>9} ({most / limit:4.2f}×) {steady:>13.1f} ({steady / limit:4.2f}×)"
                  f" {s:>8.3f} {2 * limit * s:>13.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--limit", type=int, default=600)
    args = ap.parse_args()
    _cost(args.n, args.tenants)
    _bound(args.limit)


if __name__ == "__main__":
    main()
