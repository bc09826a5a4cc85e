"""EngineSupervisor against real processes: the simulator, and shell scripts standing in for broken
engines. Every wait is on a report (fail_after), never a sleep."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from llmgw.daemon.agent import processes
from llmgw.daemon.agent.engines import EngineSupervisor, safe_id
from llmgw.fleet.lifecycle import RestartPolicy
from llmgw.fleet.types import EngineReport, EngineSpec

pytestmark = pytest.mark.anyio


def sim_spec(replica: str = "m/1", engine: str = "vllm", **kw: Any) -> EngineSpec:
    path = "sim.gguf" if engine == "llamacpp" else "sim-model"
    kw = {"args": ("--sim-zero-cost",), "health_timeout_s": 30.0, **kw}
    return EngineSpec(replica=replica, model="m", engine=engine, model_path=path, simulate=True, **kw)


def script_spec(tmp_path: Path, body: str, replica: str = "bad/1", **kw: Any) -> EngineSpec:
    script = tmp_path / f"engine-{safe_id(replica)}.sh"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return EngineSpec(replica=replica, model="bad", engine="llamacpp", model_path="x.gguf", binary=str(script),
                      **kw)


@pytest.fixture
def groups() -> Iterator[set[int]]:
    """Process groups seen in reports: killed at the end whatever happened."""
    seen: set[int] = set()
    yield seen
    for g in seen:
        try:
            os.killpg(g, signal.SIGKILL)
        except ProcessLookupError:
            continue
        try:
            os.waitpid(g, 0)
        except ChildProcessError:
            pass


class Harness:
    def __init__(self, state_dir: Path, groups: set[int], **kw: Any) -> None:
        self.send, self.recv = trio.open_memory_channel[EngineReport](math.inf)
        self.groups = groups
        kw.setdefault("policy_factory", lambda: RestartPolicy(base_s=0.05, jitter=0.0))
        self.sup = EngineSupervisor(state_dir, "127.0.0.1", self.on_report, health_interval_s=0.05, grace_s=3.0,
                                    **kw)
        self.seen: list[EngineReport] = []

    def on_report(self, r: EngineReport) -> None:
        if r.pid is not None:
            self.groups.add(r.pid)
        self.send.send_nowait(r)

    async def wait_for(self, state: str, replica: str | None = None, timeout: float = 15.0) -> EngineReport:
        with trio.fail_after(timeout):
            async for r in self.recv:
                self.seen.append(r)
                if r.state == state and (replica is None or r.replica == replica):
                    return r
        raise AssertionError("report channel closed")

    def recv_nowait_all(self) -> list[EngineReport]:
        out = []
        while True:
            try:
                out.append(self.recv.receive_nowait())
            except trio.WouldBlock:
                return out

    def states(self) -> list[str]:
        return [r.state for r in self.seen]


@asynccontextmanager
async def running(h: Harness, stop: bool = True) -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        await nursery.start(h.sup.run)
        try:
            yield nursery
        finally:
            if stop:
                await h.sup.stop_all()
            nursery.cancel_scope.cancel()


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_ready_url_answers_then_stop_all_kills_the_group(tmp_path, groups):
    h = Harness(tmp_path, groups)
    async with running(h):
        h.sup.apply([sim_spec()])
        starting = await h.wait_for("starting")
        ready = await h.wait_for("ready")
        assert ready.pid == starting.pid and ready.url and not ready.adopted and ready.restarts == 0
        async with httpx.AsyncClient() as client:
            assert (await client.get(ready.url + "/health")).status_code == 200
            models = (await client.get(ready.url + "/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["m"]
        rec = json.loads((tmp_path / "engines" / f"{safe_id('m/1')}.json").read_text())
        assert (rec["pid"], rec["pgid"], rec["url"]) == (ready.pid, ready.pid, ready.url)
        assert rec["spec_hash"] == sim_spec().spec_hash() and rec["cmd"][1:4] == ["-m", "llmgw", "sim"]
        assert [r.state for r in h.sup.reports()] == ["ready"]
        await h.sup.stop_all()
        assert group_gone(ready.pid)
        assert h.sup.reports() == []
        assert not (tmp_path / "engines" / f"{safe_id('m/1')}.json").exists()
        await h.wait_for("stopping")
        await h.wait_for("stopped")
        h.sup.apply([sim_spec()])  # a stopped supervisor starts nothing
        assert h.sup.reports() == []


async def test_sigkill_is_a_crash_and_restarts(tmp_path, groups):
    h = Harness(tmp_path, groups)
    async with running(h):
        h.sup.apply([sim_spec()])
        first = await h.wait_for("ready")
        os.kill(first.pid, signal.SIGKILL)
        crashed = await h.wait_for("crashed")
        assert "killed by signal SIGKILL" in crashed.detail and crashed.pid is None
        again = await h.wait_for("starting")
        assert again.pid != first.pid and again.restarts == 1
        ready = await h.wait_for("ready")
        assert ready.url == first.url  # same port again
        assert "--- " in (tmp_path / "logs" / f"{safe_id('m/1')}.log").read_text()


async def test_exit_at_once_is_a_crash_loop_until_generation_bump(tmp_path, groups):
    h = Harness(tmp_path, groups, policy_factory=lambda: RestartPolicy(base_s=0.05, crashloop_after=3))
    spec = script_spec(tmp_path, "echo boom on stderr >&2\nexit 3\n")
    async with running(h):
        h.sup.apply([spec])
        loop = await h.wait_for("crashloop")
        assert h.states().count("crashed") == 3 and h.states().count("starting") == 3
        crashed = [r for r in h.seen if r.state == "crashed"]
        assert "exited with status 3" in crashed[0].detail and crashed[-1].restarts == 2
        assert "3 crashes" in loop.detail and "generation" in loop.detail
        assert "boom on stderr" in loop.log_tail
        h.sup.apply([spec])  # same spec: stays in its crash loop
        bumped = EngineSpec(**{**spec.__dict__, "generation": 1})
        h.sup.apply([bumped])
        again = await h.wait_for("starting")
        assert again.restarts == 0 and again.generation == 1
        assert (await h.wait_for("crashed")).restarts == 0


async def test_never_healthy_fails_with_the_log_tail(tmp_path, groups):
    h = Harness(tmp_path, groups, policy_factory=lambda: RestartPolicy(base_s=60.0))
    spec = script_spec(tmp_path, "echo loading model...\nexec sleep 60\n", health_timeout_s=1.0)
    async with running(h):
        h.sup.apply([spec])
        starting = await h.wait_for("starting")
        failed = await h.wait_for("failed")
        assert "not healthy after 1s" in failed.detail
        assert any("loading model" in line for line in failed.log_tail)
        assert group_gone(starting.pid)


async def test_generation_bump_restarts_and_apply_empty_stops(tmp_path, groups):
    h = Harness(tmp_path, groups)
    # llama.cpp answers /health 503 while it loads: ready only once loaded.
    spec = sim_spec(engine="llamacpp", args=("--sim-zero-cost", "--sim-load-seconds", "0.3"))
    async with running(h):
        h.sup.apply([spec])
        first = await h.wait_for("ready")
        h.sup.apply([EngineSpec(**{**spec.__dict__, "generation": 3})])
        await h.wait_for("stopping")
        again = await h.wait_for("starting")
        assert again.pid != first.pid and again.generation == 3 and again.restarts == 0
        assert group_gone(first.pid)
        ready = await h.wait_for("ready")
        assert "stopped" not in h.states()
        h.sup.apply([])
        await h.wait_for("stopping")
        await h.wait_for("stopped")
        assert group_gone(ready.pid) and h.sup.reports() == []


HEALTH_SERVER = """\
import http.server, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
flag = sys.argv[0] + ".healthy"
print("serving", flush=True)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if os.path.exists(flag) else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


