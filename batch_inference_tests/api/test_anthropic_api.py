"""Anthropic's Message Batches with the official `anthropic` SDK, unchanged, against `batch-inference api serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic import Anthropic

from batch_inference_tests.api.helpers import TOKEN, serving, wait_for, write_config

pytestmark = [pytest.mark.process, pytest.mark.slow]  # a server in a child process, its pipeline runs inside

SLOW = {"kind": "simulated", "simulated": {"latency_a_s": 0.06, "latency_b_s": 0.0, "output_tokens": 4}}


def request(cid: str, text: str, **params: Any) -> dict[str, Any]:
    return {"custom_id": cid, "params": {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": text}], **params}}


def ended(c: Anthropic, batch_id: str) -> Any:
    return wait_for(lambda: (b := c.messages.batches.retrieve(batch_id)).processing_status == "ended" and b,
                    timeout_s=120, what=f"batch {batch_id} to end")


def test_message_batches_end_to_end(tmp_path: Path) -> None:
    models = {"tiny": {"engine": SLOW, "pool": {"concurrency": 2}, "shard_records": 10, "chunk_size": 5}}
    with serving(write_config(tmp_path, models)) as server:
        with pytest.raises(anthropic.AuthenticationError) as info:
            Anthropic(base_url=server.url, api_key="wrong-key-0123456789abcdef", max_retries=0).messages.batches.list()
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"
        c = Anthropic(base_url=server.url, api_key=TOKEN, max_retries=0)
        requests = [request(f"q{i}", f"question {i}") for i in range(12)]
        requests += [
            request("blocks", "", system=[{"type": "text", "text": "be brief"}],
                    messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}], temperature=0.5),
            request("empty", "", messages=[]),
            request("other-model", "x", model="claude-9"),
            request("tools", "x", tools=[{"name": "f"}]),
        ]
        batch = c.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        assert batch.id.startswith("msgbatch_") and batch.type == "message_batch" and batch.processing_status == "in_progress"
        assert batch.results_url is None
        done = ended(c, batch.id)
        counts = done.request_counts
        assert (counts.succeeded, counts.errored, counts.canceled, counts.expired, counts.processing) == (13, 3, 0, 0, 0)
        assert done.ended_at is not None and done.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
        results = {r.custom_id: r.result for r in c.messages.batches.results(batch.id)}
        assert set(results) == {r["custom_id"] for r in requests}
        for cid in [f"q{i}" for i in range(12)] + ["blocks"]:
            message = results[cid].message  # type: ignore[union-attr]
            assert results[cid].type == "succeeded" and message.role == "assistant" and message.content[0].type == "text"
            assert message.model == "tiny" and message.stop_reason in ("end_turn", "max_tokens")
        for cid in ("empty", "other-model", "tools"):
            assert results[cid].type == "errored"
        assert "configured: tiny" in results["other-model"].error.error.message  # type: ignore[union-attr]
        assert "tools" in results["tools"].error.error.message  # type: ignore[union-attr]

        # cancel mid-batch: what finished succeeded, the rest canceled, counts that add up
        big = c.messages.batches.create(requests=[request(f"b{i}", f"question {i}") for i in range(300)])  # type: ignore[arg-type]
        wait_for(lambda: c.messages.batches.retrieve(big.id).request_counts.succeeded >= 10 or _started(tmp_path, big.id),
                 what="the large batch to start")
        with pytest.raises(anthropic.APIStatusError):
            c.messages.batches.delete(big.id)  # still processing: cancel it first
        canceling = c.messages.batches.cancel(big.id)
        assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
        stopped = ended(c, big.id)
        counts = stopped.request_counts
        assert counts.canceled > 0 and counts.succeeded + counts.canceled + counts.errored == 300 and counts.expired == 0
        kinds = [r.result.type for r in c.messages.batches.results(big.id)]
        assert len(kinds) == 300 and kinds.count("succeeded") == counts.succeeded and kinds.count("canceled") == counts.canceled

        # list with pagination, newest first; delete
        page = c.messages.batches.list(limit=1)
        assert [b.id for b in page.data] == [big.id] and page.has_more
        assert [b.id for b in c.messages.batches.list(limit=1)] == [big.id, batch.id]  # the SDK pages through after_id
        deleted = c.messages.batches.delete(batch.id)
        assert deleted.id == batch.id and deleted.type == "message_batch_deleted"
        with pytest.raises(anthropic.NotFoundError) as missing:
            c.messages.batches.retrieve(batch.id)
        assert missing.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError):
            c.messages.batches.create(requests=[request("dup", "x"), request("dup", "y")])  # type: ignore[arg-type]


def _started(tmp_path: Path, batch_id: str) -> bool:
    progress = tmp_path / "api-data" / "runs" / batch_id / "ledger" / "progress"
    return progress.exists() and len(list(progress.rglob("*.json"))) >= 1
