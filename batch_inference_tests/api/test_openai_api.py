"""The OpenAI Batch API with the official `openai` SDK, unchanged, against `batch-inference api serve`."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from batch_inference_tests.api.helpers import (KEY_A1, KEY_A2, KEY_B, PROJECTS, SIMULATED, SLOW, TOKEN, Server, chat_line, client, delivered,
                                               jsonl, lines_of, serving, slow_model, start, submit, wait_for, wait_status, write_config)

pytestmark = [pytest.mark.process, pytest.mark.slow]  # a server in a child process, its pipeline runs inside
FAULT_ENV = "BATCH_INFERENCE_API_FAULT"  # the server SIGKILLs itself at the moment it names

def checkpoint_segments(server: Server, batch_id: str) -> int:
    """The in-place retry tasks' committed chunks so far (one checkpoint segment each)."""
    folder = server.config.parent / "api-data" / "runs" / batch_id / "tail" / "checkpoints"
    return sum(1 for _ in folder.rglob("seg-*")) if folder.exists() else 0


def progress_files(server: Server, batch_id: str) -> dict[str, bytes]:
    folder = server.config.parent / "api-data" / "runs" / batch_id / "ledger" / "progress"
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*.json")} if folder.exists() else {}


def test_happy_path_on_the_tiny_model_with_per_line_errors(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine = {"kind": "transformers", "model": str(tiny_model_dir), "device": "cpu"}
    config = write_config(tmp_path, {"tiny": {"engine": engine, "shard_records": 8, "chunk_size": 4, "limits": {"max_tokens": 16}}})
    lines = [chat_line(f"q{i}", f"question {i % 5}") for i in range(20)]
    lines += [
        {**chat_line("empty", "x"), "body": {"model": "tiny", "messages": []}},
        chat_line("unknown-model", "x", model="gpt-4o"),
        chat_line("too-long", "x", max_tokens=1000),
    ]
    with serving(config) as server:
        c = client(server)
        assert [m.id for m in c.models.list()] == ["tiny"]
        batch = submit(c, lines, metadata={"team": "search"})
        assert batch.status == "validating" and batch.metadata == {"team": "search"} and batch.object == "batch"
        done = wait_status(c, batch.id, ("completed", "failed"))
        assert done.status == "completed", done
        assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
        assert done.model == "tiny" and done.errors is None and done.failed_at is None
        out, err = delivered(c, done)
        assert sorted(x["custom_id"] for x in out + err) == sorted(x["custom_id"] for x in lines)
        assert {x["custom_id"] for x in out} == {f"q{i}" for i in range(20)}
        for line in out:
            body = line["response"]["body"]
            assert line["response"]["status_code"] == 200 and body["object"] == "chat.completion" and body["model"] == "tiny"
            usage = body["usage"]  # the row's, also on the in-place path every batch without a judge runs
            assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0, line
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            assert isinstance(body["choices"][0]["message"]["content"], str)
            assert "judge" not in line  # no judge configured: OpenAI's fields only
        errors = {x["custom_id"]: x["error"] for x in err}
        assert errors["empty"]["code"] == "bad_messages"
        assert errors["unknown-model"]["code"] == "model_not_found" and "configured: tiny" in errors["unknown-model"]["message"]
        assert errors["too-long"]["code"] == "bad_sampling"
        assert done.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out) > 0
        assert done.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out) > 0
        assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
        # the output files are files of the Files API
        listed = {f.id: f for f in c.files.list()}
        assert listed[done.output_file_id].purpose == "batch_output" and listed[done.input_file_id].purpose == "batch"