async def test_unhealthy_while_ready_and_back_without_a_restart(tmp_path, groups):
    script = tmp_path / "engine.py"
    script.write_text(f"#!{sys.executable}\n{HEALTH_SERVER}")
    script.chmod(0o755)
    flag = tmp_path / "engine.py.healthy"
    flag.touch()
    spec = EngineSpec(replica="h/1", model="h", engine="llamacpp", model_path="x.gguf", binary=str(script))
    h = Harness(tmp_path / "state", groups)
    async with running(h):
        h.sup.apply([spec])
        ready = await h.wait_for("ready")
        flag.unlink()
        sick = await h.wait_for("unhealthy")
        assert sick.pid == ready.pid and "3 times" in sick.detail
        flag.touch()
        back = await h.wait_for("ready")
        assert back.pid == ready.pid and back.restarts == 0
        assert h.states() == ["starting", "ready", "unhealthy", "ready"]


async def test_spec_change_replaces(tmp_path, groups):
    h = Harness(tmp_path, groups)
    spec = script_spec(tmp_path, "exec sleep 60\n", replica="r/1", health_timeout_s=30.0)
    async with running(h):
        h.sup.apply([spec])
        first = await h.wait_for("starting")
        h.sup.apply([EngineSpec(**{**spec.__dict__, "args": ("-np", "2")})])
        await h.wait_for("stopping")
        second = await h.wait_for("starting")
        assert second.spec_hash != first.spec_hash and second.pid != first.pid
        assert group_gone(first.pid)


