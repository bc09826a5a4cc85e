"""Shared fixtures: real simulator processes on ephemeral 127.0.0.1 ports, always stopped."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# No test is timed (speed lives in bench/): hypothesis' per-example deadline and its too-slow
# health check only fail property tests when the 2-core machine is busy with other work.
settings.register_profile("llmgw", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("llmgw")

from tests.store_backends import any_store, pg_server, pg_url, reopenable  # noqa: F401 — store fixtures

# vLLM's golden vectors: facts computed with vLLM's own code, kept in the repository (tests/data/README.md).
GOLDEN_PATH = Path(__file__).resolve().parent / "data" / "vllm-golden.json"


@functools.cache
def load_golden() -> dict[str, Any]:
    """The golden vectors, read once per session (callers must not change them)."""
    return json.loads(GOLDEN_PATH.read_text())


@pytest.fixture(scope="session", autouse=True)
def _isolated_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Daemons started by tests keep their store, agent state and admin socket under a temporary
    directory, never in the user's own (the defaults follow XDG_STATE_HOME / XDG_RUNTIME_DIR), and
    find no config file of the user's (XDG_CONFIG_HOME, LLMGW_CONFIG: llmgw.config.discovery)."""
    base = tmp_path_factory.mktemp("xdg")
    saved = {k: os.environ.get(k) for k in ("XDG_STATE_HOME", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "LLMGW_CONFIG")}
    os.environ["XDG_STATE_HOME"] = str(base / "state")
    os.environ["XDG_RUNTIME_DIR"] = str(base / "run")
    os.environ["XDG_CONFIG_HOME"] = str(base / "config")  # no config file of the user's is found
    os.environ.pop("LLMGW_CONFIG", None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# "No ERROR traceback in a daemon's log is ever normal": every daemon a test starts through
# `Daemon` (tests/test_router_integration.py) hands its log here when stopped, and the test that
# started it fails if the log holds a traceback — whatever the test itself asserted.
TRACEBACK = "Traceback (most recent call last)"
_daemon_tracebacks: list[str] = []


def check_daemon_log(what: str, lines: list[str]) -> None:
    """Record a stopped daemon's traceback (the last 40 lines from the first one) for its test."""
    for i, line in enumerate(lines):
        if TRACEBACK in line:
            _daemon_tracebacks.append(f"{what}:\n" + "".join(lines[i:i + 40])[-6000:])
            return


def _fail_on_tracebacks(when: str) -> None:
    found, _daemon_tracebacks[:] = list(_daemon_tracebacks), []
    if found:
        pytest.fail(f"a daemon {when} logged a traceback (never normal):\n" + "\n".join(found), pytrace=False)


@pytest.fixture(autouse=True)
def _no_daemon_tracebacks() -> Iterator[None]:
    # A daemon of a module- or session-scoped fixture is stopped after its last test: reported here.
    _fail_on_tracebacks("stopped after the previous test (a module fixture's)")
    yield
    _fail_on_tracebacks("this test started")


@pytest.fixture(scope="session", autouse=True)
def _no_daemon_tracebacks_at_the_end() -> Iterator[None]:
    yield
    _fail_on_tracebacks("stopped at the end of the session")


@pytest.fixture(scope="session")
def golden() -> dict[str, Any]:
    """vLLM's golden vectors (tests/data/vllm-golden.json)."""
    return load_golden()


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


@dataclass
class SimProc:
    proc: subprocess.Popen[bytes]
    info: dict[str, Any]
    stderr: list[str]

    @property
    def url(self) -> str:
        return self.info["url"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()


def start_sim(args: list[str], env: dict[str, str] | None = None, timeout: float = 30.0) -> SimProc:
    """Start `llmgw sim ARGS` and wait for its ready line (its first stdout line)."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONHASHSEED", "0")
    full_env.update(env or {})
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "sim", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=full_env, start_new_session=True)
    err: list[str] = []

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err.append(line.decode(errors="replace"))

    threading.Thread(target=pump, daemon=True).start()
    result: list[bytes] = []
    reader = threading.Thread(target=lambda: result.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    if not result or not result[0]:
        sim = SimProc(proc, {}, err)
        sim.stop()
        raise RuntimeError(f"simulator did not start: {''.join(err)[-2000:]}")
    return SimProc(proc, json.loads(result[0]), err)


@pytest.fixture
def sim_factory() -> Iterator[Any]:
    started: list[SimProc] = []

    def factory(args: list[str], env: dict[str, str] | None = None) -> SimProc:
        s = start_sim(args, env)
        started.append(s)
        return s

    yield factory
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def vllm_sim() -> Iterator[SimProc]:
    """One zero-cost vLLM simulator shared by a module's read-mostly tests."""
    s = start_sim(["--engine", "vllm", "sim-model", "--host", "127.0.0.1", "--port", "0", "--sim-zero-cost",
                   "--enable-lora", "--max-loras", "2", "--lora-modules", "sql-lora=/adapters/sql-lora",
                   "--enable-prompt-tokens-details"],
                  env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    yield s
    s.stop()


# Console snapshots (pytest-textual-snapshot) live in the top-level snapshots/ folder, where docs/
# links to them, rather than in a __snapshots__ folder beside each test file.
try:
    from pytest_textual_snapshot import SVGImageExtension
except ImportError:  # a test extra: without it the console's snapshot tests skip
    pass
else:
    _SNAPSHOTS = Path(__file__).resolve().parents[1] / "snapshots"
    # one folder per test module, as the plugin does (syrupy relates snapshots to tests by that name)
    SVGImageExtension.dirname = classmethod(  # type: ignore[method-assign,assignment]
        lambda cls, *, test_location: str(_SNAPSHOTS / test_location.basename))