def test_keys_ids_errors_and_file_delete(tmp_path: Path) -> None:
    config = write_config(tmp_path, limits={"max_file_bytes": 4096})
    with serving(config) as server:
        with pytest.raises(openai.AuthenticationError) as info:
            client(server, key="wrong-key-0123456789abcdef").models.list()
        assert info.value.status_code == 401 and info.value.body["message"].startswith("invalid or missing API key")
        for bad in (None, "Bearer", f"Bearer {TOKEN}x", f"Basic {TOKEN}"):
            request = urllib.request.Request(f"{server.v1}/batches", headers={"Authorization": bad} if bad else {})
            with pytest.raises(urllib.error.HTTPError) as http:
                urllib.request.urlopen(request, timeout=10)
            assert http.value.code == 401 and set(json.loads(http.value.read())["error"]) == {"message", "type", "param", "code"}
        c = client(server)
        # an id never names a path: traversal and odd ids are simply not found, in OpenAI's error shape
        for bad_id in ("..%2F..%2Fapi-tokens", "file_..", "batch_abcdefgh", "file-%2Fetc%2Fpasswd"):
            request = urllib.request.Request(f"{server.v1}/files/{bad_id}/content", headers={"Authorization": f"Bearer {TOKEN}"})
            with pytest.raises(urllib.error.HTTPError) as http:
                urllib.request.urlopen(request, timeout=10)
            body = json.loads(http.value.read())
            assert http.value.code == 404 and "Traceback" not in json.dumps(body) and body["error"]["type"] == "invalid_request_error"
        with pytest.raises(openai.NotFoundError):
            c.batches.retrieve("batch_../../state")
        # bounded uploads; bad batch parameters name the parameter
        with pytest.raises(openai.APIStatusError) as too_big:
            c.files.create(file=("big.jsonl", b"x" * 10_000), purpose="batch")
        assert too_big.value.status_code == 413
        f = c.files.create(file=("b.jsonl", jsonl([chat_line("a", "x")])), purpose="batch")
        with pytest.raises(openai.BadRequestError) as info:
            c.batches.create(input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h")  # type: ignore[arg-type]
        assert "endpoint" in info.value.message
        with pytest.raises(openai.BadRequestError) as info:
            c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")  # type: ignore[arg-type]
        assert info.value.body["param"] == "completion_window"
        # a file that is not the Batch format fails the batch, its lines named
        g = c.files.create(file=("bad.jsonl", b'{"custom_id": "a"\nnot json\n'), purpose="batch")
        failed = wait_status(c, c.batches.create(input_file_id=g.id, endpoint="/v1/chat/completions", completion_window="24h").id,
                             ("failed", "completed"))
        assert failed.status == "failed" and failed.failed_at and {e.line for e in failed.errors.data} == {1, 2}
        # delete: gone from retrieve, content and list
        assert c.files.retrieve(f.id).bytes > 0
        deleted = c.files.delete(f.id)
        assert deleted.deleted and deleted.id == f.id
        with pytest.raises(openai.NotFoundError):
            c.files.retrieve(f.id)
        with pytest.raises(openai.NotFoundError):
            c.files.content(f.id)
        assert f.id not in {x.id for x in c.files.list()}


def test_list_pagination(tmp_path: Path) -> None:
    with serving(write_config(tmp_path)) as server:
        c = client(server)
        made = [submit(c, [chat_line(f"{n}-{i}", "x") for i in range(3)]).id for n in range(5)]
        for b in made:
            wait_status(c, b, ("completed",))
        first = c.batches.list(limit=2)
        assert len(first.data) == 2 and first.has_more
        seen = [b.id for b in c.batches.list(limit=2)]  # iterating, the SDK follows `after` page by page
        assert seen == list(reversed(made))  # newest first, each once
        after = c.batches.list(limit=2, after=seen[1])
        assert [b.id for b in after.data] == seen[2:4]


def test_counts_move_then_cancel_delivers_the_finished_part(tmp_path: Path) -> None:
    with serving(write_config(tmp_path, slow_model())) as server:
        c = client(server)
        lines = [chat_line(f"r{i}", f"question {i}") for i in range(300)]
        batch = submit(c, lines)
        moving = wait_for(lambda: (b := c.batches.retrieve(batch.id)).request_counts.completed >= 20 and b, what="progress")
        assert moving.status == "in_progress" and moving.request_counts.total == 300 and moving.request_counts.completed < 300
        cancelled = c.batches.cancel(batch.id)
        assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
        done = wait_status(c, batch.id, ("cancelled",))
        assert done.cancelled_at >= done.cancelling_at
        out, err = delivered(c, done)
        assert sorted(x["custom_id"] for x in out + err) == sorted(x["custom_id"] for x in lines)
        assert 20 <= len(out) < 300
        assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
        # nothing new is dispatched after the cancel
        before = progress_files(server, batch.id)
        time.sleep(1.0)
        assert progress_files(server, batch.id) == before
        with pytest.raises(openai.ConflictError):
            c.batches.cancel(submit_and_finish(c).id)
        # `batch-inference status` of its run says how the batch ended, not "re-run it to resume"
        from click.testing import CliRunner

        from batch_inference.cli.pipeline_cmds import status

        shown = CliRunner().invoke(status, [str(server.config.parent / "api-data" / "runs" / batch.id)], terminal_width=200)
        assert shown.exit_code == 0, shown.output
        said = " ".join(shown.output.split())  # the console may wrap the line
        assert f"API batch {batch.id} was cancelled: {len(out)} of 300 requests completed, 0 failed, {len(err)} not run" in said, said
        assert "re-run" not in said and "not finalized" not in said


def test_counts_move_within_a_shard_and_a_cancel_stops_the_compute_and_keeps_what_finished(tmp_path: Path) -> None:
    """Shards of 300 requests that take seconds each (a batch of two chunks of 5 a 0.1 s call):
    request_counts move chunk by chunk before any shard ends (before, they moved only when a
    shard ended: 0, then 600 at once); a cancel mid-shard delivers every request its tasks had
    committed (before: none, every line ``batch_cancelled``) and stops their engine work, so
    the next batch runs at idle speed (before, it waited for the cancelled shards to end)."""
    slow = {"kind": "simulated", "simulated": {"latency_a_s": 0.1, "latency_b_s": 0.0, "output_tokens": 4}}
    model = {"tiny": {"engine": slow, "pool": {"concurrency": 2}, "shard_records": 300, "chunk_size": 5}}
    with serving(write_config(tmp_path, model)) as server:
        c = client(server)

        def timed(n: int, prefix: str) -> float:
            t0 = time.monotonic()
            b = submit(c, [chat_line(f"{prefix}{i}", f"question {i}") for i in range(n)])
            assert wait_status(c, b.id, ("completed",)).request_counts.completed == n
            return time.monotonic() - t0

        idle = timed(10, "idle")
        lines = [chat_line(f"r{i}", f"question {i}") for i in range(600)]
        batch = submit(c, lines)
        moving = wait_for(lambda: 0 < (b := c.batches.retrieve(batch.id)).request_counts.completed < 300 and b,
                          every_s=0.05, timeout_s=30, what="counts to move before a shard ends")
        assert moving.status == "in_progress" and moving.request_counts.failed == 0
        later = wait_for(lambda: (b := c.batches.retrieve(batch.id)).request_counts.completed > moving.request_counts.completed and b,
                         every_s=0.05, timeout_s=30, what="counts to move on")
        assert later.request_counts.completed < 300 and not progress_files(server, batch.id)  # no shard has ended yet
        c.batches.cancel(batch.id)
        done = wait_status(c, batch.id, ("cancelled",), timeout_s=30)
        out, err = delivered(c, done)
        assert later.request_counts.completed <= len(out) < 600  # every request counted before the cancel is delivered
        assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
        assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["choices"][0]["message"]["content"] for x in out)
        written = checkpoint_segments(server, batch.id)
        time.sleep(1.0)  # ten engine calls' time: a task still running would checkpoint a chunk or more
        assert checkpoint_segments(server, batch.id) == written
        after = timed(10, "after")
        assert after < idle + 2.0, f"the batch after the cancel took {after:.1f}s against {idle:.1f}s on an idle server"


