"""Which daemon `llmgw ctl` and `llmgw console` talk to: flags, then the environment, then the
config file's [admin] section, then the default socket — the same answer from both commands."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from llmgw.config import discovery as config_discovery
from llmgw.admin_client.target import (
    SOCKET_ENV,
    TOKEN_ENV,
    URL_ENV,
    AdminTarget,
    TargetError,
    resolve_target,
)
from llmgw.config import AdminConfig, load_config
from llmgw.config.defaults import default_admin_socket
from llmgw.config.discovery import CONFIG_ENV, ConfigSource
from llmgw.cli.ctl.main import Admin, CtlError, parser
from llmgw.tui.main import UsageError, client_from_args

CFG = AdminConfig(socket="/cfg/admin.sock", token="cfg-token")


def configs(**by_path: AdminConfig) -> Callable[[str], AdminConfig]:
    def read(path: str) -> AdminConfig:
        return by_path[path] if path in by_path else load_config(path).admin
    return read


def resolve(env: dict[str, str] | None = None, found: str | None = None, **flags: str) -> AdminTarget:
    return resolve_target(**flags, env=env or {}, read_config=configs(cfg=CFG), default_socket=lambda: "/default.sock",
                          discover=lambda env: ConfigSource(found, "./llmgw.toml" if found else "default"))


# -- the resolution ---------------------------------------------------------------------------------------
def test_each_level_decides_when_the_ones_above_are_silent() -> None:
    assert resolve() == AdminTarget(socket="/default.sock", origin="the default socket")
    assert resolve(config="cfg") == AdminTarget(socket="/cfg/admin.sock", origin="[admin] socket of cfg")
    assert resolve({SOCKET_ENV: "/env.sock"}, config="cfg") == AdminTarget(socket="/env.sock", origin=f"${SOCKET_ENV}")
    assert resolve({SOCKET_ENV: "/env.sock"}, socket="/flag.sock").socket == "/flag.sock"
    env_url = resolve({URL_ENV: "http://env:1", TOKEN_ENV: "env-token"}, config="cfg")
    assert env_url == AdminTarget(url="http://env:1", token="env-token", origin=f"${URL_ENV}")
    assert resolve({URL_ENV: "http://env:1", TOKEN_ENV: "t"}, socket="/flag.sock").socket == "/flag.sock"
    assert resolve({SOCKET_ENV: "/env.sock", TOKEN_ENV: "t"}, url="http://flag:1").url == "http://flag:1"


def test_the_token_has_its_own_precedence() -> None:
    env = {URL_ENV: "http://env:1", TOKEN_ENV: "env-token"}
    assert resolve(env, config="cfg", token="flag-token").token == "flag-token"
    assert resolve(env, config="cfg").token == "env-token"
    assert resolve({URL_ENV: "http://env:1"}, config="cfg").token == "cfg-token"
    assert resolve({TOKEN_ENV: "env-token"}, config="cfg").token is None  # over the socket no token is sent


def test_what_cannot_work_says_so() -> None:
    with pytest.raises(TargetError, match=r"^--url needs a token") as e:
        resolve(url="http://h:1")
    assert e.value.usage
    with pytest.raises(TargetError, match=rf"^\${URL_ENV} needs a token"):
        resolve({URL_ENV: "http://h:1"})
    with pytest.raises(TargetError, match="--url and --socket name two daemons"):
        resolve(url="http://h:1", socket="/s", token="t")
    with pytest.raises(TargetError, match="both set"):
        resolve({URL_ENV: "http://h:1", SOCKET_ENV: "/s"})
    assert resolve({URL_ENV: "http://h:1", SOCKET_ENV: "/s"}, socket="/flag").socket == "/flag"  # flags decide
    with pytest.raises(TargetError, match="cannot read") as e:
        resolve(socket="/s", config="missing.toml")  # a broken --config is an error even when not needed
    assert not e.value.usage
    assert resolve({URL_ENV: "", SOCKET_ENV: "", TOKEN_ENV: ""}).socket == "/default.sock"  # empty = unset


def test_a_config_file_found_by_looking_is_level_three() -> None:
    assert resolve(found="cfg") == AdminTarget(socket="/cfg/admin.sock", origin="[admin] socket of cfg (./llmgw.toml)")
    assert resolve({URL_ENV: "http://h:1"}, found="cfg").token == "cfg-token"
    assert resolve({SOCKET_ENV: "/env.sock"}, found="missing.toml").socket == "/env.sock"  # not needed: not read
    with pytest.raises(TargetError, match=r"cannot read.*\(found as \./llmgw\.toml"):
        resolve(found="missing.toml")


def test_both_commands_find_the_config_the_daemon_finds(place: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for target in (ctl_target, console_target):
        assert target([]) == (default_admin_socket(), None)  # nothing to find
        monkeypatch.setenv(CONFIG_ENV, str(place / "llmgw.toml"))
        assert target([]) == (f"{place}/cfg.sock", None)
        monkeypatch.delenv(CONFIG_ENV)
        xdg = place / "xdg-config" / "llmgw"
        xdg.mkdir(parents=True, exist_ok=True)
        (xdg / "llmgw.toml").write_text(f'[admin]\nsocket = "{place}/env.sock"\n')
        assert target([]) == (f"{place}/env.sock", None)
        (place / "cwd" / "llmgw.toml").write_text(f'[admin]\nsocket = "{place}/flag.sock"\n')
        assert target([]) == (f"{place}/flag.sock", None)  # ./llmgw.toml comes before $XDG_CONFIG_HOME
        (place / "cwd" / "llmgw.toml").unlink()
        (xdg / "llmgw.toml").unlink()


# -- both commands, end to end (no daemon: ctl only checks that a socket path exists) ----------------------
@pytest.fixture()
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in (URL_ENV, SOCKET_ENV, TOKEN_ENV, CONFIG_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    # the config file the commands would find by looking: none, and never the real ~ or /etc
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setattr(config_discovery, "SYSTEM_DIR", str(tmp_path / "etc"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    for sock in (Path(default_admin_socket()), tmp_path / "cfg.sock", tmp_path / "env.sock", tmp_path / "flag.sock"):
        sock.parent.mkdir(parents=True, exist_ok=True)
        sock.touch()
    (tmp_path / "llmgw.toml").write_text(f'[admin]\nsocket = "{tmp_path}/cfg.sock"\ntoken = "cfg-token"\n')
    return tmp_path


def ctl_target(args: list[str]) -> tuple[str, str | None]:
    api = Admin(parser().parse_args([*args, "status"]))
    return api.where, api.client.headers.get("authorization")


def console_target(args: list[str]) -> tuple[str, str | None]:
    client = client_from_args(args)
    return client.where.removeprefix("unix:"), client._http.headers.get("authorization")


@pytest.mark.parametrize("target", [ctl_target, console_target], ids=["ctl", "console"])
def test_both_commands_follow_the_same_precedence(place: Path, monkeypatch: pytest.MonkeyPatch,
                                                  target: Callable[[list[str]], tuple[str, str | None]]) -> None:
    cfg = ["--config", str(place / "llmgw.toml")]
    assert target([]) == (default_admin_socket(), None)
    assert target(cfg) == (f"{place}/cfg.sock", None)
    monkeypatch.setenv(SOCKET_ENV, f"{place}/env.sock")
    assert target(cfg) == (f"{place}/env.sock", None)
    assert target([*cfg, "--socket", f"{place}/flag.sock"]) == (f"{place}/flag.sock", None)
    monkeypatch.delenv(SOCKET_ENV)
    monkeypatch.setenv(URL_ENV, "http://10.0.0.5:7071")
    assert target(cfg) == ("http://10.0.0.5:7071", "Bearer cfg-token")
    monkeypatch.setenv(TOKEN_ENV, "env-token")
    assert target(cfg) == ("http://10.0.0.5:7071", "Bearer env-token")
    assert target([*cfg, "--url", "http://10.0.0.6:7071", "--token", "flag-token"]) == (
        "http://10.0.0.6:7071", "Bearer flag-token")
    assert target(["--socket", f"{place}/flag.sock"]) == (f"{place}/flag.sock", None)


@pytest.mark.parametrize("target", [ctl_target, console_target], ids=["ctl", "console"])
def test_both_commands_refuse_the_same_way(place: Path, monkeypatch: pytest.MonkeyPatch,
                                           target: Callable[[list[str]], tuple[str, str | None]]) -> None:
    monkeypatch.setenv(URL_ENV, "http://10.0.0.5:7071")
    with pytest.raises((CtlError, UsageError), match=rf"\${URL_ENV} needs a token"):
        target([])
    with pytest.raises((CtlError, UsageError), match="two daemons"):
        target(["--url", "http://h:1", "--socket", "/s", "--token", "t"])
    with pytest.raises((CtlError, UsageError), match="cannot read"):
        target(["--socket", f"{place}/flag.sock", "--config", str(place / "missing.toml")])


def test_ctl_takes_the_options_after_the_command_too(place: Path) -> None:
    api = Admin(parser().parse_args(["status", "--url", "http://h:1", "--token", "t"]))
    assert api.where == "http://h:1" and api.client.headers["authorization"] == "Bearer t"
    with pytest.raises(CtlError, match=r"no llmgw admin socket at .*nope\.sock \(--socket\)"):
        Admin(parser().parse_args(["status", "--socket", str(place / "nope.sock")]))


def test_ctl_status_names_the_socket_it_used(place: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llmgw.cli.ctl.main import cmd_status

    ns = parser().parse_args(["status"])
    api = Admin(ns)
    api.call = lambda method, path, **kw: {"role": "router,agent"}  # type: ignore[method-assign]
    cmd_status(api, ns)
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"{'admin API':20s} {default_admin_socket()} (the default socket)"
    ns = parser().parse_args(["status", "-o", "json"])
    cmd_status(api, ns)
    assert json.loads(capsys.readouterr().out) == {"role": "router,agent"}  # JSON stays the daemon's answer
