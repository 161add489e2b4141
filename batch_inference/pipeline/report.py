"""Human views of a run: rich progress bars while it runs, the ledger as a table after.

Kept apart from the CLI so a script or notebook can use them too.
"""

from __future__ import annotations

import os
import time
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
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

from batch_inference.pipeline.accounting import InputAccount
from batch_inference.pipeline.counts import Counts
from batch_inference.pipeline.summaries import LedgerView, PhaseSummary, RunSummary, rate


OFF_TTY_WIDTH = 160  # the ledger table's columns fit without wrapping
REVIEW_LINE_EVERY_S = 30.0  # while a round waits for people: a new "N left" line at most this often


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
    simulated at the round's measured throughput) and the plan's figure when one was recorded;
    while a round waits for people, "round R: waiting for review (N left)" (``review_waiting``)."""

    def __init__(self, console: Console | None = None) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description:<14}"), BarColumn(), MofNCompleteColumn(), _RateColumn(), _TokensColumn(),
            _ApprovalColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console, transient=False,
        )
        self._tasks: dict[str, Any] = {}
        self._review_said: dict[int, tuple[str, float]] = {}  # round -> (last line's text, when)

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


    def review_waiting(self, r: int, text: str, url: str) -> None:
        """Called at each look while round ``r`` waits for people; prints a line when the text
        changed, the first at once and then at most every ``REVIEW_LINE_EVERY_S``."""
        last, at = self._review_said.get(r, (None, 0.0))
        now = time.monotonic()
        if text == last or (last is not None and now - at < REVIEW_LINE_EVERY_S):
            return
        self._review_said[r] = (text, now)
        hint = f"; review at {url} (`batch-inference review SPEC` serves it)" if last is None else ""
        self.progress.console.print(f"round {r}: {text}{hint}")


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


def duration(seconds: float | None) -> str:
    """A duration in the unit its magnitude calls for: ``3.3 ms``, ``189 ms``, ``12.3 s``, ``2.4 min``, ``3.1 h``."""
    if seconds is None:
        return "-"
    s = abs(float(seconds))
    sign = "-" if float(seconds) < 0 else ""
    if s == 0:
        return "0 s"
    if s < 0.9995:  # (each bound is where the next unit's rounding would start)
        ms = s * 1000
        return f"{sign}{ms:.0f} ms" if ms >= 10 else f"{sign}{ms:.2g} ms"
    if s < 9.995:
        return f"{sign}{s:.2f} s"
    if s < 59.95:
        return f"{sign}{s:.1f} s"
    if s < 3597:
        return f"{sign}{s / 60:.1f} min"
    h = s / 3600
    return f"{sign}{h:.1f} h" if h < 99.95 else f"{sign}{h:,.0f} h"


def _f(x: Any) -> str:
    return f"{float(x):.2f}" if x is not None else "-"


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f}" if tokens_per_s else "-"


# The ledger table's columns, and the order they are left out in when the console is too
# narrow for all of them ("funnel bar": the funnel keeps its percentage, loses its bar).
# When even the rest does not fit, each row is printed as a block of "name value" lines.
# "cache" (the engine's prefix-cache hit rate), "vs ideal" (prompt tokens prefilled / each
# distinct prefix computed once) and "dups" (requests answered by an identical one) appear
# only when some row has them (OPTIONAL); so does "reused" (requests answered by the
# cross-run result cache / looked up, docs/cache.md).
COLUMNS: tuple[tuple[str, str], ...] = (
    ("phase", "left"), ("in", "right"), ("approved", "right"), ("rejected", "right"), ("failed", "right"),
    ("funnel", "left"), ("tokens in/out", "right"), ("engine", "right"), ("wall", "right"), ("out tok/s", "right"),
    ("fill", "right"), ("cache", "right"), ("vs ideal", "right"), ("dups", "right"), ("reused", "right"),
    ("next", "left"),
)
OPTIONAL: frozenset[str] = frozenset({"cache", "vs ideal", "dups", "reused"})
LEAVE_OUT_ORDER: tuple[str, ...] = ("vs ideal", "dups", "reused", "fill", "cache", "out tok/s", "engine", "tokens in/out", "funnel bar", "wall")


class LedgerTable:
    """The ledger as a table that fits the width it is printed at (a rich renderable).

    All columns when they fit; else columns left out in ``LEAVE_OUT_ORDER`` (named in the
    caption); else one block per row. No value is ever cut to ``…``.
    """

    def __init__(self, title: str, rows: list[dict[str, str]], bars: dict[int, str], legend: tuple[str, ...] = ()) -> None:
        self.title, self.rows, self.bars = title, rows, bars  # bars: row index -> its funnel bar
        self.legend = legend  # lines under the table that explain a mark in it

    def table(self, left_out: tuple[str, ...] = ()) -> Table:
        shown = [name for name in left_out if name not in OPTIONAL or self._has(name)]
        caption = f"left out at this width: {', '.join(shown)}" if shown else None
        table = Table(title=self.title, caption=caption, show_lines=False)
        names = [name for name, _ in COLUMNS if name not in left_out and (name not in OPTIONAL or self._has(name))]
        for name, justify in COLUMNS:
            if name in names:
                table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
        bar = "funnel bar" not in left_out
        for i, row in enumerate(self.rows):
            cells = {**row, "funnel": f"{self.bars[i]} {row['funnel']}" if bar and i in self.bars else row["funnel"],
                     "next": row.get("next") or row.get("note", "")}
            table.add_row(*(cells.get(name, "") for name in names))
        return table

    def _has(self, name: str) -> bool:
        return any(row.get(name) for row in self.rows)

    def stacked(self, width: int) -> list[Text]:
        """Each row as its label (and what follows it), then its "name value" pairs wrapped to ``width``."""
        out: list[Text] = [Text(self.title, style="italic")]
        for row in self.rows:
            head = row["phase"] + (f" -> {row['next']}" if row.get("next") else "") + (f" ({row['note']})" if row.get("note") else "")
            out.append(Text(head, style="bold"))
            pairs = [f"{name} {row[name]}" for name, _ in COLUMNS if name not in ("phase", "next") and row.get(name)]
            line = ""
            for pair in pairs:
                if line and cell_len(line) + 2 + cell_len(pair) > width:
                    out.append(Text(line))
                    line = ""
                line = f"{line}, {pair}" if line else f"  {pair}"
            if line:
                out.append(Text(line))
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        wide = options.update_width(1_000_000)
        for n in range(len(LEAVE_OUT_ORDER) + 1):
            table = self.table(LEAVE_OUT_ORDER[:n])
            if Measurement.get(console, wide, table).maximum <= width:
                yield table
                yield from (Text(line) for line in self.legend)
                return
        yield from self.stacked(width)
        yield from (Text(line) for line in self.legend)


def ledger_table(view: LedgerView, title: str) -> LedgerTable:
    """Per round (and tail): the funnel, tokens, engine time, wall, output tokens/s (the
    inference phase's: what the engine delivered), fill, the prefix cache (hit rate, prefill
    vs the ideal) and duplicates saved where there are any, and the decision, fitted to the
    console's width (``LedgerTable``).

    "in" is the round's pending records (quarantined shards included); "failed" the records
    that ended failed in it (its quarantined shards' and its permanent errors, ``RoundView.failed``);
    approved and rejected count people's verdicts once the round's review is closed ("next" says
    ``review`` while it is open); the funnel is approved / in (``RoundView.approval``).
    """
    rows: list[dict[str, str]] = []
    bars: dict[int, str] = {}
    if s := view.shard:  # the funnel starts from the input's lines: malformed ones are left out at sharding
        account = InputAccount.of_shard(s)
        rows.append({"phase": "input", "in": _n(account.lines), "failed": _n(account.malformed) if account.malformed else "",
                     "funnel": "", "wall": "", "note": f"lines{f', {account.malformed} malformed left out' if account.malformed else ''}"})
        note = (f"{s.shards} shards" + (f", {s.duplicate_ids} dup ids" if s.duplicate_ids else "")
                + (", prefix order" if s.layout and s.layout.applied else ""))
        rows.append({"phase": "shard", "in": _n(s.records), "funnel": "", "wall": duration(s.wall_s), "note": note})
    for rnd in view.rounds:
        judged = rnd.judge is not None
        bars[len(rows)] = _bar(rnd.approval)
        rows.append({
            "phase": f"round {rnd.round}", "in": _n(rnd.records_in), "approved": _n(rnd.approved if judged else None),
            "rejected": _n(rnd.rejected if judged else None), "failed": _n(rnd.failed), "funnel": f"{rnd.approval:.0%}",
            "tokens in/out": f"{_k(rnd.tokens_in)}/{_k(rnd.tokens_out)}", "engine": duration(rnd.engine_busy_s),
            "wall": duration(rnd.wall_s), "out tok/s": _rate(rnd.output_tokens_per_s), "fill": _f(rnd.avg_fill),
            **_cache_cells(rnd.prefix_hit_rate, rnd.prefill_vs_ideal, rnd.duplicates), **_reused(rnd.phases),
            "next": rnd.decision.kind if rnd.decision else "review" if rnd.awaiting_review else "-",
        })
    if t := view.tail:
        approval = rate(t.approved, t.records_total)
        bars[len(rows)] = _bar(approval)
        rows.append({
            "phase": f"tail (from {t.round})", "in": _n(t.records_total), "approved": _n(t.approved),
            "rejected": f"{_n(t.max_attempts)}*", "failed": _n(t.records_failed),
            "funnel": f"{approval:.0%}", "tokens in/out": f"{_k(t.tokens_in)}/{_k(t.tokens_out)}",
            "engine": duration(t.engine_busy_s), "wall": duration(t.wall_s), "out tok/s": _rate(t.output_tokens_per_s),
            "fill": _f(t.avg_fill), **_cache_cells(t.prefix_hit_rate, t.prefill_vs_ideal, t.duplicates), **_reused([t]),
            "next": "",
        })
    return LedgerTable(title, rows, bars, (TAIL_MARK_LEGEND,) if view.tail else ())


# The tail row's "rejected" cell ends in "*": the tail retries a rejected record in place
# until it is approved or out of attempts, so what it leaves is not one judge's rejection.
TAIL_MARK_LEGEND = ("* tail: records still rejected when their attempts ran out (max_attempts); "
                    "the tail retries each rejected record in place until it is approved or out of attempts")


def _cache_cells(hit_rate: float | None, vs_ideal: float | None, duplicates: int) -> dict[str, str]:
    """The optional cells: empty where the engine keeps no prefix cache, or nothing repeated."""
    return {"cache": f"{hit_rate:.0%}" if hit_rate is not None else "",
            "vs ideal": f"{vs_ideal:.2f}x" if vs_ideal is not None else "",
            "dups": _n(duplicates) if duplicates else ""}


def input_lines(view: LedgerView) -> list[str]:
    """Where the input's lines went (``pipeline.accounting``): records, malformed lines left out
    (named by file:line, and where they are kept), duplicate ids kept."""
    if (s := view.shard) is None:
        return []
    account = InputAccount.of_shard(s, s.quarantine_url or None)
    return [f"input {account.summary()}", *(f"warning: {note}" for note in account.notes())]


def _reused(phases: list[PhaseSummary]) -> dict[str, str]:
    """The result cache's hit rate over the phases (empty where nothing was looked up)."""
    lookups = sum(p.result_cache_lookups for p in phases)
    return {"reused": f"{rate(sum(p.result_cache_hits for p in phases), lookups):.0%}" if lookups else ""}


def run_lines(view: LedgerView) -> list[str]:
    """The run's verdict in a few lines (the input's lines, status, terminal counts, conservation)."""
    return [*input_lines(view), *_verdict_lines(view)]


TOP_REASONS = 5  # failure kinds named after a run; the rest are summed


def failed_reason_lines(r: RunSummary) -> list[str]:
    """Why records failed, most first, from the counts the final check took on its pass over the
    terminal rows (``ConservationReport.failed_reasons``): "records_failed: 5,000 — prompt_too_long
    4,980, missing_field 20". None when nothing failed (or the ledger predates the counts)."""
    reasons = r.conservation.failed_reasons
    if not r.failed or not reasons:
        return []
    ranked = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    named = [f"{kind} {n:,}" for kind, n in ranked[:TOP_REASONS]]
    if rest := ranked[TOP_REASONS:]:
        named.append(f"{len(rest)} other kind(s) {sum(n for _, n in rest):,}")
    return [f"records_failed: {r.failed:,} — {', '.join(named)} (each failed row's error: `batch-inference export`)"]


def step_lines(view: LedgerView) -> list[str]:
    """The steps under way, as their tasks report them chunk by chunk, and what has settled."""
    lines = []
    for name, step in view.steps.items():
        counts = Counts(step.done) + step.running
        detail = ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()) if v)
        lines.append(f"{name} under way: {step.shards_done:,} shard(s) done, {step.shards_running:,} running; "
                     f"{step.records:,} record(s) through" + (f" ({detail})" if detail else ""))
    if view.steps:
        settled = view.settled()
        lines.append(f"settled so far: approved {settled['approved']:,}, failed {settled['failed']:,}")
    return lines