def submit_and_finish(c: OpenAI) -> Any:
    b = submit(c, [chat_line("one", "x")])
    return wait_status(c, b.id, ("completed",))


def test_sigkill_mid_batch_then_restart_finishes_each_request_once(tmp_path: Path) -> None:
    config = write_config(tmp_path, slow_model())
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(200)]
    server = start(config)
    try:
        c = client(server)
        batch = submit(c, lines)
        wait_for(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 30, what="progress")
        committed = progress_files(server, batch.id)
        server.stop(signal.SIGKILL)
    finally:
        server.stop(signal.SIGKILL)
    assert committed and server.proc.returncode == -signal.SIGKILL
    with serving(config) as again:
        c = client(again)
        done = wait_status(c, batch.id, ("completed",))
        out, err = delivered(c, done)
        assert not err and sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
        after = progress_files(again, batch.id)
        assert {k: after[k] for k in committed} == committed  # what was committed was not run again
        assert len(after) > len(committed)


def test_completion_window_expires_and_output_expires_after(tmp_path: Path) -> None:
    config = write_config(tmp_path, slow_model(), limits={"completion_windows": ["24h", "3s"], "min_output_expiry_s": 0})
    with serving(config) as server:
        c = client(server)
        lines = [chat_line(f"r{i}", f"question {i}") for i in range(400)]
        batch = submit(c, lines, window="3s")
        assert batch.expires_at == batch.created_at + 3
        done = wait_status(c, batch.id, ("expired", "completed"))
        assert done.status == "expired" and done.expired_at >= done.expires_at
        out, err = delivered(c, done)
        assert sorted(x["custom_id"] for x in out + err) == sorted(x["custom_id"] for x in lines)
        assert len(out) < 400 and {x["error"]["code"] for x in err} == {"batch_expired"}
        # output_expires_after: the output files are deleted when due
        quick = submit(c, [chat_line("a", "x")], output_expires_after={"anchor": "created_at", "seconds": 6})
        finished = wait_status(c, quick.id, ("completed",))
        assert c.files.retrieve(finished.output_file_id).expires_at == quick.created_at + 6
        wait_for(lambda: _gone(c, finished.output_file_id), timeout_s=30, what="the output file to expire")


