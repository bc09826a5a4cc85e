"""`llmgw daemon --workers N` over real processes: a supervisor, N routers on one port (SO_REUSEPORT)
and one store (docs/ha.md "One host, several cores")."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from llmgw.config import default_config
from llmgw.config.defaults import with_machine_defaults
from llmgw.daemon.workers import for_worker, worker_path, worker_roles
from tests.conftest import check_daemon_log

CHAT = json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


# -- the pure parts ---------------------------------------------------------------------------------
def test_worker_path_puts_the_index_before_the_extension() -> None:
    assert worker_path("/run/llmgw/admin.sock", 0) == "/run/llmgw/admin.sock"
    assert worker_path("/run/llmgw/admin.sock", 3) == "/run/llmgw/admin.w3.sock"
    assert worker_path("/run/llmgw/admin", 1) == "/run/llmgw/admin.w1"
    assert worker_path("/run/llm.gw/.admin", 2) == "/run/llm.gw/.admin.w2"  # a dot file has no extension
    assert worker_path("/var/log/traces.jsonl", 1) == "/var/log/traces.w1.jsonl"


def test_for_worker_keeps_worker_0_and_moves_what_cannot_be_shared() -> None:
    from dataclasses import replace

    cfg = with_machine_defaults(default_config(), {"XDG_RUNTIME_DIR": "/r", "XDG_STATE_HOME": "/s"})
    cfg = replace(cfg, admin=replace(cfg.admin, tcp="127.0.0.1:9000", token="t"),
                  control=replace(cfg.control, listen="10.0.0.5:7070"),
                  router=replace(cfg.router, traces=replace(cfg.router.traces, file="/l/traces.jsonl")),
                  ha=replace(cfg.ha, feed_listen="10.0.0.5:7075", feed_advertise="r1.example:7075"))
    assert for_worker(cfg, 0, "127.0.0.1:7070") is cfg
    w2 = for_worker(cfg, 2, "127.0.0.1:7070")
    assert w2.admin.socket == "/r/llmgw-%d/admin.w2.sock" % os.getuid()
    assert w2.admin.tcp is None and w2.admin.token == "t"  # the admin TCP listener is worker 0's
    assert w2.control.listen == "10.0.0.5:0"  # its own ephemeral port on the configured host
    assert w2.router.traces.file == "/l/traces.w2.jsonl"
    assert (w2.ha.feed_listen, w2.ha.feed_advertise) == ("10.0.0.5:0", "r1.example")
    assert w2.control.store == cfg.control.store and w2.server == cfg.server  # shared
    plain = for_worker(with_machine_defaults(default_config(), {}), 1, "127.0.0.1:7070")
    assert plain.control.listen == "127.0.0.1:0" and plain.router.traces.file is None
    assert worker_roles({"router", "agent"}, 0) == {"router", "agent"}
    assert worker_roles({"router", "agent"}, 1) == {"router"}  # the agent runs once


def test_migrate_advice_names_the_sysctl_when_it_is_off(tmp_path: Path) -> None:
    from llmgw.daemon.supervisor import migrate_advice

    f = tmp_path / "tcp_migrate_req"
    f.write_text("1\n")
    assert migrate_advice(str(f)) is None
    f.write_text("0\n")
    assert "sysctl -w net.ipv4.tcp_migrate_req=1" in (migrate_advice(str(f)) or "")
    assert "Linux >= 5.14" in (migrate_advice(str(tmp_path / "absent")) or "")


# -- the command line -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "65", "two"])
def test_bad_workers_values_are_refused_naming_the_flag(value: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--workers", value, "--port", "0"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "--workers" in p.stderr and "Traceback" not in p.stderr
    assert p.stdout == ""


def test_workers_need_a_router_and_worker_index_is_internal(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--workers", "2", "--role", "agent"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and "--workers is for a router" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--worker-index", "0", "--port", "0"],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and "internal to --workers" in p.stderr, p.stderr
    help_text = subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "--workers" in help_text and "--worker-index" not in help_text


def test_workers_refuse_a_memory_store_and_a_taken_port(tmp_path: Path) -> None:
    cfg = tmp_path / "llmgw.toml"
    cfg.write_text('[control]\nstore = ":memory:"\n')
    p = subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--workers", "2", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and ":memory:" in p.stderr, p.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "llmgw", "daemon", "--workers", "2", "--config",
                            str(_config(tmp_path)), "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in p.stderr, p.stderr


# -- real workers -----------------------------------------------------------------------------------
def _config(tmp: Path) -> Path:
    path = tmp / "llmgw.toml"
    path.write_text("\n".join([
        "[server]", 'host = "127.0.0.1"', "[router]", "scrape_interval_s = 0.2",
        "[control]", f"store = {json.dumps(str(tmp / 'state' / 'router.db'))}",
        "[admin]", f"socket = {json.dumps(str(tmp / 'admin' / 'admin.sock'))}",
        "[agent]", f"state_dir = {json.dumps(str(tmp / 'agent'))}",
        "[sim]", "replicas = 2", 'extra_args = ["--sim-zero-cost"]']) + "\n")
    return path


class Workers:
    """`llmgw daemon --workers N` on the embedded default (sim replicas), its stdout lines read as
    they come (the ready line, then one per restarted worker)."""

    def __init__(self, tmp: Path, n: int = 2, timeout: float = 60.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "llmgw", "daemon", "--workers", str(n), "--config",
                                      str(_config(tmp)), "--port", "0", "--log-level", "info"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.err: list[str] = []
        self.lines: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._pump_err, daemon=True).start()
        threading.Thread(target=self._pump_out, daemon=True).start()
        try:
            self.info = self.wait_line(lambda d: d.get("ready"), timeout)
        except AssertionError:
            self.stop()
            raise RuntimeError("workers did not start: " + "".join(self.err)[-3000:]) from None
        self.port = self.info["port"]

    def _pump_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line.decode(errors="replace"))

    def _pump_out(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(json.loads(line))
                self._cond.notify_all()

    def wait_line(self, pred: Any, timeout: float) -> dict[str, Any]:
        with self._cond:
            if not self._cond.wait_for(lambda: any(pred(d) for d in self.lines), timeout):
                raise AssertionError(f"no such line on stdout in {timeout} s: {self.lines}")
            return next(d for d in self.lines if pred(d))

    def pids(self) -> list[int]:
        return [w["pid"] for w in self.info["workers"]]

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        check_daemon_log("daemon --workers", self.err)
        return self.proc.returncode


@pytest.fixture
def workers(tmp_path: Path) -> Any:
    started: list[Workers] = []

    def start(n: int = 2) -> Workers:
        w = Workers(tmp_path, n)
        started.append(w)
        return w

    yield start
    for w in started:
        pids = w.pids()
        w.stop()
        for pid in pids:  # a test that failed half-way leaves none behind either
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _chat(port: int, retries: int = 1) -> int:
    """One request on a new connection (the kernel spreads connections, not requests); a refused or
    reset connection is retried `retries` times, as the clients docs/ha.md speaks of do."""
    errors: list[Exception] = []
    for attempt in range(retries + 1):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions", CHAT, {"content-type": "application/json"})
            return conn.getresponse().status
        except (ConnectionRefusedError, ConnectionResetError, http.client.RemoteDisconnected) as e:
            errors.append(e)
            if attempt == retries:
                raise OSError(", then ".join(map(repr, errors))) if len(errors) > 1 else e
        finally:
            conn.close()
    raise AssertionError("unreachable")


def _kernel_migrates() -> bool:
    """net.ipv4.tcp_migrate_req: a closing listener's queued connections move to the others of its
    SO_REUSEPORT group (Linux >= 5.14; off by default)."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_migrate_req").read_text().strip() != "0"
    except OSError:
        return False


