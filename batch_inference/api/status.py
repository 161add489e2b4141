"""What ``batch-inference status`` says of a run that is an API batch's (``<storage>/runs/<batch id>``).

A batch the server stopped (cancel, an elapsed completion window) never finalizes its pipeline
run: the run's own verdict would read "not finalized, re-run it", which is wrong advice for a
batch that ended on purpose and has delivered its files. The batch's state says what happened.
"""

from __future__ import annotations

from typing import Any

from batch_inference.api.store import Store, check_id


def batch_of_run(runs_dir: str, run: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The state of the API batch whose pipeline run is ``<runs_dir>/<run>``; None when it is no API batch's (blocking)."""
    root, _, leaf = runs_dir.rstrip("/").rpartition("/")
    if leaf != "runs" or not (check_id(run, "batch") or check_id(run, "msgbatch")):
        return None
    store = Store(root or ".", storage_options)
    try:
        state = store.read_json(store.url("batches", run, "state.json"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("id") == run else None


def batch_lines(state: dict[str, Any]) -> list[str]:
    """The batch's end (or its being under way) in a few lines, in place of the run's "re-run it" advice."""
    status, counts = state["status"], state.get("request_counts") or {}
    total, completed, failed = int(counts.get("total") or 0), int(counts.get("completed") or 0), int(counts.get("failed") or 0)
    stopped = int(state.get("stopped") or 0)
    name = f"API batch {state['id']}"
    files = f"output file {state.get('output_file_id') or '(none)'}, error file {state.get('error_file_id') or '(none)'}"
    if status in ("cancelled", "expired"):
        why = "cancelled" if status == "cancelled" else f"expired (its completion_window {state.get('completion_window')} passed)"
        return [f"{name} was {why}: {completed:,} of {total:,} requests completed, {failed - stopped:,} failed, "
                f"{stopped:,} not run (error lines batch_{'cancelled' if status == 'cancelled' else 'expired'})",
                f"its run stopped on purpose and is not resumed: what finished is delivered ({files})"]
    if status == "failed":
        errors = [e.get("message") for e in ((state.get("errors") or {}).get("data") or [])][:3]
        return [f"{name} failed: " + ("; ".join(str(e) for e in errors) or "see the server's log")]
    if status == "completed":
        return [f"{name} completed: {completed:,} of {total:,} requests completed, {failed:,} failed ({files})"]
    return [f"{name} is {status} ({completed:,} of {total:,} requests completed so far): the Batch API server drives it "
            "and resumes it at its next start; cancel it through the API, not with `batch-inference run`"]
