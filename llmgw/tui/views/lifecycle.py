"""Lifecycle: per model its live and candidate revisions (state, replicas ready, canary share
with both revisions' error rate and TTFT side by side), the jobs (state, steps, times) and the
latest eval result, case by case. Actions on the selected model, through the admin API: u update
(a re-roll of its definition as a candidate), e eval (a stored suite, on the candidate or live),
p promote (optionally requiring a suite: a refusal says why), r rollback — each confirmed in a
dialog first; t opens the selected job's trace. The data is fetched while the view is shown
(every POLL_S), not streamed."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from llmgw.admin_client.printable import printable
from llmgw.tui.lifecycle_rows import (
    JOB_COLUMNS,
    REVISION_COLUMNS,
    Choice,
    eval_choices,
    eval_lines,
    job_lines,
    job_rows,
    promote_choices,
    revision_rows,
    rollback_text,
)
from llmgw.tui.lifecycle_screens import ChoiceScreen
from llmgw.tui.state import ConsoleState, as_dict
from llmgw.tui.styles import TONE_STYLE
from llmgw.tui.views.base import ConsoleView, fill_table, row_key_at

__all__ = ["POLL_S", "LifecycleView"]

POLL_S = 2.0  # the admin API is asked again this often while the view is on screen


class LifecycleView(ConsoleView):
    key = "6"
    view_id = "lifecycle"
    title = "Lifecycle"
    summary = ("revisions, canary, jobs and eval results; u update, e eval, p promote, r rollback (confirmed), "
               "t a job's trace")
    sections = frozenset({"lifecycle", "models"})
    BINDINGS: ClassVar = [
        Binding("u", "update", "update", tooltip="a candidate of the selected model's definition (a re-roll)"),
        Binding("e", "eval", "eval", tooltip="run a stored suite on the candidate or the live revision"),
        Binding("p", "promote", "promote", tooltip="make the candidate live (optionally requiring a suite)"),
        Binding("r", "rollback", "rollback", tooltip="discard the candidate, or undo a recent promote"),
        Binding("t", "trace", "trace", tooltip="the selected job's trace: its steps on a timeline"),
    ]

    def body(self) -> ComposeResult:
        yield Static(id="lifecycle-status", classes="detail", markup=False)
        yield Static("revisions", classes="section-title")
        yield DataTable(id="revisions-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="eval-detail", classes="detail", markup=False)
        yield Static("jobs", classes="section-title")
        yield DataTable(id="jobs-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="job-detail", classes="detail", markup=False)

    def on_mount(self) -> None:
        self.set_interval(POLL_S, self._poll)

    def shown(self) -> None:
        self.host.refresh_lifecycle()

    def _poll(self) -> None:
        if self.host.active_view() is self and self.screen is self.app.screen:
            self.host.refresh_lifecycle()

    def render_state(self, state: ConsoleState) -> None:
        last = as_dict(state.lifecycle.get("last_action"))
        error = state.lifecycle.get("error")
        if error:
            status = Text(printable(f"lifecycle: {error}"), style=TONE_STYLE["bad"])
        elif last.get("text"):
            status = Text(printable(str(last["text"])), style=TONE_STYLE.get(str(last.get("tone")), ""))
        elif not state.lifecycle:
            status = Text("asking the daemon…", style="dim")
        else:
            status = Text("u update · e eval · p promote · r rollback · t trace of the selected job", style="dim")
        self.query_one("#lifecycle-status", Static).update(status)
        fill_table(self.query_one("#revisions-table", DataTable), REVISION_COLUMNS,
                   revision_rows(state, self.filter_text))
        jobs = self.query_one("#jobs-table", DataTable)
        fill_table(jobs, JOB_COLUMNS, job_rows(state, self.filter_text, self.host.tz))
        self._details()

    def _details(self) -> None:
        state = self.host.state
        self.query_one("#eval-detail", Static).update(
            printable("\n".join(eval_lines(state, self.selected_model())), keep_newlines=True))
        self.query_one("#job-detail", Static).update(
            printable("\n".join(job_lines(state, row_key_at(self.query_one("#jobs-table", DataTable)), self.host.tz)),
                      keep_newlines=True))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._details()

    def selected_model(self) -> str | None:
        jobs = self.query_one("#jobs-table", DataTable)
        if jobs.has_focus:
            jid = row_key_at(jobs)
            job = next((j for j in self.host.state.lifecycle.get("jobs") or [] if isinstance(j, dict)
                        and j.get("id") == jid), None)
            return str(job["model"]) if job is not None and isinstance(job.get("model"), str) else None
        key = row_key_at(self.query_one("#revisions-table", DataTable))
        return key.split("\0")[0] if key else None

    # -- actions ------------------------------------------------------------------------------------
    def _model_or_warn(self) -> str | None:
        model = self.selected_model()
        if model is None:
            self.notify("no model selected", severity="warning")
        return model

    def _ask(self, action: str, model: str, title: str, text: str, choices: list[Choice]) -> None:
        def done(value: tuple[str, ...] | None) -> None:
            if value is not None:
                self.host.lifecycle_action(action, model, value)
        self.app.push_screen(ChoiceScreen(title, text, choices), done)

    def action_update(self) -> None:
        if (model := self._model_or_warn()) is not None:
            self._ask("update", model, f"Update {model}?", "A candidate revision of its current definition is "
                      "placed beside the live replicas (capacity permitting); it takes no client traffic. To "
                      "change the definition: llmgw ctl models update NAME --set key=value.",
                      [Choice(f"update {model} (re-roll)", ())])

    def action_eval(self) -> None:
        if (model := self._model_or_warn()) is None:
            return
        choices = eval_choices(self.host.state, model)
        if not choices:
            self.notify("no stored suites: llmgw ctl suites put NAME FILE.toml stores one", severity="warning")
            return
        self._ask("eval", model, f"Evaluate {model} with a suite", "", choices)

    def action_promote(self) -> None:
        if (model := self._model_or_warn()) is None:
            return
        choices = promote_choices(self.host.state, model)
        if not choices:
            self.notify(f"{model} has no candidate to promote: u makes one", severity="warning")
            return
        self._ask("promote", model, f"Promote the candidate of {model}?", "The candidate takes the model's "
                  "traffic at once; the live replicas drain after their in-flight requests. A required suite "
                  "must have passed on this candidate, or the daemon refuses.", choices)

    def action_rollback(self) -> None:
        if (model := self._model_or_warn()) is None:
            return
        text = rollback_text(self.host.state, model)
        if text is None:
            self.notify(f"{model}: nothing to roll back", severity="warning")
            return
        self._ask("rollback", model, f"Roll back {model}?", text, [Choice(f"roll back {model}", ())])

    def action_trace(self) -> None:
        jid = row_key_at(self.query_one("#jobs-table", DataTable))
        if jid is None:
            self.notify("no job selected", severity="warning")
            return
        self.host.open_trace(jid)