async def test_adopts_an_engine_after_an_agent_crash(tmp_path, groups):
    spec = sim_spec()
    a = Harness(tmp_path, groups)
    async with running(a, stop=False) as nursery:  # no stop_all: the agent "crashes"
        a.sup.apply([spec])
        ready = await a.wait_for("ready")
        nursery.cancel_scope.cancel()
    assert not group_gone(ready.pid)

    b = Harness(tmp_path, groups)
    adopted = await b.sup.adopt_leftovers()
    assert [(r.replica, r.state, r.pid, r.adopted, r.url) for r in adopted] == [
        ("m/1", "starting", ready.pid, True, ready.url)]
    async with running(b) as nursery:
        nursery.start_soon(reap_like_init, ready.pid)  # it is our child, not the new supervisor's
        again = await b.wait_for("ready")
        assert (again.pid, again.adopted) == (ready.pid, True)
        b.sup.apply([spec])  # still desired: kept
        assert [(r.state, r.pid) for r in b.sup.reports()] == [("ready", ready.pid)]
        await b.sup.stop_all()
        assert (await b.wait_for("stopped")).replica == "m/1"
        assert "crashed" not in b.states()
    assert group_gone(ready.pid)


async def test_adopted_engine_no_longer_desired_is_stopped(tmp_path, groups):
    a = Harness(tmp_path, groups)
    # Not `exec sleep`: an exec changes /proc/<pid>/cmdline, and such a process is not adopted.
    script = tmp_path / "engine.py"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    script.chmod(0o755)
    spec = EngineSpec(replica="py/1", model="py", engine="llamacpp", model_path="x.gguf", binary=str(script))
    async with running(a, stop=False) as nursery:
        a.sup.apply([spec])
        first = await a.wait_for("starting")
        nursery.cancel_scope.cancel()
    b = Harness(tmp_path, groups)
    assert [r.pid for r in await b.sup.adopt_leftovers()] == [first.pid]
    async with running(b) as nursery:
        nursery.start_soon(reap_like_init, first.pid)
        b.sup.apply([])
        await b.wait_for("stopped")
        assert b.sup.reports() == []


async def test_missing_binary_fails_into_a_crash_loop(tmp_path, groups):
    h = Harness(tmp_path, groups, policy_factory=lambda: RestartPolicy(base_s=0.01, crashloop_after=2))
    spec = EngineSpec(replica="x/1", model="x", engine="vllm", model_path="m", binary=str(tmp_path / "nope"))
    async with running(h):
        h.sup.apply([spec])
        loop = await h.wait_for("crashloop")
        assert "cannot start" in loop.detail
        assert h.states() == ["failed", "failed", "crashloop"]


async def test_stop_all_without_run_stops_adopted_engines(tmp_path, groups):
    script = tmp_path / "engine.py"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    script.chmod(0o755)
    spec = EngineSpec(replica="py/1", model="py", engine="llamacpp", model_path="x.gguf", binary=str(script))
    a = Harness(tmp_path, groups)
    async with running(a, stop=False) as nursery:
        a.sup.apply([spec])
        first = await a.wait_for("starting")
        nursery.cancel_scope.cancel()
    b = Harness(tmp_path, groups)
    assert len(await b.sup.adopt_leftovers()) == 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reap_like_init, first.pid)
        with trio.fail_after(5):
            await b.sup.stop_all()
    assert group_gone(first.pid) and b.sup.reports() == []
    assert list((tmp_path / "engines").iterdir()) == []


