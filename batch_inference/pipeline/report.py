"""Human views of a run: rich progress bars while it runs, the ledger as a table after.

Kept apart from the CLI so a script or notebook can use them too.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from batch_inference.pipeline.summaries import LedgerView, rate


OFF_TTY_WIDTH = 160  # the ledger table's columns fit without wrapping


def output_console() -> Console:
    """A console for the CLI's tables: the terminal's width on a TTY; off a TTY (logs, CI,
    ``| tee``) ``COLUMNS`` if set, else ``OFF_TTY_WIDTH``, not rich's 80 columns, which
    squeezes the ledger table's eleven columns to one character each."""
    if Console().is_terminal or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=OFF_TTY_WIDTH)


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} rec/s" if speed else "- rec/s", style="cyan")


class _TokensColumn(ProgressColumn):
    """Output tokens/s of the phase so far (what the engine delivered, not how often it was called)."""

    def render(self, task: Task) -> Text:
        tokens, elapsed = task.fields.get("tokens_out", 0), task.finished_time or task.elapsed
        return Text(f"{tokens / elapsed:,.0f} tok/s" if tokens and elapsed else "", style="magenta")


class _ApprovalColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        approved, judged = task.fields.get("approved", 0), task.fields.get("judged", 0)
        return Text(f"approved {approved / judged:.1%}" if judged else "", style="green")


class RichReporter:
    """A progress bar per phase: records done / total, records/s, output tokens/s, approval so
    far, elapsed and the phase's ETA (from its measured throughput); after each round, the
    run's ETA (``round_decided``: the decision's ``eta_run_s``, the remaining pending set
    simulated at the round's measured throughput) and the plan's figure when one was recorded."""

    def __init__(self, console: Console | None = None) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description:<14}"), BarColumn(), MofNCompleteColumn(), _RateColumn(), _TokensColumn(),
            _ApprovalColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False,
        )
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> RichReporter:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def phase_started(self, name: str, total_records: int) -> None:
        self._tasks[name] = self.progress.add_task(name, total=max(total_records, 0), approved=0, judged=0, tokens_out=0)

    def shard_done(self, name: str, records: int, counts: dict[str, int], tokens_out: int = 0) -> None:
        task_id = self._tasks.get(name)
        if task_id is None:
            return
        task = self.progress._tasks[task_id]
        approved = task.fields.get("approved", 0) + int(counts.get("approved", 0))
        judged = task.fields.get("judged", 0) + sum(int(counts.get(k, 0)) for k in ("approved", "rejected", "max_attempts"))
        self.progress.update(task_id, advance=records, approved=approved, judged=judged,
                             tokens_out=task.fields.get("tokens_out", 0) + tokens_out)

    def phase_ended(self, name: str) -> None:
        task_id = self._tasks.get(name)
        if task_id is not None:
            self.progress.update(task_id, completed=self.progress._tasks[task_id].total)

    def round_decided(self, r: int, kind: str, figures: dict[str, Any]) -> None:
        """One line after each round: what follows, and the run's ETA (and plan) if known."""
        eta, planned = figures.get("eta_run_s"), figures.get("planned_run_wall_s")
        text = f"round {r} -> {kind}"
        if eta is not None:
            text += f"; run ETA {_clock(float(eta))}"
        if planned is not None:
            text += f" (planned run wall {_clock(float(planned))})"
        self.progress.console.print(text)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _bar(fraction: float, width: int = 8) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def _n(x: Any) -> str:
    return f"{int(x):,}" if x is not None else "-"


def _k(x: Any) -> str:
    """Compact token counts: 62,481 -> 62.5k."""
    x = int(x or 0)
    return f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else str(x)


def _s(x: Any) -> str:
    return f"{float(x):.2f}" if x is not None else "-"


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f}" if tokens_per_s else "-"


def ledger_table(view: LedgerView, title: str) -> Table:
    """Per round (and tail): the funnel, tokens, engine time, wall, output tokens/s (the
    inference phase's: what the engine delivered), fill, and the decision.

    "in" is the round's pending records (quarantined shards included); "failed" the records
    that ended failed in it (its quarantined shards' and its permanent errors, ``RoundView.failed``);
    the funnel is approved / in (``RoundView.approval``).
    """
    table = Table(title=title, show_lines=False)
    for col, justify in [("phase", "left"), ("in", "right"), ("approved", "right"), ("rejected", "right"),
                         ("failed", "right"), ("funnel", "left"), ("tokens in/out", "right"),
                         ("engine s", "right"), ("wall s", "right"), ("out tok/s", "right"), ("fill", "right"),
                         ("next", "left")]:
        table.add_column(col, justify=justify, no_wrap=col in ("funnel", "tokens in/out"))  # type: ignore[arg-type]
    if s := view.shard:
        note = f"{s.shards} shards" + (f", {s.duplicate_ids} dup ids" if s.duplicate_ids else "")
        table.add_row("shard", _n(s.records), "", "", "", "", "", "", _s(s.wall_s), "", "", note)
    for rnd in view.rounds:
        judged = rnd.judge is not None
        table.add_row(f"round {rnd.round}", _n(rnd.records_in), _n(rnd.approved if judged else None),
                      _n(rnd.rejected if judged else None), _n(rnd.failed),
                      f"{_bar(rnd.approval)} {rnd.approval:.0%}", f"{_k(rnd.tokens_in)}/{_k(rnd.tokens_out)}",
                      _s(rnd.engine_busy_s), _s(rnd.wall_s), _rate(rnd.output_tokens_per_s), _s(rnd.avg_fill),
                      rnd.decision.kind if rnd.decision else "…")
    if t := view.tail:
        approval = rate(t.approved, t.records_total)
        table.add_row(f"tail (from {t.round})", _n(t.records_total), _n(t.approved),
                      f"{_n(t.counts.get('max_attempts', 0))}*", _n(t.records_quarantined + t.counts.get("error", 0)),
                      f"{_bar(approval)} {approval:.0%}", f"{_k(t.tokens_in)}/{_k(t.tokens_out)}", _s(t.engine_busy_s),
                      _s(t.wall_s), _rate(t.output_tokens_per_s), _s(t.avg_fill), "")
    return table


def run_lines(view: LedgerView) -> list[str]:
    """The run's verdict in a few lines (status, terminal counts, conservation)."""
    if not (r := view.run):
        waiting = [f"round {x.round}: {x.judge.counts['review']} record(s) sent to human review "
                   "(`batch-inference review SPEC` serves the page; the run goes on once they are decided)"
                   for x in view.rounds if x.judge is not None and x.judge.counts.get("review") and x.decision is None]
        return [*waiting, "run not finalized yet (re-run `batch-inference run SPEC` to resume)"]
    c = r.conservation
    lines = [f"round {d.round} -> {d.kind}: {d.reason}" for d in (x.decision for x in view.rounds) if d]
    lines += [
        f"status: {r.status}  ({r.strategy}, {r.rounds} round(s){', tail' if r.tail else ''})",
        f"records {r.records:,}: approved {r.approved:,}, exhausted {r.exhausted:,}, "
        f"max_attempts {r.max_attempts:,}, failed {r.failed:,}" + (f" ({r.quarantined:,} in quarantined shards)" if r.quarantined else ""),
        f"conservation: {'OK' if c.ok else 'FAILED'} (missing {c.missing}, extra {c.extra}, "
        f"duplicated in results {c.duplicate_results}; {c.method})",
        f"results: {r.results_url}",
    ]
    return lines