def _gone(c: OpenAI, file_id: str) -> bool:
    try:
        c.files.retrieve(file_id)
    except openai.NotFoundError:
        return True
    return False


def test_a_small_batch_is_not_starved_by_a_large_one(tmp_path: Path) -> None:
    with serving(write_config(tmp_path, slow_model())) as server:
        c = client(server)
        large = submit(c, [chat_line(f"L{i}", f"question {i}") for i in range(300)])
        wait_for(lambda: c.batches.retrieve(large.id).request_counts.completed >= 10, what="the large batch to start")
        small = submit(c, [chat_line(f"S{i}", f"question {i}") for i in range(20)])
        small_done = wait_status(c, small.id, ("completed",))
        large_now = c.batches.retrieve(large.id)
        assert large_now.status == "in_progress", "the small batch waited for the large one to finish"
        assert small_done.request_counts.completed == 20
        wait_status(c, large.id, ("completed",), timeout_s=180)


@pytest.mark.parametrize("strategy", ["rounds", "in_place", "hybrid"])
def test_a_model_with_a_judge_retries_and_each_line_says_which_attempt_was_approved(tmp_path: Path, strategy: str) -> None:
    engine = {"kind": "simulated", "simulated": {"approval_rate": 0.5, "latency_a_s": 0.002, "latency_b_s": 0.0, "output_tokens": 4}}
    model = {"engine": engine, "judge": {"kind": "llm", "template": "Judge this answer: {result}"}, "strategy": strategy,
             "max_rounds": 4, "max_attempts": 4, "pool": {"concurrency": 2}, "shard_records": 10, "chunk_size": 5}
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(60)]
    with serving(write_config(tmp_path, {"tiny": model})) as server:
        c = client(server)
        done = wait_status(c, submit(c, lines).id, ("completed", "failed"))
        assert done.status == "completed", done
        out, err = delivered(c, done)
        assert sorted(x["custom_id"] for x in out + err) == sorted(x["custom_id"] for x in lines)
        attempts = [x["judge"]["attempt"] for x in out]
        assert len(out) > 40 and min(attempts) == 1 and max(attempts) > 1, attempts  # rejected answers were retried
        for x in out:
            judge = x["judge"]
            assert 1 <= judge["attempt"] <= 4 and judge["verdict"]["approved"] is True
            if strategy == "rounds":
                assert judge["round"] == judge["attempt"] - 1  # one attempt a round
            elif strategy == "in_place":
                assert judge["round"] is None  # approved by the in-place retry path
            usage = x["response"]["body"]["usage"]  # the approved attempt's, whichever path approved it
            assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        if strategy == "hybrid":
            assert {x["judge"]["round"] is None for x in out} == {True, False}, "hybrid ran no rounds, or no tail"
        assert done.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out) > 0
        assert done.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out) > 0
        assert {x["error"]["code"] for x in err} <= {"exhausted", "max_attempts"}


