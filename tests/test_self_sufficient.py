"""A clone is self-sufficient: the tests read nothing outside the repository, and the data they
read is the data tests/data/README.md describes."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def test_golden_vectors_are_the_copy_the_readme_describes() -> None:
    readme = (TESTS / "data" / "README.md").read_text()
    recorded = re.search(r"sha256 `([0-9a-f]{64})`", readme)
    assert recorded, "tests/data/README.md must record the sha256 of vllm-golden.json"
    actual = hashlib.sha256((TESTS / "data" / "vllm-golden.json").read_bytes()).hexdigest()
    assert actual == recorded.group(1), "vllm-golden.json changed: regenerate it as the README says, then record its hash"


def test_no_test_reads_outside_the_repository() -> None:
    """The sibling folders of a development checkout (../shared and the like) are not in a clone."""
    outside = re.compile(r"parents\[[2-9]\]|\.\./shared|shared/(specs|tools)|\"shared\"")
    offenders = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
                 for p in sorted(TESTS.rglob("*.py")) if p.name != Path(__file__).name
                 for n, line in enumerate(p.read_text().splitlines(), 1)
                 if outside.search(line) and not line.lstrip().startswith("#")]
    assert offenders == []


def test_scripts_need_nothing_outside_the_repository() -> None:
    for script in sorted((ROOT / "scripts").iterdir()):
        if script.is_file():
            assert "../shared" not in script.read_text(), script.name
    assert "scripts/build-llama-server" in (ROOT / "scripts" / "test").read_text()
