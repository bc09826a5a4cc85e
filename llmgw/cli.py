"""The `llmgw` command. Subcommands import their modules lazily so that `llmgw ctl` and
`llmgw sim` start fast and never pull in what they do not use (the console's Textual)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

USAGE = """\
usage: llmgw <command> [args]

commands:
  daemon [--role router,agent] [--config FILE]
                                              run the router and/or the agent (default: both;
                                              no models configured: a simulated fleet)
  ctl COMMAND [-o table|json]                 operate a running daemon: status, nodes, label,
                                              models, scale, replicas, restart, endpoints,
                                              decisions, explain REQUEST_ID
  console [--socket PATH | --url URL --token T]
                                              the live operator console (a terminal UI)
  sim --engine vllm|llamacpp [engine flags]   run one simulated engine replica
  sim fleet N [--engine E] [--base-port P] [-- engine flags]
                                              run N simulated replicas (demos, benchmarks)
  config init [PATH] [--force]                write a starter config file
  config check PATH                           validate a config file, listing every problem

`llmgw sim --engine vllm --help` lists vLLM's flags, and the --sim-* flags of the simulator.
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if args else 2
    cmd, rest = args[0], args[1:]
    if cmd in ("-V", "--version"):
        from llmgw import __version__

        print(f"llmgw {__version__}")
        return 0
    if cmd == "sim":
        from llmgw.daemon.sim.main import main as sim_main

        return sim_main(rest)
    if cmd == "daemon":
        from llmgw.daemon.main import main as daemon_main

        return daemon_main(rest)
    if cmd == "config":
        return _config(rest)
    if cmd == "ctl":
        from llmgw.ctl import main as ctl_main

        return ctl_main(rest)
    if cmd == "console":
        from llmgw.tui.main import main as console_main

        return console_main(rest)
    print(f"llmgw: unknown command {cmd!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


def _config(argv: list[str]) -> int:
    from pathlib import Path

    from llmgw.config import ConfigError, init_config_text, load_config

    p = argparse.ArgumentParser(prog="llmgw config")
    sub = p.add_subparsers(dest="action", required=True)
    init = sub.add_parser("init", help="write a starter config")
    init.add_argument("path", nargs="?", default="llmgw.toml")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    check = sub.add_parser("check", help="validate a config file")
    check.add_argument("path")
    ns = p.parse_args(argv)
    if ns.action == "init":
        path = Path(ns.path)
        if path.exists() and not ns.force:
            print(f"llmgw config init: {path} exists; pass --force to overwrite it", file=sys.stderr)
            return 1
        path.write_text(init_config_text())
        print(f"wrote {path}")
        return 0
    try:
        load_config(ns.path)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 1
    except OSError as e:
        print(f"llmgw config check: cannot read {ns.path}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"{ns.path}: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