def test_a_resubmitted_batch_is_answered_from_the_result_cache(tmp_path: Path) -> None:
    """The API's batches are pipeline runs under one output root: a second batch of the same
    deterministic requests (temperature 0, or a seed) computes none of them (docs/cache.md);
    a sampled request without a seed is computed again."""
    with serving(write_config(tmp_path)) as server:
        c = client(server)
        lines = [chat_line(f"q{i}", f"question {i}", temperature=0) for i in range(10)]
        lines += [chat_line(f"s{i}", f"sampled {i}", temperature=0.9, seed=5) for i in range(4)]
        lines += [chat_line(f"u{i}", f"unseeded {i}", temperature=0.9) for i in range(3)]
        first = wait_status(c, submit(c, lines).id, ("completed",))
        second = wait_status(c, submit(c, lines).id, ("completed",))
        out1, _ = delivered(c, first)
        out2, _ = delivered(c, second)
        by_id = {x["custom_id"]: x["response"]["body"] for x in out1}
        for line in out2:  # the same answers and usage, seeded and greedy alike
            if not line["custom_id"].startswith("u"):
                body = line["response"]["body"]
                assert body["choices"] == by_id[line["custom_id"]]["choices"] and body["usage"] == by_id[line["custom_id"]]["usage"]
        runs = server.config.parent / "api-data" / "runs"
        summaries = {b.id: json.loads(next((runs / b.id).rglob("run.json")).read_text()) for b in (first, second)}
        assert (summaries[first.id]["result_cache_hits"], summaries[first.id]["engine_requests"]) == (0, 17)
        assert (summaries[second.id]["result_cache_hits"], summaries[second.id]["result_cache_lookups"]) == (14, 14)
        assert summaries[second.id]["engine_requests"] == 3  # the unseeded samples only


def _hidden(c: OpenAI, batch_ids: list[str], file_ids: list[str]) -> None:
    """Another project's batches and files: 404 exactly as ids that do not exist, and in no list."""
    for batch_id in batch_ids:
        for call in (c.batches.retrieve, c.batches.cancel):
            with pytest.raises(openai.NotFoundError) as info:
                call(batch_id)
            assert info.value.body["message"] == f"No such batch: {batch_id}"
        assert not c.batches.list(after=batch_id).data  # nor a page after one of them
    for file_id in file_ids:
        for call in (c.files.retrieve, c.files.content, c.files.delete):
            with pytest.raises(openai.NotFoundError) as info:
                call(file_id)
            assert info.value.body["message"] == f"No such File object: {file_id}"
        with pytest.raises(openai.NotFoundError):
            c.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert not {b.id for b in c.batches.list()} & set(batch_ids)
    assert not {f.id for f in c.files.list()} & set(file_ids)