def _admin(sock_path: str, path: str) -> Any:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sock_path)
    conn = http.client.HTTPConnection("localhost")
    conn.sock = s
    conn.request("GET", path)
    body = conn.getresponse().read()
    conn.close()
    return json.loads(body)


def _served(sock_path: str) -> int:
    """Requests this worker answered 200 (its recent traces: each worker keeps its own)."""
    return sum(1 for t in _admin(sock_path, "/api/v1/traces?limit=1000") if t.get("status") == 200)


def _logged_by(lines: list[str], text: str) -> set[int]:
    """The workers that logged a line with `text` (each JSON log line says which worker wrote it)."""
    found = set()
    for line in lines:
        if text in line and line.startswith("{"):
            found.add(json.loads(line).get("worker"))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)


def test_two_workers_serve_one_port_and_sigterm_stops_them_all(workers: Any) -> None:
    w = workers(2)
    info = w.info
    assert info["pid"] == w.proc.pid and len(info["workers"]) == 2
    w0, w1 = info["workers"]
    assert w0["admin_socket"] == info["admin_socket"] and w1["admin_socket"].endswith("admin.w1.sock")
    assert w0["pid"] != w1["pid"] and w0["control"] != w1["control"]
    # one store, two routers: one leads, the other follows
    def one_leads() -> bool:
        rows = _admin(w1["admin_socket"], "/api/v1/routers")["routers"]
        return sorted((r.get("worker"), r["role"]) for r in rows) in ([(0, "follower"), (1, "leader")],
                                                                      [(0, "leader"), (1, "follower")])

    _wait(one_leads, 30, "worker 1 lists both workers, one of them leading")
    # both workers answer (the kernel spreads new connections); worker 0 listens from its start, before
    # its replicas are up (as one router does), worker 1 once it can route
    _wait(lambda: _chat(w.port) == 200 and all(_served(x["admin_socket"]) > 0 for x in info["workers"]), 90,
          "both workers answer on the port")
    statuses = [_chat(w.port) for _ in range(20)]
    assert set(statuses) == {200}, statuses
    os.kill(w.proc.pid, signal.SIGHUP)  # `systemctl reload`: every worker re-reads the file
    _wait(lambda: _logged_by(w.err, "SIGHUP") == {0, 1}, 30, "both workers reload on SIGHUP")
    assert w.stop() == 0
    assert not [pid for pid in w.pids() if _alive(pid)]
    with pytest.raises(ConnectionRefusedError):
        _chat(w.port, retries=0)
    assert any("stopping 2 workers" in line for line in w.err)


