"""Anthropic's Message Batches with the official `anthropic` SDK, unchanged, against `batch-inference api serve`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic import Anthropic

from batch_inference_tests.api.helpers import KEY_A1, KEY_A2, KEY_B, PROJECTS, TOKEN, Server, serving, wait_for, write_config

pytestmark = [pytest.mark.process, pytest.mark.slow]  # a server in a child process, its pipeline runs inside

SLOW = {"kind": "simulated", "simulated": {"latency_a_s": 0.06, "latency_b_s": 0.0, "output_tokens": 4}}
ENDED_COUNTS = ("processing", "succeeded", "errored", "canceled", "expired")


def client(server: Server, key: str = TOKEN) -> Anthropic:
    return Anthropic(base_url=server.url, api_key=key, max_retries=0)


def request(cid: str, content: Any, model: str = "tiny", **params: Any) -> dict[str, Any]:
    return {"custom_id": cid, "params": {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": content}], **params}}


def wait_ended(c: Anthropic, batch_id: str, timeout_s: float = 120.0) -> Any:
    return wait_for(lambda: (b := c.messages.batches.retrieve(batch_id)).processing_status == "ended" and b, timeout_s=timeout_s,
                    what=f"message batch {batch_id} to end")


def results(c: Anthropic, batch: Any) -> dict[str, Any]:
    """The results of an ended batch by custom_id, each once, their types adding up to request_counts."""
    got = list(c.messages.batches.results(batch.id))
    by_id = {r.custom_id: r.result for r in got}
    assert len(by_id) == len(got), "a custom_id is in the results twice"
    counts = batch.request_counts
    assert counts.processing == 0
    for kind in ENDED_COUNTS[1:]:
        assert getattr(counts, kind) == sum(1 for r in by_id.values() if r.type == kind), (kind, counts)
    return by_id


def test_happy_path_on_the_tiny_model_with_per_request_errors(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    config = write_config(tmp_path, {"tiny": {"engine": engine, "shard_records": 8, "chunk_size": 4, "limits": {"max_tokens": 16}}})
    requests = [request(f"q{i}", f"question {i % 5}") for i in range(12)]
    requests += [
        request("blocks", [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}], system="be brief", temperature=0.0),
        request("unknown-model", "x", model="claude-opus-4"),
        request("image", [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]),
        {"custom_id": "empty", "params": {"model": "tiny", "max_tokens": 8, "messages": []}},
        request("too-long", "x", max_tokens=1000),
    ]
    with serving(config) as server:
        c = client(server)
        batch = c.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        assert batch.type == "message_batch" and batch.id.startswith("msgbatch_")
        assert batch.processing_status == "in_progress" and batch.results_url is None and batch.ended_at is None
        assert batch.expires_at > batch.created_at
        with pytest.raises(anthropic.AnthropicError, match="results_url"):
            c.messages.batches.results(batch.id)  # not ready: the SDK says so itself, from the batch object
        done = wait_ended(c, batch.id)
        assert done.ended_at is not None and done.ended_at >= done.created_at and done.cancel_initiated_at is None
        assert done.results_url == f"{server.url}/v1/messages/batches/{batch.id}/results"
        by_id = results(c, done)
        assert sorted(by_id) == sorted(r["custom_id"] for r in requests)
        assert done.request_counts.succeeded == 13 and done.request_counts.errored == 4
        for cid in [f"q{i}" for i in range(12)] + ["blocks"]:
            r = by_id[cid]
            assert r.type == "succeeded", (cid, r)
            m = r.message
            assert m.type == "message" and m.role == "assistant" and m.model == "tiny" and m.id.startswith("msg_")
            assert m.content[0].type == "text" and isinstance(m.content[0].text, str)
            assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.input_tokens > 0 and m.usage.output_tokens > 0
        for cid in ("unknown-model", "image", "empty", "too-long"):
            assert by_id[cid].type == "errored", (cid, by_id[cid])
        unknown = by_id["unknown-model"].error.error
        assert unknown.type == "not_found_error" and "claude-opus-4" in unknown.message and "configured: tiny" in unknown.message
        assert by_id["image"].error.error.type == "invalid_request_error" and "text content" in by_id["image"].error.error.message
        assert "bad_messages" in by_id["empty"].error.error.message
        assert "bad_sampling" in by_id["too-long"].error.error.message
        # an ended batch is deleted, then gone
        deleted = c.messages.batches.delete(batch.id)
        assert deleted.id == batch.id and deleted.type == "message_batch_deleted"
        with pytest.raises(anthropic.NotFoundError):
            c.messages.batches.retrieve(batch.id)
        assert batch.id not in {b.id for b in c.messages.batches.list()}


def test_wrong_key_bad_requests_and_ids_get_anthropics_error_shape(tmp_path: Path) -> None:
    with serving(write_config(tmp_path)) as server:
        with pytest.raises(anthropic.AuthenticationError) as info:
            client(server, key="wrong-key-0123456789abcdef").messages.batches.list()
        assert info.value.status_code == 401
        assert info.value.body == {"type": "error", "error": {"type": "authentication_error", "message": info.value.body["error"]["message"]}}
        assert "API key" in info.value.body["error"]["message"]
        for headers in ({}, {"x-api-key": TOKEN + "x"}, {"Authorization": f"Basic {TOKEN}"}):
            with pytest.raises(urllib.error.HTTPError) as http:
                urllib.request.urlopen(urllib.request.Request(f"{server.url}/v1/messages/batches", headers=headers), timeout=10)
            body = json.loads(http.value.read())
            assert http.value.code == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"
        c = client(server)
        for bad_id in ("msgbatch_..", "batch_abcdefgh", "..%2F..%2Fapi-tokens"):
            with pytest.raises(anthropic.NotFoundError) as missing:
                c.messages.batches.retrieve(bad_id)
            assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
            assert "Traceback" not in json.dumps(missing.value.body)
        with pytest.raises(anthropic.BadRequestError) as bad:
            c.messages.batches.create(requests=[request("a b/c", "x")])  # type: ignore[list-item]
        assert bad.value.body["error"]["type"] == "invalid_request_error" and "custom_id" in bad.value.body["error"]["message"]
        with pytest.raises(anthropic.BadRequestError, match="more than once"):
            c.messages.batches.create(requests=[request("a", "x"), request("a", "y")])  # type: ignore[list-item]
        with pytest.raises(anthropic.BadRequestError, match="requests"):
            c.messages.batches.create(requests=[])
        # an OpenAI batch is not a Message Batch: not found on these routes
        with pytest.raises(anthropic.NotFoundError):
            c.messages.batches.retrieve("batch_" + "a" * 24)


def test_list_pagination(tmp_path: Path) -> None:
    with serving(write_config(tmp_path)) as server:
        c = client(server)
        made = [c.messages.batches.create(requests=[request(f"r{i}", "x") for i in range(3)]).id for _ in range(5)]  # type: ignore[misc]
        for b in made:
            wait_ended(c, b)
        first = c.messages.batches.list(limit=2)
        assert len(first.data) == 2 and first.has_more and first.first_id == made[-1] and first.last_id == made[-2]
        seen = [b.id for b in c.messages.batches.list(limit=2)]  # iterating, the SDK follows after_id page by page
        assert seen == list(reversed(made))  # newest first, each once
        after = c.messages.batches.list(limit=2, after_id=seen[1])
        assert [b.id for b in after.data] == seen[2:4]
        before = c.messages.batches.list(limit=2, before_id=seen[3])
        assert [b.id for b in before.data] == seen[1:3] and before.has_more
        # iterating, the SDK pages on towards the newest by before_id (each page in list order)
        assert [b.id for b in c.messages.batches.list(limit=2, before_id=seen[3])] == seen[1:3] + seen[:1]
        for b in made:
            assert c.messages.batches.retrieve(b).request_counts.succeeded == 3


def test_cancel_mid_batch_delivers_the_finished_part(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"tiny": {"engine": SLOW, "pool": {"concurrency": 2}, "shard_records": 10, "chunk_size": 5}})
    with serving(config) as server:
        c = client(server)
        requests = [request(f"r{i}", f"question {i}") for i in range(300)]
        batch = c.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        moving = wait_for(lambda: (b := c.messages.batches.retrieve(batch.id)).request_counts.succeeded >= 20 and b, what="progress")
        assert moving.processing_status == "in_progress" and 0 < moving.request_counts.processing < 300
        with pytest.raises(anthropic.APIStatusError) as busy:
            c.messages.batches.delete(batch.id)  # still processing: cancel first
        assert busy.value.status_code == 409 and busy.value.body["type"] == "error"
        canceling = c.messages.batches.cancel(batch.id)
        assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
        done = wait_ended(c, batch.id)
        assert done.ended_at >= done.cancel_initiated_at
        by_id = results(c, done)
        assert sorted(by_id) == sorted(r["custom_id"] for r in requests)
        assert 20 <= done.request_counts.succeeded < 300 and done.request_counts.canceled == 300 - done.request_counts.succeeded
        assert done.request_counts.errored == 0 and done.request_counts.expired == 0
        assert c.messages.batches.cancel(batch.id).processing_status == "ended"  # cancelling an ended batch changes nothing
        assert c.messages.batches.delete(batch.id).type == "message_batch_deleted"


def test_anthropic_window_expires_the_unfinished_part(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"tiny": {"engine": SLOW, "pool": {"concurrency": 2}, "shard_records": 10, "chunk_size": 5}},
                          limits={"anthropic_window": "3s"})
    with serving(config) as server:
        c = client(server)
        requests = [request(f"r{i}", f"question {i}") for i in range(400)]
        batch = c.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        assert (batch.expires_at - batch.created_at).total_seconds() == 3
        done = wait_ended(c, batch.id)
        by_id = results(c, done)
        assert sorted(by_id) == sorted(r["custom_id"] for r in requests)
        assert done.request_counts.expired > 0 and done.request_counts.canceled == 0
        assert done.request_counts.succeeded + done.request_counts.expired == 400


def test_a_model_with_a_judge_says_in_each_result_which_attempt_was_approved(tmp_path: Path) -> None:
    engine = {"kind": "simulated", "simulated": {"approval_rate": 0.5, "latency_a_s": 0.002, "latency_b_s": 0.0, "output_tokens": 4}}
    model = {"engine": engine, "judge": {"kind": "llm", "template": "Judge this answer: {result}"}, "strategy": "in_place",
             "max_attempts": 4, "pool": {"concurrency": 2}, "shard_records": 10, "chunk_size": 5}
    with serving(write_config(tmp_path, {"tiny": model})) as server:
        c = client(server)
        batch = c.messages.batches.create(requests=[request(f"r{i}", f"question {i}") for i in range(40)])  # type: ignore[misc]
        by_id = results(c, wait_ended(c, batch.id))
        succeeded = [r for r in c.messages.batches.results(batch.id) if r.result.type == "succeeded"]
        assert len(succeeded) == len([r for r in by_id.values() if r.type == "succeeded"]) > 20
        attempts = [r.judge["attempt"] for r in succeeded]  # type: ignore[attr-defined]  # beyond Anthropic's fields: kept by the SDK
        assert min(attempts) == 1 and max(attempts) > 1 and all(r.judge["verdict"]["approved"] for r in succeeded)  # type: ignore[attr-defined]
        assert {r.error.error.message.split(":")[0] for r in by_id.values() if r.type == "errored"} <= {"max_attempts"}


def test_a_key_sees_only_its_projects_message_batches(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"tiny": {"engine": SLOW, "pool": {"concurrency": 2}, "shard_records": 10, "chunk_size": 5}},
                          tokens=PROJECTS)
    with serving(config) as server:
        a1, a2, b = client(server, KEY_A1), client(server, KEY_A2), client(server, KEY_B)
        done = wait_ended(a1, a1.messages.batches.create(requests=[request("one", "x")]).id)  # type: ignore[list-item]
        running = a1.messages.batches.create(requests=[request(f"r{i}", f"question {i}") for i in range(3000)])  # type: ignore[misc]
        mine = b.messages.batches.create(requests=[request("b", "x")])  # type: ignore[list-item]
        for batch_id in (done.id, running.id):  # 404 as an id that does not exist, in Anthropic's shape
            for call in (b.messages.batches.retrieve, b.messages.batches.cancel, b.messages.batches.delete):
                with pytest.raises(anthropic.NotFoundError) as info:
                    call(batch_id)
                assert info.value.body == {"type": "error", "error": {"type": "not_found_error", "message": f"No such batch: {batch_id}"}}
            http = urllib.request.Request(f"{server.url}/v1/messages/batches/{batch_id}/results", headers={"x-api-key": KEY_B})
            with pytest.raises(urllib.error.HTTPError) as missing:
                urllib.request.urlopen(http, timeout=10)
            assert missing.value.code == 404
            assert not b.messages.batches.list(after_id=batch_id).data and not b.messages.batches.list(before_id=batch_id).data
        assert [x.id for x in b.messages.batches.list()] == [mine.id]
        # the other key of the same project shares them
        assert [x.id for x in a2.messages.batches.list()] == [running.id, done.id]
        assert [r.custom_id for r in a2.messages.batches.results(done.id)] == ["one"]
        assert a2.messages.batches.cancel(running.id).processing_status in ("canceling", "ended")
        wait_ended(a1, running.id)
