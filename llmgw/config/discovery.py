"""Which config file `llmgw daemon`, `llmgw ctl` and `llmgw console` read, decided in one place.

The first of these that gives a file:

1. ``--config FILE``;
2. ``$LLMGW_CONFIG``;
3. ``./llmgw.toml`` (where `llmgw config init` writes it);
4. ``$XDG_CONFIG_HOME/llmgw/llmgw.toml`` (``XDG_CONFIG_HOME`` defaults to ``~/.config``);
5. ``/etc/llmgw/llmgw.toml``;
6. none: the embedded default (a simulated fleet on this machine).

A file named by 1 or 2 is used even when it does not exist (reading it then fails with a message
naming it): a typo must not fall through to another file. 3–5 count only when they are regular
files. A file found but unreadable or invalid is an error, not skipped; so is one found by looking
that another user could have put there — owned by neither the caller nor root, or writable by
every user — since a config file decides which programs the agent runs (ConfigError: name
the file with --config to use it anyway).

Pure but for its defaults: the environment, the working directory and the file test are
parameters."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from llmgw.config.load import ConfigError, ConfigProblem

__all__ = ["CONFIG_ENV", "FILE_NAME", "SYSTEM_DIR", "ConfigSource", "find_config", "search_list"]

CONFIG_ENV = "LLMGW_CONFIG"
FILE_NAME = "llmgw.toml"
SYSTEM_DIR = "/etc/llmgw"


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """The config file to read (None: the embedded default) and what chose it, for messages."""

    path: str | None
    origin: str  # "--config", "$LLMGW_CONFIG", "./llmgw.toml", "$XDG_CONFIG_HOME", "~/.config", "/etc/llmgw", "default"

    @property
    def explicit(self) -> bool:
        """Named by the command line or the environment (not found by looking)."""
        return self.origin in ("--config", f"${CONFIG_ENV}")

    def describe(self) -> str:
        if self.path is None:
            return "the embedded default (no config file found: " + ", ".join(search_list_words()) + ")"
        return f"{self.path} ({self.origin})"


def search_list(env: Mapping[str, str], cwd: str, system_dir: str = SYSTEM_DIR) -> list[tuple[str, str]]:
    """The files looked for after --config and $LLMGW_CONFIG, in order: (origin, path)."""
    out = [(f"./{FILE_NAME}", str(Path(cwd) / FILE_NAME))]
    xdg = env.get("XDG_CONFIG_HOME", "")
    if xdg and os.path.isabs(xdg):  # the XDG spec: a relative value is invalid and ignored
        out.append(("$XDG_CONFIG_HOME", str(Path(xdg) / "llmgw" / FILE_NAME)))
    elif home := env.get("HOME", ""):
        out.append(("~/.config", str(Path(home) / ".config" / "llmgw" / FILE_NAME)))
    out.append((system_dir, str(Path(system_dir) / FILE_NAME)))
    return out


def search_list_words() -> list[str]:
    return ["--config", f"${CONFIG_ENV}", f"./{FILE_NAME}", f"$XDG_CONFIG_HOME/llmgw/{FILE_NAME}",
            f"{SYSTEM_DIR}/{FILE_NAME}"]


def find_config(flag: str | None = None, *, env: Mapping[str, str] | None = None, cwd: str | None = None,
                is_file: Callable[[str], bool] = os.path.isfile, system_dir: str | None = None,
                stat_of: Callable[[str], os.stat_result] = os.stat, uid: int | None = None) -> ConfigSource:
    """The config file to use (see the module's docstring); ConfigError for a found file another
    user could have written."""
    env = os.environ if env is None else env
    system_dir = SYSTEM_DIR if system_dir is None else system_dir
    if flag:
        return ConfigSource(flag, "--config")
    if named := env.get(CONFIG_ENV, ""):
        return ConfigSource(named, f"${CONFIG_ENV}")
    for origin, path in search_list(env, os.getcwd() if cwd is None else cwd, system_dir):
        if is_file(path):
            _check_owner(path, origin, stat_of(path), os.getuid() if uid is None else uid)
            return ConfigSource(path, origin)
    return ConfigSource(None, "default")


def _check_owner(path: str, origin: str, st: os.stat_result, uid: int) -> None:
    if st.st_uid not in (uid, 0):
        why = f"is owned by uid {st.st_uid}, not by you or root"
    elif st.st_mode & stat.S_IWOTH:
        why = f"is writable by every user (mode {st.st_mode & 0o777:04o})"
    else:
        return
    raise ConfigError([ConfigProblem(path, "", None, f"found as {origin}, but it {why}: another user could have "
                                     "put it there; fix its owner or mode, or name it with --config to use it")])
