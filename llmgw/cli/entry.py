"""The `llmgw` command. Subcommands import their modules lazily so that `llmgw ctl` and
`llmgw sim` start fast and never pull in what they do not use (the console's Textual)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

USAGE = """\
usage: llmgw <command> [args]

commands:
  daemon [--role router,agent] [--config FILE] [--workers N]
                                              run the router and/or the agent (default: both;
                                              no models configured: a simulated fleet); --workers:
                                              N router processes on one port (docs/ha.md)
  ctl COMMAND [-o table|json]                 {ctl_commands}
  console [--socket PATH | --url URL --token T]
                                              the live operator console (a terminal UI)
  sim --engine vllm|llamacpp [engine flags]   run one simulated engine replica
  sim fleet N [--engine E] [--base-port P] [-- engine flags]
                                              run N simulated replicas (demos, benchmarks)
  sim worker [--host H] [--port P]            a simulated worker of a multi-node replica (answers
                                              /health only; the head takes --rpc HOST:PORT,...)
  config init [PATH] [--force]                write a starter config file
  config check [PATH]                         validate a config file (default: the daemon's), listing
                                              every problem
  store migrate --from sqlite:PATH --to postgresql://... [--force]
                                              copy a router's SQLite store into PostgreSQL
                                              (several routers share it: docs/ha.md)
  kv hash --tokens IDS [--vllm-version V ...] the block hash chain vLLM computes for a token list
  kv decode HEX | --file F                    decode a vLLM KV event payload into readable events
  completion bash|zsh|fish                    print a shell completion script for llmgw
  help [TOPIC]                                the manual: the topics, or one page (router,
                                              configuration, admin-api, ...)

`llmgw sim --engine vllm --help` lists vLLM's flags, and the --sim-* flags of the simulator.
"""

_DESCRIBED_AT = 46  # the column where the commands' descriptions start in USAGE


def usage() -> str:
    """USAGE with `ctl`'s commands as ctl's own parser has them, so the list cannot drift from it."""
    import textwrap

    from llmgw.cli.ctl.main import parser as ctl_parser

    sub = next(a for a in ctl_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = "operate a running daemon: " + ", ".join(a.dest for a in sub._choices_actions)
    lines = textwrap.wrap(text, width=100 - _DESCRIBED_AT, break_on_hyphens=False)
    return USAGE.replace("{ctl_commands}", ("\n" + " " * _DESCRIBED_AT).join(lines))


# The commands, with the one-line help that shell completion shows beside them.
COMMANDS = {
    "daemon": "run the router and/or the agent",
    "ctl": "operate a running daemon",
    "console": "the live operator console (a terminal UI)",
    "sim": "run simulated engine replicas",
    "config": "write or check a config file",
    "store": "copy a router's SQLite store into PostgreSQL",
    "kv": "hash tokens and decode KV events as vLLM does",
    "completion": "print a shell completion script",
    "help": "the manual: list the topics, or read one",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if args else 2
    if args[0] == "help":
        return _help(args[1:])
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
        from llmgw.cli.ctl.main import main as ctl_main

        return ctl_main(rest)
    if cmd == "console":
        from llmgw.tui.main import main as console_main

        return console_main(rest)
    if cmd == "store":
        from llmgw.cli.store import main as store_main

        return store_main(rest)
    if cmd == "kv":
        from llmgw.cli.kv import main as kv_main

        return kv_main(rest)
    if cmd == "completion":
        return _completion(rest)
    print(f"llmgw: unknown command {cmd!r}\n\n{usage()}", end="", file=sys.stderr)
    return 2


def help_parser() -> argparse.ArgumentParser:
    from llmgw.manual import topics

    p = argparse.ArgumentParser(prog="llmgw help", description="The manual, as shipped with this llmgw: without a "
                                "topic, the commands and the topics; with one, its page (through $PAGER on a "
                                "terminal).")
    p.add_argument("topic", nargs="?", choices=[t.name for t in topics()] or None, metavar="TOPIC",
                   help="a page of the manual, e.g. router, configuration, admin-api")
    return p


def _help(argv: list[str]) -> int:
    from llmgw.manual import UnknownTopic, read, topics

    if argv and argv[0] in ("-h", "--help"):
        help_parser().print_help()
        return 0
    if not argv:
        found = topics()
        print(usage())
        print("help topics (`llmgw help TOPIC`):" if found else "help topics: none (installed without the manual)")
        for t in found:
            print(f"  {t.name:20s} {t.title}")
        return 0
    if len(argv) > 1:
        print("llmgw help: one topic at a time (`llmgw help` lists them)", file=sys.stderr)
        return 2
    try:
        text = read(argv[0])
    except UnknownTopic as e:
        print(f"llmgw help: {e}", file=sys.stderr)
        return 2
    if sys.stdout.isatty():
        import pydoc

        pydoc.pager(text)  # $MANPAGER / $PAGER, else less, else plain
    else:
        sys.stdout.write(text)
    return 0


def config_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmgw config", description="Write a starter config file, or check one.")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="write a starter config", description="Write a starter config file.")
    init.add_argument("path", nargs="?", default="llmgw.toml", help="where to write it (default: %(default)s)")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    check = sub.add_parser("check", help="validate a config file",
                           description="Validate a config file, listing every problem.")
    check.add_argument("path", nargs="?", help="the config file to check (default: the one `llmgw daemon` "
                                               "finds: $LLMGW_CONFIG, ./llmgw.toml, "
                                               "$XDG_CONFIG_HOME/llmgw/llmgw.toml, /etc/llmgw/llmgw.toml)")
    return p


def completion_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmgw completion", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Print a completion script for llmgw's commands, options and choices.",
        epilog="install it once (and again after an upgrade):\n"
               "  bash: llmgw completion bash > ~/.local/share/bash-completion/completions/llmgw\n"
               "  zsh:  llmgw completion zsh > \"${fpath[1]}/_llmgw\"   (any folder on $fpath)\n"
               "  fish: llmgw completion fish > ~/.config/fish/completions/llmgw.fish")
    p.add_argument("shell", choices=("bash", "zsh", "fish"), help="the shell to complete in")
    return p


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's argparse parser, by the words that lead to it. `llmgw sim` reads vLLM's flags,
    or llama.cpp's after --engine llamacpp. The parsers of daemon and sim fleet are built inside
    their main functions and caught there at their first parse (nothing else of those runs)."""
    from llmgw.cli.completion import captured_parser
    from llmgw.cli.ctl.main import parser as ctl_parser
    from llmgw.daemon.main import main as daemon_main
    from llmgw.daemon.sim.main import fleet_main
    from llmgw.daemon.sim.worker import worker_main
    from llmgw.cli.kv import parser as kv_parser
    from llmgw.cli.store import parser as store_parser
    from llmgw.sim.args import build_llamacpp_parser, build_vllm_parser
    from llmgw.tui.main import _parser as console_parser

    return {"daemon": captured_parser(daemon_main), "ctl": ctl_parser(), "console": console_parser(),
            "config": config_parser(), "store": store_parser(), "kv": kv_parser(), "completion": completion_parser(), "sim": build_vllm_parser(),
            "sim fleet": captured_parser(fleet_main), "sim worker": captured_parser(worker_main),
            "sim --engine=llamacpp": build_llamacpp_parser(),
            "help": help_parser()}


def completion_contexts() -> dict[str, Any]:
    """Every context of the `llmgw` command line (llmgw.cli.completion), from each command's parser."""
    from llmgw.cli.completion import Context, Option, add_parser

    out: dict[str, Context] = {}
    out[""] = Context(subcommands=dict(COMMANDS), options=[Option(("-h", "--help"), False, (), "show the commands"),
                                                           Option(("-V", "--version"), False, (), "print the version")])
    for key, parser in parsers().items():
        add_parser(out, key, parser)
    out["sim"].subcommands["fleet"] = "run N simulated replicas, one process each"
    engine = Option(("--engine",), True, ("vllm", "llamacpp"), "the engine to simulate (default: vllm)")
    for ctx in (out["sim"], out["sim --engine=llamacpp"]):
        ctx.options.insert(0, engine)
        ctx.switches = {("--engine", "vllm"): "sim", ("--engine", "llamacpp"): "sim --engine=llamacpp"}
    return out


def _completion(argv: list[str]) -> int:
    from llmgw.cli.completion_scripts import script

    ns = completion_parser().parse_args(argv)
    sys.stdout.write(script(ns.shell, completion_contexts()))
    return 0


def _how_the_daemon_finds(path: Any) -> str:
    """What `llmgw config init` tells: whether `llmgw daemon` here will read the file it wrote."""
    import os

    from llmgw.config import ConfigError
    from llmgw.config.discovery import CONFIG_ENV, find_config

    try:
        found = find_config(None)
    except ConfigError as e:
        return f"but `llmgw daemon` here would refuse what it finds: {e}"
    if found.path is not None and os.path.abspath(found.path) == os.path.abspath(path):
        return "`llmgw daemon` run in this directory reads it"
    if found.path is not None and found.explicit:
        return f"`llmgw daemon` reads ${CONFIG_ENV} ({found.path}) instead: pass --config {path}"
    return f"run `llmgw daemon --config {path}` (or set ${CONFIG_ENV}={os.path.abspath(path)})"


def _config(argv: list[str]) -> int:
    import os
    from pathlib import Path

    from llmgw.config import ConfigError, init_config_text, load_config

    ns = config_parser().parse_args(argv)
    if ns.action == "init":
        path = Path(ns.path)
        if path.exists() and not ns.force:
            print(f"llmgw config init: {path} exists; pass --force to overwrite it", file=sys.stderr)
            return 1
        # 0600: the file will hold tokens; an existing file (--force) keeps its mode
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(init_config_text())
        print(f"wrote {path}; {_how_the_daemon_finds(path)}")
        return 0
    if ns.path is None:
        from llmgw.config.discovery import find_config, search_list_words

        try:
            found = find_config(None)
        except ConfigError as e:
            print(e, file=sys.stderr)
            return 1
        if found.path is None:
            print("llmgw config check: no config file found (looked for " + ", ".join(search_list_words()[1:])
                  + "): name one", file=sys.stderr)
            return 1
        ns.path = found.path
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
