"""Every option and argument of every llmgw command says what it is for in --help."""

from __future__ import annotations

import argparse
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
