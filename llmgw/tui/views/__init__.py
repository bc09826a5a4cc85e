"""The registry of console views, in tab order. A view listed here gets its tab, its key (which
the app binds), and its lines in the help."""

from __future__ import annotations

from llmgw.tui.views.adapters import AdaptersView
from llmgw.tui.views.base import ConsoleView
from llmgw.tui.views.cache import CacheView
from llmgw.tui.views.decisions import DecisionsView
from llmgw.tui.views.facility import FacilityView
from llmgw.tui.views.help import HelpView
from llmgw.tui.views.lifecycle import LifecycleView
from llmgw.tui.views.models import ModelsView
from llmgw.tui.views.nodes import NodesView
from llmgw.tui.views.tenants import TenantsView

__all__ = ["VIEWS", "ConsoleView"]

VIEWS: tuple[type[ConsoleView], ...] = (NodesView, ModelsView, DecisionsView, CacheView, AdaptersView, LifecycleView,
                                        FacilityView, TenantsView, HelpView)

if len({v.key for v in VIEWS}) != len(VIEWS) or len({v.view_id for v in VIEWS}) != len(VIEWS):
    raise RuntimeError("two console views share a key or an id")
