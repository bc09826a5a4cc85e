"""Which config file the daemon reads: --config, $LLMGW_CONFIG, ./llmgw.toml,
$XDG_CONFIG_HOME/llmgw/llmgw.toml (~/.config), /etc/llmgw/llmgw.toml, else the embedded default.
Every test looks in temporary directories only, never the real ~ or /etc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from llmgw.config import ConfigError
from llmgw.config.discovery import CONFIG_ENV, ConfigSource, find_config


@pytest.fixture()
def places(tmp_path: Path) -> dict[str, Path]:
    p = {"cwd": tmp_path / "cwd", "xdg": tmp_path / "xdg", "home": tmp_path / "home", "etc": tmp_path / "etc"}
    for d in p.values():
        d.mkdir()
    return p


def _put(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return str(path)


def test_the_order(places: dict[str, Path]) -> None:
    env = {"XDG_CONFIG_HOME": str(places["xdg"]), "HOME": str(places["home"])}

    def find(flag: str | None = None, **extra: str) -> ConfigSource:
        return find_config(flag, env={**env, **extra}, cwd=str(places["cwd"]), system_dir=str(places["etc"]))

    assert find() == ConfigSource(None, "default")
    etc = _put(places["etc"] / "llmgw.toml")
    assert find() == ConfigSource(etc, str(places["etc"]))
    xdg = _put(places["xdg"] / "llmgw" / "llmgw.toml")
    assert find() == ConfigSource(xdg, "$XDG_CONFIG_HOME")
    cwd = _put(places["cwd"] / "llmgw.toml")
    assert find() == ConfigSource(cwd, "./llmgw.toml")
    assert find(**{CONFIG_ENV: "/named/by/env.toml"}) == ConfigSource("/named/by/env.toml", "$LLMGW_CONFIG")
    assert find("flag.toml", **{CONFIG_ENV: "/named/by/env.toml"}) == ConfigSource("flag.toml", "--config")
    assert find(**{CONFIG_ENV: ""}).path == cwd  # empty = unset


def test_xdg_config_home_defaults_to_dot_config(places: dict[str, Path]) -> None:
    home_cfg = _put(places["home"] / ".config" / "llmgw" / "llmgw.toml")
    for xdg in ("", "relative/dir"):  # unset, or relative (invalid by the XDG spec): ~/.config
        found = find_config(env={"HOME": str(places["home"]), "XDG_CONFIG_HOME": xdg}, cwd=str(places["cwd"]),
                            system_dir=str(places["etc"]))
        assert found == ConfigSource(home_cfg, "~/.config")
    assert find_config(env={}, cwd=str(places["cwd"]), system_dir=str(places["etc"])).path is None  # no HOME


def test_a_directory_named_llmgw_toml_is_not_a_config(places: dict[str, Path]) -> None:
    (places["cwd"] / "llmgw.toml").mkdir()
    assert find_config(env={}, cwd=str(places["cwd"]), system_dir=str(places["etc"])).path is None


def _llmgw(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", *args], cwd=cwd, env=env, check=False, capture_output=True,
                          text=True,
                          timeout=30)


def _clean_env(places: dict[str, Path]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    env.update(XDG_CONFIG_HOME=str(places["xdg"]), HOME=str(places["home"]),
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH")])))
    return env


def test_config_init_writes_what_the_daemon_finds(places: dict[str, Path]) -> None:
    env = _clean_env(places)
    r = _llmgw(["config", "init"], places["cwd"], env)
    assert r.returncode == 0 and "`llmgw daemon` run in this directory reads it" in r.stdout, r.stdout + r.stderr
    assert find_config(env=env, cwd=str(places["cwd"]), system_dir=str(places["etc"])).path == \
        str(places["cwd"] / "llmgw.toml")
    r = _llmgw(["config", "check"], places["cwd"], env)  # no path: the file the daemon finds
    assert r.returncode == 0 and r.stdout.strip() == f"{places['cwd'] / 'llmgw.toml'}: ok", r.stdout + r.stderr


def test_the_daemon_reads_and_names_the_file_it_found(places: dict[str, Path]) -> None:
    tmp = places["cwd"]
    (tmp / "llmgw.toml").write_text(f"""
[server]
host = "127.0.0.1"
port = 0
[admin]
socket = {json.dumps(str(tmp / "admin" / "admin.sock"))}
[control]
store = {json.dumps(str(tmp / "router.db"))}
""")
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--log-level", "info"],
                            cwd=tmp, env=_clean_env(places), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        got: list[bytes] = []
        t = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(30)
        assert got and got[0], "daemon did not start"
        ready = json.loads(got[0])
        assert ready["config"] == str(tmp / "llmgw.toml")
        assert ready["admin_socket"] == str(tmp / "admin" / "admin.sock")  # the file's setting was used
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    logs = [json.loads(x) for x in err.decode().splitlines() if x.startswith("{")]
    assert any(x["msg"] == f"config: {tmp / 'llmgw.toml'} (./llmgw.toml)" for x in logs), err.decode()[-2000:]


def test_a_found_file_another_user_could_have_written_is_refused(places: dict[str, Path]) -> None:
    cfg = Path(_put(places["cwd"] / "llmgw.toml"))

    def find(**kw: object) -> ConfigSource:
        return find_config(env={}, cwd=str(places["cwd"]), system_dir=str(places["etc"]), **kw)  # type: ignore[arg-type]

    cfg.chmod(0o664)
    assert find().path == str(cfg)  # group-writable is fine (a user-private group)
    cfg.chmod(0o666)
    with pytest.raises(ConfigError, match=r"llmgw\.toml: found as \./llmgw\.toml, but it is writable by every user "
                                          r"\(mode 0666\).*--config"):
        find()
    cfg.chmod(0o644)
    with pytest.raises(ConfigError, match="is owned by uid 4242, not by you or root"):
        find(uid=1000, stat_of=lambda p: os.stat_result((0o100644, 0, 0, 1, 4242, 0, 0, 0, 0, 0)))
    assert find(uid=1000, stat_of=lambda p: os.stat_result((0o100644, 0, 0, 1, 0, 0, 0, 0, 0, 0))).path == str(cfg)
    cfg.chmod(0o666)  # named explicitly: the operator's choice
    assert find_config(str(cfg), env={}).path == str(cfg)
    assert find_config(env={CONFIG_ENV: str(cfg)}).path == str(cfg)


def test_config_init_writes_a_private_file(places: dict[str, Path]) -> None:
    r = _llmgw(["config", "init"], places["cwd"], _clean_env(places))
    assert r.returncode == 0, r.stderr
    assert (places["cwd"] / "llmgw.toml").stat().st_mode & 0o777 == 0o600
