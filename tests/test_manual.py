"""The manual ships inside the package: building copies docs/ into llmgw/manual/pages (setup.py),
`llmgw help` lists its topics and prints one, and the admin API serves the eval suites' schema
beside its OpenAPI document."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import llmgw.manual as manual
from llmgw.cli import entry as cli
from llmgw.lifecycle.suite_json import suite_json_schema

from .admin_support import admin_stack

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_the_built_package_carries_exactly_the_docs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(DOCS, src / "docs")
    shutil.copytree(ROOT / "llmgw", src / "llmgw", ignore=shutil.ignore_patterns("__pycache__", "pages"))
    out = tmp_path / "build"
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)], cwd=src,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    pages = out / "llmgw" / "manual" / "pages"
    shipped = {p.name: p.read_bytes() for p in pages.iterdir()}
    expected = {p.name: p.read_bytes() for p in [*DOCS.glob("*.md"), DOCS / "admin-api.openapi.json"]}
    assert shipped == expected


def test_the_package_copy_wins_over_the_source_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "router.md").write_text("# The router, shipped\n")
    monkeypatch.setattr(manual, "SHIPPED", tmp_path)
    assert [(t.name, t.title) for t in manual.topics()] == [("router", "The router, shipped")]
    assert manual.read("Router.md") == "# The router, shipped\n"
    monkeypatch.setattr(manual, "SHIPPED", tmp_path / "absent")
    monkeypatch.setattr(manual, "SOURCE", tmp_path / "absent-too")
    assert manual.topics() == []
    with pytest.raises(manual.UnknownTopic, match="installed without its manual"):
        manual.read("router")


def test_help_lists_every_page_and_prints_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["help"]) == 0
    out = capsys.readouterr().out
    assert "usage: llmgw <command>" in out
    for page in DOCS.glob("*.md"):
        assert f"\n  {page.stem} " in out, page.stem
    assert cli.main(["help", "router"]) == 0  # not a terminal: no pager, the page as it is
    assert capsys.readouterr().out == (DOCS / "router.md").read_text(encoding="utf-8")


def test_help_says_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["help", "routr"]) == 2
    assert "no help topic 'routr'; did you mean router" in capsys.readouterr().err
    assert cli.main(["help", "../../etc/passwd"]) == 2
    assert "no help topic" in capsys.readouterr().err
    assert cli.main(["help", "router", "console"]) == 2
    assert "one topic at a time" in capsys.readouterr().err
    assert cli.main(["help", "--help"]) == 0
    assert "TOPIC" in capsys.readouterr().out


@pytest.mark.anyio
async def test_the_admin_api_serves_the_suite_schema_beside_openapi(tmp_path: Path) -> None:
    async with admin_stack(tmp_path) as s:
        async with s.tcp_client() as c:
            r = await c.get("/api/v1/suite-schema.json")
            assert r.status_code == 200 and r.json() == suite_json_schema()
            assert (await c.get("/api/v1/openapi.json")).status_code == 200
        async with s.tcp_client(token=None) as c:
            assert (await c.get("/api/v1/suite-schema.json")).status_code == 401
