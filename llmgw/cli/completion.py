"""What `llmgw completion bash|zsh|fish` completes, read off the commands' own argparse parsers, so
that a script offers exactly the subcommands, options and choices the installed version accepts
(regenerate it after an upgrade). llmgw.cli puts the contexts together; llmgw.cli.completion_scripts
writes them out for each shell.

The command line is a tree of contexts: "" (llmgw itself), "ctl", "ctl scale", "sim fleet", ...
Each knows its subcommands, its options (which take a value, and the value's choices) and whether
its positional arguments are files. `llmgw sim` reads different flags per engine: `--engine
llamacpp` switches to the context "sim --engine=llamacpp". Each shell gets a small walker over
these tables: it follows the words typed so far to a context, then offers what fits there.

`llmgw daemon` and `llmgw sim fleet` build their parsers inside their main functions; those are
caught at their first parse_known_args call (captured_parser), before anything else runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["SHELLS", "Context", "Option", "add_parser", "captured_parser"]

SHELLS = ("bash", "zsh", "fish")


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    takes_value: bool
    choices: tuple[str, ...] = ()
    help: str = ""


@dataclass
class Context:
    subcommands: dict[str, str] = field(default_factory=dict)  # name -> help
    options: list[Option] = field(default_factory=list)
    positional_choices: list[str] = field(default_factory=list)
    files: bool = False  # a positional argument without choices: complete file names
    switches: dict[tuple[str, str], str] = field(default_factory=dict)  # (flag, value) -> context

    def value_option(self, flag: str) -> Option | None:
        return next((o for o in self.options if flag in o.flags and o.takes_value), None)


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def captured_parser(entry: Callable[[list[str]], object], argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser `entry(argv)` builds, caught when it starts parsing: nothing after that runs."""
    def catch(self: argparse.ArgumentParser, *_: object, **__: object) -> object:
        raise _Captured(self)

    original = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = catch  # type: ignore[method-assign,assignment]
    try:
        entry(list(argv or []))
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{entry.__module__}.{entry.__qualname__} returned without parsing its arguments")


def _help(text: str | None) -> str:
    if not text or text == argparse.SUPPRESS:
        return ""
    return " ".join(text.split()).replace("%(default)s", "").replace("%%", "%")


def add_parser(out: dict[str, Context], key: str, parser: argparse.ArgumentParser) -> Context:
    """The context `key` (and those below it) from an argparse parser."""
    ctx = out.setdefault(key, Context())
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: _help(a.help) for a in action._choices_actions}
            for name, sub in action.choices.items():
                ctx.subcommands[name] = helps.get(name, "")
                add_parser(out, f"{key} {name}".strip(), sub)
        elif action.option_strings:
            if action.help == argparse.SUPPRESS:
                continue
            choices = tuple(str(c) for c in action.choices) if action.choices else ()
            ctx.options.append(Option(tuple(action.option_strings), action.nargs != 0, choices, _help(action.help)))
        elif action.choices:
            ctx.positional_choices.extend(str(c) for c in action.choices)
        else:
            ctx.files = True
    return ctx
