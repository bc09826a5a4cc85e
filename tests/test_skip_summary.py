"""scripts/test's closing block (tests/skip_summary.py): a run that skipped tests ends by saying
how many, grouped by reason, with the reason there is no llama-server for the real-engine ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = '''
import os
import pytest

@pytest.fixture
def server():
    if not os.environ.get("LLMGW_LLAMA_SERVER"):
        pytest.skip("LLMGW_LLAMA_SERVER is not set (path to a llama-server binary)")

@pytest.mark.parametrize("target", ["sim", pytest.param("real", marks=pytest.mark.realengine)])
def test_contract(target, request):
    if target == "real":
        request.getfixturevalue("server")

@pytest.mark.parametrize("i", range(3))
def test_real_too(i, server):
    pass

def test_plain():
    pytest.skip("needs a GPU")

def test_ok():
    pass
'''


def run(tmp_path: Path, sample: str, **env: str) -> str:
    (tmp_path / "test_sample.py").write_text(sample)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  realengine: needs a real llama-server\n")
    full_env = {k: v for k, v in os.environ.items() if k not in ("LLMGW_LLAMA_SERVER", "LLMGW_LLAMA_WHY")}
    full_env.update(PYTHONPATH=str(ROOT), **env)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.skip_summary", "-p", "no:cacheprovider",
                          "-q", "-rs", str(tmp_path)], cwd=tmp_path, env=full_env, capture_output=True, text=True,
                         timeout=120, check=False)
    return out.stdout


def closing_block(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "what was skipped, and why" in line)
    assert all("what was skipped" not in line for line in lines[start + 1:])
    return lines[start + 1:-1]  # up to pytest's totals, which stay last


def test_the_run_ends_with_the_skips_grouped_and_why(tmp_path: Path) -> None:
    out = run(tmp_path, SAMPLE, LLMGW_LLAMA_WHY="the llama-server build failed: see .venv/log/llama-build.log")
    assert closing_block(out) == [
        ("4 tests against a real llama-server skipped: no llama-server "
         "(the llama-server build failed: see .venv/log/llama-build.log)"),
        "1 test skipped: needs a GPU",
    ]
    assert out.rstrip().splitlines()[-1].lstrip("= ").startswith("2 passed, 5 skipped")
    assert out.index("short test summary info") < out.index("what was skipped, and why")


def test_a_plain_pytest_run_says_how_to_get_a_server(tmp_path: Path) -> None:
    block = closing_block(run(tmp_path, SAMPLE))
    assert block[0] == ("4 tests against a real llama-server skipped: no llama-server "
                        "(LLMGW_LLAMA_SERVER is not set; scripts/test builds one with scripts/build-llama-server)")


def test_a_run_that_skipped_nothing_says_so(tmp_path: Path) -> None:
    assert closing_block(run(tmp_path, "def test_ok():\n    pass\n")) == ["nothing was skipped"]
