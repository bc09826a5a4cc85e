"""What tenants cost a request in the pure core: authenticate + admit + settle + release, in µs,
with 1,000 tenants and 1,000 keys against a book with none (and with one static key).

    python bench/bench_tenants_core.py [--n 200000] [--tenants 1000]

Each request presents a different key, picked at random among the thousand (so dict lookups
are not all in cache). "quotas" gives every tenant rpm, tpm, concurrency and a daily budget and
every key an rpm limit, all high enough that nothing is refused; "no quotas" has the tenants and
keys but no limits; "1 tenant + 1 key, quotas" the same limits with one tenant (the
difference to a thousand is memory: each request touches another tenant's state). A second part simulates N routers sharing an rpm limit by their demands
(``shares``) and prints the most any 60 s window admitted, against the limit and the bound."""

from __future__ import annotations

import argparse
import random
import statistics
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


def _round(book: TenantBook, lim: Limiter, order: list[str | None]) -> float:
    """CPU µs per request of one pass over ``order``."""
    now = 0.0
    t0 = time.process_time()
    for h in order:
        now += 0.000001
        p = book.authenticate(h, WALL)
        g = lim.admit(p, 1100, now, WALL)
        lim.settle(g, 900, now, WALL)
        lim.release(g)
    return (time.process_time() - t0) / len(order) * 1e6


def _cost(n: int, tenants: int, rounds: int) -> None:
    static_key = "a-static-key-of-the-config"
    plain, plain_h = _book(tenants, quotas=False)
    limited, limited_h = _book(tenants, quotas=True)
    one, one_h = _book(1, quotas=True)
    cases = [("no tenants (open book)", TenantBook([], []), [None]),
             ("one static key", TenantBook([], [], static_keys=[static_key]), [f"Bearer {static_key}"]),
             (f"{tenants} tenants + {tenants} keys, no quotas", plain, plain_h),
             ("1 tenant + 1 key, quotas", one, one_h),
             (f"{tenants} tenants + {tenants} keys, quotas", limited, limited_h)]
    rng = random.Random(2)
    runs = []
    for name, book, headers in cases:
        lim = Limiter()
        lim.set_book(book)
        runs.append((name, book, lim, [headers[rng.randrange(len(headers))] for _ in range(n)], []))
    for _ in range(rounds):  # the cases interleaved, so a busy machine weighs on all alike
        for _, book, lim, order, times in runs:
            times.append(_round(book, lim, order))
    print(f"authenticate + admit + settle + release: CPU µs per request, best (median) of {rounds} × {n}")
    base = min(runs[0][4])
    for name, _, _, _, times in runs:
        best = min(times)
        print(f"  {name:<44} {best:7.2f} µs ({statistics.median(times):6.2f})   +{best - base:5.2f} µs over none")
    t0 = time.process_time()
    _book(tenants, quotas=True)
    print(f"  building a book of {tenants} tenants + {tenants} keys: {(time.process_time() - t0) * 1e3:.1f} ms "
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
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-routers", action="store_true", help="only the cost per request")
    args = ap.parse_args()
    _cost(args.n, args.tenants, args.rounds)
    if not args.no_routers:
        _bound(args.limit)


if __name__ == "__main__":
    main()