def test_a_key_sees_only_its_projects_files_and_batches_across_a_sigkill(tmp_path: Path) -> None:
    config = write_config(tmp_path, slow_model(), tokens=PROJECTS)
    server = start(config)
    try:
        a1, a2, b = client(server, KEY_A1), client(server, KEY_A2), client(server, KEY_B)
        done = wait_status(a1, submit(a1, [chat_line("one", "x"), chat_line("bad", "x", model="gpt-4o")]).id, ("completed",))
        running = submit(a1, [chat_line(f"r{i}", f"question {i}") for i in range(3000)])
        a_batches = [done.id, running.id]
        a_files = [done.input_file_id, done.output_file_id, done.error_file_id, running.input_file_id]
        mine = b.files.create(file=("b.jsonl", jsonl([chat_line("b", "x")])), purpose="batch")
        _hidden(b, a_batches, a_files)
        _hidden(client(server, TOKEN), a_batches, a_files)  # the default project (keys listed before any [project]) too
        assert [f.id for f in b.files.list()] == [mine.id] and not b.batches.list().data
        # two keys of one project share its batches and files
        assert a2.batches.retrieve(running.id).status in ("validating", "in_progress")
        assert {x.id for x in a2.batches.list()} == set(a_batches)
        assert {f.id for f in a2.files.list()} == set(a_files)
        assert [x["custom_id"] for x in lines_of(a2, done.output_file_id)] == ["one"]
        assert mine.id not in {f.id for f in a2.files.list()}
        server.stop(signal.SIGKILL)
    finally:
        server.stop(signal.SIGKILL)
    with serving(config) as again:  # the owners are in storage: a restart keeps them
        a1, b = client(again, KEY_A1), client(again, KEY_B)
        _hidden(b, a_batches, a_files)
        assert [f.id for f in b.files.list()] == [mine.id]
        assert a1.batches.cancel(running.id).status in ("cancelling", "cancelled")
        stopped = wait_status(a1, running.id, ("cancelled",))
        _hidden(b, [], [f for f in (stopped.output_file_id, stopped.error_file_id) if f])
        assert {x.id for x in a1.batches.list()} == set(a_batches)


def test_state_from_before_projects_is_the_default_projects_and_old_file_ids_stay_readable(tmp_path: Path) -> None:
    config = write_config(tmp_path, tokens=PROJECTS)
    with serving(config) as server:
        c = client(server)
        done = wait_status(c, submit(c, [chat_line("one", "x"), chat_line("bad", "x", model="gpt-4o")]).id, ("completed",))
        suffix = done.id.split("_", 1)[1]
        for file_id in (done.input_file_id, done.output_file_id, done.error_file_id):  # opaque, as OpenAI's: file- and random
            assert re.fullmatch(r"file-[A-Za-z0-9]{24}", file_id) and suffix not in file_id and "output" not in file_id
        expected = lines_of(c, done.output_file_id)
    # storage as the release before projects left it: no owner anywhere, output ids file_<batch>output
    data = tmp_path / "api-data"
    old_id = f"file_{suffix}output"
    shutil.move(data / "files" / done.output_file_id, data / "files" / old_id)
    for meta_path in (data / "files").glob("*/meta.json"):
        meta = json.loads(meta_path.read_text())
        meta.pop("project")
        meta["id"] = meta_path.parent.name
        meta_path.write_text(json.dumps(meta))
    state_path = data / "batches" / done.id / "state.json"
    state = json.loads(state_path.read_text())
    state.pop("project")
    state["output_file_id"] = old_id
    state_path.write_text(json.dumps(state))
    with serving(config) as server:
        c = client(server)
        assert c.batches.retrieve(done.id).output_file_id == old_id
        assert lines_of(c, old_id) == expected and old_id in {f.id for f in c.files.list()}
        _hidden(client(server, KEY_A1), [done.id], [done.input_file_id, old_id, done.error_file_id])


