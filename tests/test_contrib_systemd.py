"""contrib/systemd: the router's and the agent's units say what production needs (a dedicated user,
managed state/runtime/config directories, a restart policy, hardening that fits each role, engines
that survive an agent crash), and systemd itself accepts them where systemd-analyze exists."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[1] / "contrib" / "systemd"
ROUTER, AGENT = "llmgw-router.service", "llmgw-agent.service"


def parse(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (keys may repeat; '#' lines are comments)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        key, sep, value = line.partition("=")
        assert sep and section, f"{path.name}:{n}: not KEY=VALUE in a section: {raw!r}"
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def one(unit: dict[str, dict[str, list[str]]], key: str, section: str = "Service") -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


@pytest.mark.parametrize("name,role", [(ROUTER, "router"), (AGENT, "agent")])
def test_both_units_run_their_role_as_the_llmgw_user_with_managed_directories(name: str, role: str) -> None:
    u = parse(UNITS / name)
    assert one(u, "WantedBy", "Install") == "multi-user.target"
    assert "network-online.target" in u["Unit"]["Wants"]
    exec_start = one(u, "ExecStart").split()
    assert exec_start[1:5] == ["daemon", "--role", role, "--config"] and exec_start[5] == f"/etc/llmgw/{role}.toml"
    assert one(u, "User") == one(u, "Group") == "llmgw"
    assert one(u, "StateDirectory") == "llmgw" and one(u, "StateDirectoryMode") == "0700"
    assert one(u, "ConfigurationDirectory") == "llmgw"
    assert "XDG_STATE_HOME=/var/lib" in u["Service"]["Environment"]  # the store / state_dir defaults land there
    assert one(u, "Restart") == "on-failure" and one(u, "UMask") == "0077"
    for key in ("NoNewPrivileges", "ProtectKernelTunables", "ProtectKernelModules", "ProtectControlGroups",
                "RestrictSUIDSGID", "LockPersonality"):
        assert one(u, key) == "yes", key
    # Shared by both roles on one host (same user): never cleared by one unit under the other.
    assert "RemoveIPC" not in u["Service"] and "DynamicUser" not in u["Service"]


def test_the_router_is_locked_down_to_its_directories_and_the_network() -> None:
    u = parse(UNITS / ROUTER)
    for key, value in {"ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
                       "PrivateDevices": "yes", "RestrictNamespaces": "yes", "RuntimeDirectory": "llmgw",
                       "RuntimeDirectoryMode": "0700"}.items():
        assert one(u, key) == value, key
    # the admin socket's default directory is inside the RuntimeDirectory (0700: the socket's rule)
    assert "XDG_RUNTIME_DIR=/run/llmgw" in u["Service"]["Environment"]
    assert "@system-service" in u["Service"]["SystemCallFilter"]
    assert set(one(u, "RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6"}


def test_the_agent_leaves_the_engines_their_gpus_and_lets_them_outlive_a_crash() -> None:
    u = parse(UNITS / AGENT)
    svc = u["Service"]
    assert one(u, "KillMode") == "process"  # systemd must not kill the engines with a crashed agent
    for key in ("PrivateDevices", "DevicePolicy", "DeviceAllow", "ProtectClock",  # GPUs (ProtectClock: a DeviceAllow)
                "MemoryDenyWriteExecute", "SystemCallFilter",  # JITs, CUDA's ioctls
                "PrivateTmp"):  # an orphaned engine's /tmp would be cleared on the agent's restart
        assert key not in svc, key
    assert one(u, "ProtectSystem") == "full" and one(u, "ProtectHome") == "read-only"
    assert one(u, "CacheDirectory") == "llmgw" and "HF_HOME=/var/cache/llmgw/huggingface" in svc["Environment"]
    timeout = one(u, "TimeoutStopSec")
    assert int(timeout.removesuffix("s")) >= 60  # the agent stops its engines itself: TERM, grace, KILL


def test_the_user_is_declared_for_systemd_sysusers() -> None:
    lines = [x for x in (UNITS / "llmgw.sysusers.conf").read_text().splitlines() if x and not x.startswith("#")]
    assert lines == ['u llmgw - "llmgw LLM gateway" /var/lib/llmgw']


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    """systemd-analyze verify, with ExecStart pointed at an executable that exists here (verify checks
    it); systemd only warns about an unknown key or a bad value, so any output is a failure."""
    binary = tmp_path / "llmgw"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    units = []
    for name in (ROUTER, AGENT):
        text = (UNITS / name).read_text()
        assert "/opt/llmgw/bin/llmgw " in text
        units.append(tmp_path / name)
        units[-1].write_text(text.replace("/opt/llmgw/bin/llmgw ", f"{binary} "))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, units)], capture_output=True,
                       text=True, timeout=60, check=False)
    assert (r.returncode, r.stdout + r.stderr) == (0, "")
    exposure = {}
    for unit in units:
        s = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True,
                           text=True, timeout=60, check=False)
        if s.returncode != 0 and "offline" in s.stderr:
            pytest.skip("this systemd-analyze cannot rate a unit file offline")
        m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", s.stdout)
        assert m, s.stdout + s.stderr
        exposure[unit.name] = float(m.group(1))
    # systemd's 0-10 rating (lower is better): 1.4 and 4.4 today; a looser edit has to be deliberate.
    assert exposure[ROUTER] <= 2.0 and exposure[AGENT] <= 5.0, exposure
