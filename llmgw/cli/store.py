"""`llmgw store migrate --from sqlite:PATH --to postgresql://… [--force]`: move an installation's
fleet state from its router's SQLite file into PostgreSQL, so that several routers can share it
(docs/ha.md). Stop the router first (a running one is refused: its later writes would be lost).
The copy is one transaction; it prints what it copied, table by table. A bad flag, an unreachable
target or a non-empty one (without --force) is one line saying what to do."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmgw store", description="The fleet's store.")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    m = sub.add_parser("migrate", help="copy an SQLite store into PostgreSQL",
                       description="Copy a router's SQLite store (models, revisions, assignments, labels, holds, "
                                   "node credentials, suites, jobs, history) into a PostgreSQL database, in one "
                                   "transaction. Stop the router first.")
    m.add_argument("--from", dest="source", required=True, metavar="sqlite:PATH", help="the router's store file")
    m.add_argument("--to", dest="target", required=True, metavar="postgresql://USER@HOST:PORT/DB",
                   help="the database ([store] url); its schema is created if needed")
    m.add_argument("--password-file", metavar="FILE", help="the database's password ([store] password_file)")
    m.add_argument("--force", action="store_true", help="replace the fleet a non-empty target holds")
    m.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="each statement at most (default: %(default)s)")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(list(argv))
    if not args.source.startswith("sqlite:") or not args.source.removeprefix("sqlite:"):
        return _fail(f"--from: must be sqlite:PATH, got {args.source!r}")
    if not args.target.startswith(("postgresql://", "postgres://")):
        return _fail("--to: must be a postgresql:// url")
    try:
        from llmgw.daemon.control.store.copy import CopyError, copy_store, open_source
        from llmgw.daemon.control.store.postgres import PgStore
        from llmgw.daemon.control.store.rows import StoreError
    except ImportError:
        return _fail("a PostgreSQL store needs psycopg: pip install 'llmgw[postgres]'")
    password = None
    if args.password_file:
        try:
            with open(args.password_file) as f:
                password = f.read().strip()
        except OSError as e:
            return _fail(f"--password-file: cannot read {args.password_file}: {e.strerror or e}")
    try:
        src = open_source(args.source.removeprefix("sqlite:"))
    except CopyError as e:
        return _fail(str(e))
    try:
        try:
            dst = PgStore.open(args.target, password=password, timeout_s=args.timeout)
        except StoreError as e:
            return _fail(f"--to: {e}")
        try:
            result = copy_store(src, dst, force=args.force)
        except CopyError as e:
            return _fail(str(e))
        except dst.faults as e:
            return _fail(f"--to: {dst.path}: the copy failed ({dst.describe(e)}): {' '.join(str(e).split())}; "
                         "nothing was written")
        finally:
            dst.close()
    finally:
        src.close()
    if result.replaced:
        print("replaced: " + ", ".join(f"{t} {n}" for t, n in result.replaced.items()))
    width = max(map(len, result.counts))
    for table, n in result.counts.items():
        print(f"{table:{width}}  {n}")
    print(f"copied {sum(result.counts.values())} rows from {args.source} to {dst.path}; set [store] url to it "
          "and start the routers")
    return 0


def _fail(message: str) -> int:
    print(f"llmgw store migrate: {message}", file=sys.stderr)
    return 1