def _raw(server: Server, request: bytes) -> tuple[int, dict[str, Any]]:
    """Send ``request`` as bytes (what no SDK sends) and read the status and JSON body of the answer."""
    host, port = server.url.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as so:
        so.sendall(request)
        answer = b""
        while chunk := so.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _upload_request(body: bytes, key: str = TOKEN) -> bytes:
    return (f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nConnection: close\r\n"
            f"Content-Type: multipart/form-data; boundary=XX\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
    return f"--XX\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + value + b"\r\n"


def test_bad_uploads_and_undecodable_keys_answer_4xx_and_leave_nothing(tmp_path: Path) -> None:
    with serving(write_config(tmp_path)) as server:
        c = client(server)
        files = tmp_path / "api-data" / "files"
        line = jsonl([chat_line("a", "x")])
        # a multipart body cut before its closing boundary
        status, body = _raw(server, _upload_request(_part("purpose", b"batch") + b'--XX\r\nContent-Disposition: form-data; name="file"; '
                                                    b'filename="a.jsonl"\r\n\r\n' + line[:20]))
        assert status == 400 and "ended early" in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
        # two file parts: refused, and neither's bytes stay behind
        status, body = _raw(server, _upload_request(_part("purpose", b"batch") + _part("file", line, "a.jsonl")
                                                    + _part("file", line + line, "b.jsonl") + b"--XX--\r\n"))
        assert status == 400 and body["error"]["param"] == "file" and "more than one 'file'" in body["error"]["message"]
        assert not files.exists() or not list(files.iterdir())
        # expires_after as OpenAI takes it: anchor created_at, 3600 <= seconds <= 2592000
        for seconds in (-5, 0, 3599, 2592001):
            with pytest.raises(openai.BadRequestError) as info:
                c.files.create(file=("a.jsonl", line), purpose="batch", expires_after={"anchor": "created_at", "seconds": seconds})
            assert info.value.body["param"] == "expires_after" and "between 3600 and 2592000" in info.value.body["message"]
        status, body = _raw(server, _upload_request(_part("purpose", b"batch") + _part("expires_after[anchor]", b"last_active_at")
                                                    + _part("expires_after[seconds]", b"3600") + _part("file", line, "a.jsonl") + b"--XX--\r\n"))
        assert status == 400 and body["error"]["param"] == "expires_after"
        assert not files.exists() or not list(files.iterdir())
        kept = c.files.create(file=("a.jsonl", line), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600})
        assert kept.expires_at == kept.created_at + 3600 and kept.bytes == len(line)
        assert c.files.content(kept.id).content == line
        # a key header that is no UTF-8: 401 in the calling API's shape, no traceback
        for header in (b"Authorization: Bearer \xff\xfe" + TOKEN.encode(), b"x-api-key: \xff\xfe" + TOKEN.encode()):
            for path in (b"/v1/files", b"/v1/messages/batches"):
                status, body = _raw(server, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + header + b"\r\n\r\n")
                assert status == 401, body
                assert (body["error"]["type"] == "authentication_error" if b"messages" in path else body["error"]["code"] == "invalid_api_key")
        assert "Traceback" not in server.log.read_text()


def test_a_server_killed_between_writing_and_publishing_a_batchs_files_serves_only_whole_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path)
    lines = [chat_line(f"r{i}", f"question {i}") for i in range(300)] + [chat_line("bad", "x", model="gpt-4o")]
    monkeypatch.setenv(FAULT_ENV, "before_publish")
    server = start(config)
    try:
        c = client(server)
        batch = submit(c, lines)
        wait_for(lambda: server.proc.poll() is not None, timeout_s=60, what="the server to kill itself before publishing")
    finally:
        server.stop(signal.SIGKILL)
    assert server.proc.returncode == -signal.SIGKILL
    monkeypatch.delenv(FAULT_ENV)
    with serving(config) as again:
        c = client(again)
        served: dict[str, bytes] = {}

        def completed_reading_every_output_file() -> Any:
            """Every batch_output file listed at any moment parses whole, and one id always serves the same bytes
            (the batch is read first: a batch seen completed had its files published before the list)."""
            b = c.batches.retrieve(batch.id)
            for f in c.files.list(purpose="batch_output"):
                try:
                    content = c.files.content(f.id).content
                except openai.NotFoundError:  # an unpublished delivery's file, removed meanwhile
                    continue
                assert all(json.loads(x) for x in content.splitlines()) and content.endswith(b"\n")
                assert served.setdefault(f.id, content) == content, f"file {f.id} changed"
            return b.status == "completed" and b

        done = wait_for(completed_reading_every_output_file, every_s=0.01, timeout_s=60, what="the resumed delivery")
        out, err = delivered(c, done)
        assert len(out) == 300 and [x["custom_id"] for x in err] == ["bad"]
        assert served[done.output_file_id] == c.files.content(done.output_file_id).content
        # the killed delivery's files were never given to anyone, and are gone
        assert {f.id for f in c.files.list(purpose="batch_output")} == {done.output_file_id, done.error_file_id}
        on_disk = {p.name for p in (tmp_path / "api-data" / "files").iterdir()}
        assert on_disk == {done.input_file_id, done.output_file_id, done.error_file_id}
        deliveries = tmp_path / "api-data" / "batches" / batch.id / "deliveries"
        assert [p.name for p in deliveries.iterdir()] == [done.output_file_id]
