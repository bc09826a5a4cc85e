"""Every option and argument of every llmgw command says what it is for in --help."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator

import pytest

from llmgw.cli import entry as cli


def walk(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, p in action.choices.items():
                yield from walk(f"{name} {sub}", p)
        elif not isinstance(action, argparse._HelpAction):
            yield name, action


@pytest.mark.parametrize("command", list(cli.parsers()))
def test_every_option_and_argument_has_help(command: str) -> None:
    missing = [f"llmgw {where}: {'/'.join(a.option_strings) or a.dest}"
               for where, a in walk(command, cli.parsers()[command])
               if a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    assert missing == []


def test_every_subcommand_has_help() -> None:
    for command, parser in cli.parsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help for a in action._choices_actions}
                assert all(helps.get(name) for name in action.choices), (command, helps)
    assert set(cli.COMMANDS) <= {line.split()[0] for line in cli.USAGE.splitlines()[3:] if line.startswith("  ")}


def test_top_level_help_lists_every_ctl_command() -> None:
    """Issue 21 item 20: `llmgw --help` listed 10 of ctl's commands. Every command ctl's own parser
    has appears in the installed command's help (and the help an unknown command gets)."""
    from llmgw.cli.ctl.main import parser as ctl_parser

    (sub,) = [a for a in ctl_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    names = [a.dest for a in sub._choices_actions]
    assert {"facility", "explain-placement", "adapters", "kv", "trace", "eval", "jobs", "suites"} <= set(names)
    r = subprocess.run([sys.executable, "-m", "llmgw", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    start = r.stdout.index("  ctl ")
    block = r.stdout[start:r.stdout.index("\n  console ")]
    listed = {w.strip(",.:()`") for w in block.split()}
    assert [n for n in names if n not in listed] == [], block
    assert max(map(len, block.splitlines())) <= 100
    bad = subprocess.run([sys.executable, "-m", "llmgw", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and block in bad.stderr
