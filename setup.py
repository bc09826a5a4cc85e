"""The manual ships inside the package: `llmgw help TOPIC` reads it. The one source is docs/;
building copies its pages into the package as llmgw/manual/pages/ (every other setting is in
pyproject.toml). A source checkout (or an editable install) reads docs/ itself."""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DOCS = Path(__file__).resolve().parent / "docs"
PAGES = ("*.md", "admin-api.openapi.json")


class build_py_with_manual(build_py):  # noqa: N801 - setuptools' naming
    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "llmgw" / "manual" / "pages"
        dest.mkdir(parents=True, exist_ok=True)
        for pattern in PAGES:
            for page in sorted(DOCS.glob(pattern)):
                shutil.copyfile(page, dest / page.name)


setup(cmdclass={"build_py": build_py_with_manual})
