"""What `batch-inference run` prints while a round waits for people (docs/review.md, "Without Dagster")."""

from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from batch_inference import review as rv


@pytest.mark.process
def test_run_prints_waiting_for_review_then_finishes_once_people_decide(review_spec) -> None:
    spec, spec_path = review_spec(records=4, max_rounds=1, review={"poll_s": 0.1})
    proc = subprocess.Popen([sys.executable, "-m", "batch_inference.cli.main", "run", str(spec_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any("waiting for review" in line for line in out):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "".join(out)
            out.append(line)
        assert "round 0: waiting for review (4 left); review at http://127.0.0.1:8765" in out[-1], out[-1]

        async def approve_all() -> int:
            q = rv.ReviewQueue(spec)
            await q.refresh()
            n = 0
            while (claim := await q.claim("ann")) is not None:
                await q.decide("ann", 0, claim[0].key, "approve")
                n += 1
            return n

        assert asyncio.run(approve_all()) == 4
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    while (line := lines.get(timeout=10)) is not None:
        out.append(line)
    text = "".join(out)
    assert text.count("waiting for review") == 1, text  # one line, not one per poll
    assert "round 0 -> done" in text, text