def _verdict_lines(view: LedgerView) -> list[str]:
    if not (r := view.run):
        waiting = [f"round {x.round}: {x.awaiting_review} record(s) sent to human review "
                   "(`batch-inference review SPEC` serves the page; the run goes on once they are decided)"
                   for x in view.rounds if x.awaiting_review]
        return [*waiting, *step_lines(view), "run not finalized yet (re-run `batch-inference run SPEC` to resume)"]
    c = r.conservation
    lines = [f"round {d.round} -> {d.kind}: {d.reason}" for d in (x.decision for x in view.rounds) if d]
    lines += [
        f"status: {r.status}  ({r.strategy}, {r.rounds} round(s){', tail' if r.tail else ''})",
        f"records {r.records:,}: approved {r.approved:,}, exhausted {r.exhausted:,}, "
        f"max_attempts {r.max_attempts:,}, failed {r.failed:,}" + (f" ({r.quarantined:,} in quarantined shards)" if r.quarantined else ""),
        *failed_reason_lines(r),
        f"conservation: {'OK' if c.ok else 'FAILED'} (missing {c.missing}, extra {c.extra}, "
        f"duplicated in results {c.duplicate_results}; {c.method})",
        f"results: {r.results_url}",
    ]
    if r.result_cache_lookups or r.result_cache:
        hit = r.result_cache_hit_rate
        store = r.result_cache
        line = (f"result cache: {r.result_cache_hits:,} of {r.result_cache_lookups:,} deterministic requests answered from the result cache"
                f" ({hit:.0%} hit rate); engines ran {r.engine_requests:,} request(s)" if hit is not None
                else f"result cache: nothing looked up; engines ran {r.engine_requests:,} request(s)")
        if "entries" in store:
            line += f"; store {store['entries']:,} entries, {_k(store['bytes'])}B" + (f", {store['evicted']:,} evicted" if store["evicted"] else "")
            if store.get("leaked_temporaries"):  # files of writers killed before their rename
                line += f", {store['leaked_temporaries']:,} leaked temporary file(s) removed"
        lines.append(line)
    return lines
