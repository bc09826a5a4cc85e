"""The console: a Textual app over the admin API's event stream. The views come from the
registry (llmgw.tui.views.VIEWS): each gets a tab and its number key. Events are applied to a
ConsoleState as they arrive; the views are redrawn a few times a second at most, and only the
one on screen (the others are marked stale and redrawn when shown), so a busy router's stream of
decisions costs the terminal little."""

from __future__ import annotations

import time
from datetime import tzinfo
from typing import Any, ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Header, Static, TabbedContent, TabPane

from llmgw.admin_client.printable import printable
from llmgw.tui.client import AdminAPI, AdminError, Backoff, follow
from llmgw.tui.facility_screens import PlacementScreen
from llmgw.tui.holds import HoldEdit
from llmgw.tui.labels import LabelEdit
from llmgw.tui.lifecycle_fetch import fetch_lifecycle
from llmgw.tui.lifecycle_rows import lifecycle_models
from llmgw.tui.rationale import RationaleScreen
from llmgw.tui.rows import banner_text, status_line
from llmgw.tui.state import ConsoleState
from llmgw.tui.styles import CONSOLE_CSS
from llmgw.tui.trace_screen import TraceScreen
from llmgw.tui.views import VIEWS, ConsoleView

__all__ = ["ConsoleApp"]

REDRAW_S = 0.25  # at most four redraws a second, however fast decisions come
# ...and a redraw's cost buys that much quiet after it: filling tables takes at most this share of
# the time (rendering them roughly as much again), so a busy router's console stays light on its host
REDRAW_BUDGET = 0.1
FACILITY_REFRESH_S = 5.0  # the Facility (Tenants, Models) view refetches GET /api/v1/facility (tenants, autoscale)
# this often while shown


