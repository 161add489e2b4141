"""Talking to a ``dagster dev`` a test or a check started: where it is, its signals, GraphQL."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DAGSTER = ROOT / ".venv" / "bin" / "dagster"


def default_signals() -> None:
    """For ``preexec_fn``: SIGINT and SIGTERM at their defaults in the child (from a
    non-interactive shell they arrive ignored, and ``dagster dev`` then ignores SIGTERM)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def graphql(port: int, query: str, variables: dict[str, Any] | None = None, timeout: float = 30) -> dict[str, Any]:
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        data = json.loads(resp.read())
    assert "errors" not in data, data["errors"]
    return data["data"]


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen) -> Any:
    """``predicate()``'s first truthy value, polled each second while ``proc`` runs (connection errors count as not yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"dagster dev exited early ({proc.returncode})"
        try:
            value = predicate()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            value = None
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


LAUNCH = """
mutation($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on RunConfigValidationInvalid { errors { message } }
  }
}"""
RUNS = """
query($filter: RunsFilter) {
  runsOrError(filter: $filter) { ... on Runs { results { runId jobName status tags { key value } } } }
}"""


def write_entry_points(site: Path) -> Path:
    """This repository's ``[project.entry-points]`` as an install records them, in ``site``.

    The shared venv's editable install may predate an entry point (they are registered at
    install time); a test puts ``site`` first on PYTHONPATH so ``importlib.metadata`` (and so
    ``dg``) reads the declaration pyproject.toml makes now.
    """
    import tomllib

    info = site / "batch_inference-0.1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: batch_inference\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) for group, entries in points.items()))
    return site
