"""The daemon's logs: readable lines on a terminal, JSON lines through a pipe or with
--log-format json, and a level that is not one of the four refused with the choices."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw.daemon.logs import (
    JsonFormatter,
    LogSetupError,
    TextFormatter,
    env_format,
    env_level,
    pick_format,
    setup_logging,
)

from .test_router_integration import Daemon, write_config

TEXT_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR) +[\w.]+: ")


def _record(msg: str = "request ok", **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("llmgw.router", logging.INFO, __file__, 1, msg, (), None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_text_line_shows_the_access_log_fields_compactly() -> None:
    line = TextFormatter().format(_record(request_id="ab12", model="m", endpoint="m/0", status=200,
                                          outcome="ok", ttft_ms=41.237, latency_ms=None))
    assert TEXT_LINE.match(line), line
    assert line.endswith("INFO    router: request ok request_id=ab12 model=m endpoint=m/0 status=200 outcome=ok "
                         "ttft_ms=41.2")  # None left out, no llmgw. prefix, floats to 0.1 ms
    assert 'model="a b"' in TextFormatter().format(_record(model="a b"))  # quoted when it has a space
    assert "\u2192" in TextFormatter().format(_record("node vm: new \u2192 ready"))  # not escaped


def test_json_line_keeps_its_keys() -> None:
    obj = json.loads(JsonFormatter().format(_record(request_id="ab12", status=200)))
    assert {k: obj[k] for k in ("level", "logger", "msg", "request_id", "status")} == {
        "level": "info", "logger": "llmgw.router", "msg": "request ok", "request_id": "ab12", "status": 200}
    assert isinstance(obj["ts"], float)


def test_auto_format_is_text_on_a_terminal_json_otherwise() -> None:
    assert pick_format("auto", _Tty()) == "text"
    assert pick_format("auto", io.StringIO()) == "json"
    assert pick_format("json", _Tty()) == "json" and pick_format("text", io.StringIO()) == "text"
    stream = _Tty()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert setup_logging("warning", "auto", stream) == "text"
        logging.getLogger("llmgw.test").info("not shown")
        logging.getLogger("llmgw.test").warning("shown")
        assert TEXT_LINE.match(stream.getvalue()) and "not shown" not in stream.getvalue()
    finally:
        root.handlers[:], root.level = saved


def test_environment_level_and_format_are_checked() -> None:
    assert env_level({}, "info") == "info" and env_level({"LLMGW_LOG_LEVEL": "DEBUG"}, "info") == "debug"
    with pytest.raises(LogSetupError, match=r"LLMGW_LOG_LEVEL='loud': expected one of debug, info, warning, error"):
        env_level({"LLMGW_LOG_LEVEL": "loud"}, "info")
    assert env_format({}) == "auto" and env_format({"LLMGW_LOG_FORMAT": "JSON"}) == "json"
    with pytest.raises(LogSetupError, match="LLMGW_LOG_FORMAT='xml'"):
        env_format({"LLMGW_LOG_FORMAT": "xml"})


def _daemon_cmd(config: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "llmgw", "daemon", "--role", "router", "--config", str(config), "--port", "0",
            *extra]


@pytest.mark.parametrize("argv, env, message", [
    (["--log-level", "loud"], {}, ("argument --log-level: invalid choice: 'loud' (choose from 'debug', 'info', "
                                   "'warning', 'error')")),
    ([], {"LLMGW_LOG_LEVEL": "loud"}, "$LLMGW_LOG_LEVEL='loud': expected one of debug, info, warning, error"),
    (["--log-format", "xml"], {}, "argument --log-format: invalid choice: 'xml'"),
])
def test_invalid_level_is_a_usage_error_not_a_traceback(tmp_path: Path, argv: list[str], env: dict[str, str],
                                                        message: str) -> None:
    cfg = write_config(tmp_path, [])
    r = subprocess.run(_daemon_cmd(cfg, *argv), check=False, capture_output=True, text=True,
                       timeout=30, env={**os.environ, **env})
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_daemon_logs_json_through_a_pipe(tmp_path: Path) -> None:
    d = Daemon(write_config(tmp_path, []), log_level="info")
    try:
        deadline = time.monotonic() + 20
        while not any("router listening on" in x for x in d.err):
            assert time.monotonic() < deadline and d.proc.poll() is None, d.err
            time.sleep(0.01)
        line = next(x for x in d.err if "router listening on" in x)
        assert json.loads(line)["logger"] == "llmgw.daemon"
    finally:
        d.stop()


def test_daemon_logs_text_on_a_terminal(tmp_path: Path) -> None:
    master, slave = pty.openpty()
    proc = subprocess.Popen(_daemon_cmd(write_config(tmp_path, []), "--log-level", "info"), stdout=subprocess.PIPE,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 20
        while b"router listening on" not in out:
            left = deadline - time.monotonic()
            assert left > 0 and proc.poll() is None, out
            if select.select([master], [], [], left)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    break
        line = next(x for x in out.decode().splitlines() if "router listening on" in x)
        assert TEXT_LINE.match(line) and "daemon: router listening on http://127.0.0.1:" in line, line
        assert not line.lstrip().startswith("{")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        os.close(master)
        assert proc.stdout is not None
        proc.stdout.close()