class ConsoleApp(App[int]):
    CSS = CONSOLE_CSS
    TITLE = "llmgw console"
    ENABLE_COMMAND_PALETTE = False
    view_types = VIEWS
    BINDINGS: ClassVar = [
        *(Binding(v.key, f"show('{v.view_id}')", v.title, key_display=v.key) for v in VIEWS),
        Binding("/", "filter", "filter", tooltip="narrow the rows: words that must all appear; esc clears"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, client: AdminAPI, *, tz: tzinfo | None = None, backoff: Any = None, max_decisions: int = 500,
                 redraw_s: float = REDRAW_S, redraw_budget: float = REDRAW_BUDGET) -> None:
        """``tz``: the zone of the wall times shown (None: local); ``backoff``: anything with
        ``delay(attempt) -> seconds`` (tests pass their own)."""
        super().__init__()
        self.client = client
        self.tz = tz
        self.backoff = backoff or Backoff()
        self.state = ConsoleState(max_decisions=max_decisions)
        self.sub_title = client.where
        self.redraw_s, self.redraw_budget = redraw_s, redraw_budget
        self._quiet_until = 0.0
        self.shown_rev = -1  # the state revision the screen shows (tests wait on it)
        self._dirty: set[str] = set()
        # held, not queried: the redraw timer may fire while the DOM is torn down at exit
        self._views = {v.view_id: v() for v in VIEWS}
        self._banner = Static(id="banner", markup=False)
        self._status = Static(status_line(self.state, client.where), id="status", markup=False)
        self._tabs = TabbedContent(initial=VIEWS[0].view_id, id="views")

    def compose(self) -> ComposeResult:
        yield Header()
        yield self._banner
        with self._tabs:
            for v in VIEWS:
                with TabPane(f"{v.key} {v.title}", id=v.view_id):
                    yield self._views[v.view_id]
        yield self._status
        yield Footer()

    def on_mount(self) -> None:
        self.run_worker(follow(self.client, self._on_event, self._on_lost, self.backoff), name="events",
                        group="events")
        self.set_interval(self.redraw_s, self._redraw)
        self.set_interval(FACILITY_REFRESH_S, self._facility_tick)
        self._activated()  # headers and an empty table, even if no snapshot ever comes

    async def on_unmount(self) -> None:
        await self.client.aclose()

    # -- the stream ---------------------------------------------------------------------------------
    def _on_event(self, event: dict[str, Any]) -> None:
        self._dirty |= self.state.apply(event)

    def _on_lost(self, attempt: int, reason: str) -> None:
        self._dirty |= self.state.lost(attempt, reason)
        self._redraw(force=True)  # the banner should not wait

    def _redraw(self, force: bool = False) -> None:
        now = time.monotonic()
        if (now < self._quiet_until and not force) or not self._tabs.is_attached:
            return
        dirty, self._dirty = self._dirty, set()
        if dirty:
            for view in self._views.values():
                if view.sections & dirty:
                    view.stale = True
            active = self.active_view()
            if active.stale:
                active.refresh_from(self.state)
                cost = time.monotonic() - now
                self._quiet_until = now + cost * (1 / self.redraw_budget - 1)
        if dirty or self.shown_rev != self.state.rev:  # a ping moves the revision only
            self._show_link()
        self.shown_rev = self.state.rev

    def _show_link(self) -> None:
        text = banner_text(self.client.where, self.state.link)
        self._banner.display = text is not None
        self._banner.update(text or "")
        self._status.update(status_line(self.state, self.client.where))

    # -- navigation ---------------------------------------------------------------------------------
    def active_view(self) -> ConsoleView:
        return self._views.get(self._tabs.active) or self._views[VIEWS[0].view_id]

    def action_show(self, view_id: str) -> None:
        while len(self.screen_stack) > 1:  # e.g. from a rationale straight to another view
            self.pop_screen()
        self._tabs.active = view_id
        self._activated()

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self._activated()

    def _activated(self) -> None:
        if not self._tabs.is_attached:
            return
        view = self.active_view()
        if view.view_id == "facility":
            self.refresh_facility()
        elif view.view_id == "tenants":
            self.refresh_tenants()
        elif view.view_id == "models":
            self.refresh_autoscale()
        if view.stale:
            view.refresh_from(self.state)
        view.focus_main()
        view.shown()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # over a rationale or a dialog the views' filters are out of reach
        return not (action == "filter" and len(self.screen_stack) > 1)

    def action_filter(self) -> None:
        self.active_view().open_filter()

    # -- what views ask for ---------------------------------------------------------------------------
    def open_rationale(self, seq: int) -> None:
        decision = self.state.decision(seq)
        if decision is None:
            self.notify("that decision has left the console's history", severity="warning")
            return
        self.push_screen(RationaleScreen(decision, self.tz))

    def open_trace(self, request_id: str) -> None:
        self.run_worker(self._open_trace(request_id), group="trace", exclusive=True)

    async def _open_trace(self, request_id: str) -> None:
        try:
            trace = await self.client.trace(request_id)
        except AdminError as e:
            self.notify(f"no trace of {printable(request_id)}: {e}", severity="warning", timeout=6)
            return
        self.push_screen(TraceScreen(trace, self.tz))

    def apply_labels(self, node: str, edit: LabelEdit) -> None:
        self.run_worker(self._apply_labels(node, edit), group="labels")

    async def _apply_labels(self, node: str, edit: LabelEdit) -> None:
        view: dict[str, Any] | None = None
        try:
            if edit.set:
                view = await self.client.set_labels(node, dict(edit.set))
            if edit.remove:
                view = await self.client.remove_labels(node, list(edit.remove))
        except AdminError as e:
            done = "labels set, but not removed" if view else "labels not changed"
            self.notify(f"{node}: {done}: {e}", severity="error", timeout=8)
        else:
            self.notify(f"{node}: {edit.describe()}")
        if view:  # the daemon's answer, ahead of the stream's next update
            self._dirty |= self.state.put_node(view)
            self._redraw(force=True)

    def apply_hold(self, edit: HoldEdit) -> None:
        self.run_worker(self._apply_hold(edit), group="holds")

    async def _apply_hold(self, edit: HoldEdit) -> None:
        try:
            if edit.action == "hold":
                await self.client.hold(edit.domain, edit.reason, edit.drain)
            else:
                await self.client.release(edit.domain)
        except AdminError as e:
            self.notify(f"{edit.domain}: not changed: {e}", severity="error", timeout=8)
        else:
            self.notify(edit.describe())  # the nodes' held domains follow with the stream's next update
            self.refresh_facility()

    # -- the facility view's data: not in the stream, fetched while it is shown ------------------------
    def _facility_tick(self) -> None:
        if not self._tabs.is_attached or len(self.screen_stack) != 1:
            return
        shown = self.active_view().view_id
        if shown == "facility":
            self.refresh_facility()
        elif shown == "tenants":
            self.refresh_tenants()
        elif shown == "models":
            self.refresh_autoscale()

    def refresh_autoscale(self) -> None:
        """GET /api/v1/autoscale (the Models view's autoscale column: not in the stream, fetched while shown)."""
        self.run_worker(self._refresh_autoscale(), group="autoscale", exclusive=True)

    async def _refresh_autoscale(self) -> None:
        fetch = getattr(self.client, "autoscale", None)
        if fetch is None:
            return
        try:
            views = await fetch()
        except AdminError:
            return  # the column keeps what it had: the banner speaks of a lost daemon, not every view
        self._dirty |= self.state.put_autoscale(views)
        self._redraw(force=True)

    def refresh_tenants(self) -> None:
        """GET /api/v1/tenants (the Tenants view: not in the stream, fetched while it is shown)."""
        self.run_worker(self._refresh_tenants(), group="tenants", exclusive=True)

    async def _refresh_tenants(self) -> None:
        try:
            views = await self.client.tenants()
        except AdminError as e:
            self.notify(f"tenants: {e}", severity="warning", timeout=6)
            return
        self._dirty |= self.state.put_tenants(views)
        self._redraw(force=True)

    def refresh_facility(self) -> None:
        self.run_worker(self._refresh_facility(), group="facility", exclusive=True)

    async def _refresh_facility(self) -> None:
        try:
            view = await self.client.facility()
        except AdminError as e:
            self.notify(f"facility: {e}", severity="warning", timeout=6)
            return
        self._dirty |= self.state.put_facility(view)
        self._redraw(force=True)

    def explain_placement(self, target: str) -> None:
        self.run_worker(self._explain_placement(target), group="placement")

    async def _explain_placement(self, target: str) -> None:
        try:
            e = await self.client.explain_placement(target)
        except AdminError as err:
            self.notify(f"{target}: no explanation: {err}", severity="error", timeout=8)
            return
        self.push_screen(PlacementScreen(e))

    # -- the model lifecycle (views/lifecycle.py) -------------------------------------------------------
    def refresh_lifecycle(self) -> None:
        self.run_worker(self._refresh_lifecycle(), group="lifecycle", exclusive=True)

    async def _refresh_lifecycle(self) -> None:
        before = self.state.lifecycle
        try:
            data = await fetch_lifecycle(self.client, lifecycle_models(self.state), before)
        except AdminError as e:
            data = {**before, "error": str(e)}
        data["last_action"] = before.get("last_action")
        self._dirty |= self.state.put_lifecycle(data)
        self._redraw(force=True)

    def lifecycle_action(self, action: str, model: str, args: tuple[str, ...]) -> None:
        self.run_worker(self._lifecycle_action(action, model, args), group="lifecycle-action")

    async def _lifecycle_action(self, action: str, model: str, args: tuple[str, ...]) -> None:
        c = self.client
        try:
            if action == "update":
                job = await c.update_model(model)
            elif action == "eval":
                job = await c.eval_model(model, args[0], args[1])
            elif action == "promote":
                job = await c.promote(model, list(args))
            else:
                job = await c.rollback(model)
        except AdminError as e:
            text, tone = f"{action} {model} refused: {e}", "bad"
            self.notify(printable(text), severity="error", timeout=12)
        else:
            text, tone = f"{action} {model}: job {job.get('id', '?')} {job.get('state', '?')}", "good"
            self.notify(printable(text))
        self.state.lifecycle["last_action"] = {"text": text, "tone": tone}
        self._dirty.add("lifecycle")
        await self._refresh_lifecycle()
