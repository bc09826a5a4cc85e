"""The admin API's types for the config file while the daemon runs (`GET /api/v1/config/check`,
`POST /api/v1/config/reload`; docs/configuration.md, "Reloading the config file")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmgw.admin.typeinfo import prop

__all__ = ["ConfigChangeView", "ConfigReport"]


@dataclass(slots=True)
class ConfigChangeView:
    section: str = prop("`models.NAME`, or a top-level section: `strategies`, `facility`, `server`, …")
    key: str = prop("the dotted key within it (`deploy.args`); empty for the whole section or model")
    action: Literal["apply", "candidate", "restart"] = prop(
        "apply: in force at once; candidate: the model's new definition is placed beside the live one and goes "
        "through eval → promote; restart: takes effect at the daemon's next start")
    old: str = prop("the value in force, as JSON (`-`: none)")
    new: str = prop("the file's value, as JSON (`-`: none)")
    why: str = prop("why this action")


@dataclass(slots=True)
class ConfigReport:
    file: str = prop("the config file the daemon started with, re-read")
    applied: bool = prop("true for a reload (what could apply did); false for a check (nothing changed)")
    changes: list[ConfigChangeView] = prop("every difference between the file and what runs")
    jobs: list[str] = prop("the update jobs of the candidates a reload made (`GET /api/v1/jobs/{id}`)")