def test_a_killed_worker_is_restarted_and_the_port_keeps_answering(workers: Any) -> None:
    """A client retrying once on a refused or reset connection never fails — where the kernel moves a
    dying listener's queued connections to the other workers (tcp_migrate_req = 1). Without it, a
    request in flight on the killed worker is reset, and its retry, sent at once, may land in the
    dying socket's queue (the kernel releases the connections' sockets before the listener's) and be
    reset too: the client then needs a second retry (docs/ha.md says so)."""
    retries = 1 if _kernel_migrates() else 2
    w = workers(2)
    w0, w1 = w.info["workers"]
    _wait(lambda: _chat(w.port) == 200 and _served(w1["admin_socket"]) > 0, 90, "worker 1 answers")
    failures: list[str] = []
    done = threading.Event()
    count = [0]

    def client() -> None:
        while not done.is_set():
            try:
                status = _chat(w.port, retries)
            except OSError as e:
                failures.append(repr(e))
                continue
            count[0] += 1
            if status != 200:
                failures.append(f"status {status}")

    t = threading.Thread(target=client, daemon=True)
    t.start()
    try:
        _wait(lambda: count[0] >= 5, 30, "the client runs")
        os.kill(w1["pid"], signal.SIGKILL)
        again = w.wait_line(lambda d: d.get("worker_restarted") == 1, 60)
        assert again["pid"] != w1["pid"] and again["restarts"] == 1 and again["router_id"] != w1["router_id"]
        # the dead worker's router left the store's routers at once (agents stop dialing it)
        ids = {r["id"] for r in _admin(w0["admin_socket"], "/api/v1/routers")["routers"]}
        assert w1["router_id"] and w1["router_id"] not in ids
        # the new worker 1 listens once it routes: then it answers again
        before = count[0]
        _wait(lambda: _served(again["admin_socket"]) > 0, 90, "the restarted worker answers")
        _wait(lambda: count[0] >= before + 5, 30, "the client goes on")
    finally:
        done.set()
        t.join(30)
    assert not failures, failures[:5]
    assert any("worker 1" in line and "killed by SIGKILL" in line and "restart 1" in line for line in w.err)
    assert w.stop() == 0


def test_workers_stop_when_the_supervisor_is_killed(workers: Any) -> None:
    w = workers(2)
    pids = w.pids()
    os.kill(w.proc.pid, signal.SIGKILL)
    w.proc.wait(10)
    _wait(lambda: not any(_alive(p) for p in pids), 60, "the orphaned workers stop")
    assert any("the supervisor" in line and "is gone: stopping" in line for line in w.err)


def test_a_worker_that_cannot_start_stops_the_supervisor_with_its_error(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    (tmp_path / "admin").mkdir(mode=0o755)
    os.chmod(tmp_path / "admin", 0o755)  # (whatever the umask): the admin socket's directory must be private
    cmd = [sys.executable, "-m", "llmgw", "daemon", "--config", str(cfg), "--port", "0"]
    one = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    p = subprocess.run([*cmd, "--workers", "2"], capture_output=True, text=True, timeout=120)
    error = [line for line in one.stderr.splitlines() if line.startswith("llmgw daemon:")]
    assert one.returncode != 0 and len(error) == 1 and "chmod 700" in error[0], one.stderr[-2000:]
    # the same exit status and the same one line as one process, and nothing on stdout
    assert p.returncode == one.returncode and error[0] in p.stderr.splitlines(), p.stderr[-2000:]
    assert "Traceback" not in p.stderr and p.stdout == ""


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry))
    return out


def test_sigterm_while_the_workers_start_stops_them(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "daemon", "--workers", "2", "--config",
                             str(_config(tmp_path)), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        _wait(lambda: bool(_children(proc.pid)), 60, "worker 0 is started")
        workers = _children(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)  # before any ready line
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out == b"" and b"Traceback" not in err  # stopped then, not once every worker had started
    _wait(lambda: not any(_alive(p) for p in workers), 10, "no worker left")