def test_a_just_spawned_engine_is_recognised(tmp_path):
    """Adoption right after a spawn (what the test above does): the kernel tells the spawner that
    exec succeeded before it lays out the new program's arguments, so /proc/<pid>/cmdline is empty
    for a moment. The identity check must not take that for another process, which adoption would
    then leave running unsupervised. Each spawn is checked at once, as adopt_leftovers would."""
    script = tmp_path / "engine.py"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    script.chmod(0o755)
    cmd = [str(script), "-m", "x.gguf", "--port", "1"]
    for _ in range(150):
        proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            starttime = processes.process_starttime(proc.pid)
            assert processes.is_same_process(proc.pid, proc.pid, cmd, starttime)
        finally:
            proc.kill()
            proc.wait()


def test_an_empty_cmdline_is_ours_only_with_a_matching_start_time(tmp_path, monkeypatch):
    """The rule above, without the race: a live process caught inside exec (no argv yet) is the
    recorded engine when pid, group and start time match, and is never taken for it on the pid alone."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        starttime = processes.process_starttime(proc.pid)
        monkeypatch.setattr(processes, "read_cmdline", lambda pid: [])
        assert processes.is_same_process(proc.pid, proc.pid, ["sleep", "60"], starttime)
        assert not processes.is_same_process(proc.pid, proc.pid, ["sleep", "60"], None)
        assert not processes.is_same_process(proc.pid, proc.pid, ["sleep", "60"], (starttime or 0) + 1)
        monkeypatch.setattr(processes, "read_cmdline", lambda pid: ["other", "60"])
        assert not processes.is_same_process(proc.pid, proc.pid, ["sleep", "60"], starttime)
    finally:
        proc.kill()
        proc.wait()


async def test_stop_all_after_run_was_cancelled(tmp_path, groups):
    """The agent's shutdown order: its nursery (and run) is cancelled, then stop_all in a finally."""
    script = tmp_path / "engine.py"
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    script.chmod(0o755)
    specs = [EngineSpec(replica=f"py/{i}", model="py", engine="llamacpp", model_path="x.gguf", binary=str(script))
             for i in range(2)]
    h = Harness(tmp_path, groups)
    async with running(h, stop=False) as nursery:
        h.sup.apply(specs)
        pids = [(await h.wait_for("starting")).pid for _ in specs]
        nursery.cancel_scope.cancel()
    assert not any(group_gone(p) for p in pids)
    with trio.fail_after(5):
        await h.sup.stop_all()
    assert all(group_gone(p) for p in pids) and h.sup.reports() == []
    assert sorted(r.replica for r in h.recv_nowait_all() if r.state == "stopped") == ["py/0", "py/1"]


async def test_stale_records_are_cleaned_up(tmp_path, groups):
    rec_dir = tmp_path / "engines"
    rec_dir.mkdir()
    dead, (leader, child) = _dead_pid(), _leftover_group()
    groups.add(leader)
    assert not group_gone(leader)
    spec = sim_spec()
    for name, pid in (("dead", dead), ("orphans", leader)):
        (rec_dir / f"{name}.json").write_text(json.dumps({
            "replica": name, "pid": pid, "pgid": pid, "port": 1, "url": "http://127.0.0.1:1",
            "cmd": ["engine"], "spec": spec.to_wire(), "spec_hash": spec.spec_hash(), "started_at": 0}))
    (rec_dir / "garbage.json").write_text("{not json")
    h = Harness(tmp_path, groups)
    assert await h.sup.adopt_leftovers() == []
    assert list(rec_dir.iterdir()) == []
    with trio.fail_after(5):
        while os.path.exists(f"/proc/{child}") and not _zombie(child):
            await trio.sleep(0.01)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _leftover_group() -> tuple[int, int]:
    """A group whose leader exited (and was reaped) and left a child behind, as an engine's worker."""
    p = subprocess.Popen(["sh", "-c", "sleep 60 >/dev/null & echo $!"], stdout=subprocess.PIPE,
                         start_new_session=True)
    return p.pid, int(p.communicate()[0])


async def reap_like_init(pid: int) -> None:
    """Reap `pid` once it dies, as init reaps an engine whose agent died."""
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:  # noqa: ASYNC222 — WNOHANG does not block
                return
        except ChildProcessError:
            return
        await trio.sleep(0.02)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


if not sys.platform.startswith("linux"):
    pytest.skip("engine supervision reads /proc", allow_module_level=True)
