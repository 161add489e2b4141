"""Usage per project, /metrics scraped while batches run, and deadlines (issue 43 #3, #4), against a server process."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batch_inference_tests.api.helpers import (KEY_A1, KEY_B, PROJECTS, TOKEN, Server, chat_line, client, delivered, serving,
                                               slow_model, start, submit, wait_for, wait_status, write_config)

pytestmark = [pytest.mark.process, pytest.mark.slow]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(server: Server, key: str | None = None) -> Samples:
    """/metrics, read with Prometheus' own parser: each sample by name and labels."""
    request = urllib.request.Request(f"{server.url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def usage(server: Server, key: str, **params: Any) -> dict[str, Any]:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    request = urllib.request.Request(f"{server.v1}/organization/usage/completions?{query}", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


def test_metrics_during_a_run_add_up_to_the_output_files_and_usage_is_per_project_across_a_sigkill(tmp_path: Path) -> None:
    config = write_config(tmp_path, slow_model(), tokens=PROJECTS)
    server = start(config)
    try:
        a, b = client(server, KEY_A1), client(server, KEY_B)
        lines_a = [chat_line(f"a{i}", f"question {i} " * (1 + i % 3)) for i in range(60)] + [chat_line("nope", "x", model="other")]
        batch_a = submit(a, lines_a)
        batch_b = submit(b, [chat_line(f"b{i}", f"b question {i}") for i in range(20)])
        scrapes: list[Samples] = []
        while a.batches.retrieve(batch_a.id).status not in ("completed", "failed"):
            scrapes.append(scrape(server))
            time.sleep(0.2)
        done_a, done_b = wait_status(a, batch_a.id, ("completed",)), wait_status(b, batch_b.id, ("completed",))
        final = scrape(server)
        # while a batch ran: it was in progress, its requests queued / running / done added up to its total, engine tokens moved
        running = [s for s in scrapes if sample(s, "batch_inference_api_batches", state="in_progress") >= 1]
        assert running, "no scrape saw a batch in progress"
        totals = {sum(sample(s, "batch_inference_api_batch_requests", model="tiny", state=x) for x in ("queued", "running", "done"))
                  for s in running}
        assert totals <= {0.0, 20.0, 61.0, 81.0}, totals  # validating batches count nothing yet
        engine_in = [sample(s, "batch_inference_api_engine_tokens_total", project="team-a", model="tiny", kind="input") for s in scrapes]
        assert engine_in == sorted(engine_in) and any(0 < x for x in engine_in), "counters move up while the batch runs"
        assert any(sample(s, "batch_inference_api_requests_per_second", model="tiny") > 0 for s in scrapes)
        # ended: the counters are the output files' usage and lines, per project
        for key, project, batch, c in ((KEY_A1, "team-a", done_a, a), (KEY_B, "team-b", done_b, b)):
            out, err = delivered(c, batch)
            prompt = sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out)
            completion = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
            assert prompt > 0 and completion > 0
            assert sample(final, "batch_inference_api_tokens_total", project=project, model="tiny", kind="input") == prompt
            assert sample(final, "batch_inference_api_tokens_total", project=project, model="tiny", kind="output") == completion
            assert sample(final, "batch_inference_api_requests_total", project=project, model="tiny", outcome="completed") == len(out)
            assert sample(final, "batch_inference_api_requests_total", project=project, model="tiny", outcome="failed") == len(err)
            assert sample(final, "batch_inference_api_engine_seconds_total", project=project, model="tiny") > 0
            page = usage(server, key, start_time=int(time.time()) - 3600, group_by="project_id,model")
            results = [r for bucket in page["data"] for r in bucket["results"]]
            assert page["object"] == "page" and [(r["project_id"], r["model"]) for r in results] == [(project, "tiny")]
            r = results[0]
            assert r["object"] == "organization.usage.completions.result" and r["batch"] is None
            assert (r["input_tokens"], r["output_tokens"], r["num_model_requests"]) == (prompt, completion, len(out))
            assert r["requests"] == {"completed": len(out), "failed": len(err), "expired": 0, "cancelled": 0} and r["engine_seconds"] > 0
        assert sample(final, "batch_inference_api_batches", state="completed") == 2
        assert sample(final, "batch_inference_api_tokens_per_second", model="tiny") >= 0
        # a bad parameter is OpenAI's 400 naming it
        with pytest.raises(urllib.error.HTTPError) as bad:
            usage(server, KEY_A1, start_time=0, bucket_width="2d")
        assert bad.value.code == 400 and json.loads(bad.value.read())["error"]["param"] == "bucket_width"
        before = usage(server, KEY_A1, start_time=int(time.time()) - 3600)
        server.stop(signal.SIGKILL)
        server = start(config)
        # persisted: the same usage and counters after a SIGKILL
        assert usage(server, KEY_A1, start_time=before["data"][0]["start_time"]) == before
        again = scrape(server)
        for name in ("batch_inference_api_tokens_total", "batch_inference_api_requests_total", "batch_inference_api_engine_seconds_total"):
            assert {k: v for k, v in again.items() if k[0] == name} == {k: v for k, v in final.items() if k[0] == name}
    finally:
        server.stop()


def test_an_admin_project_reads_every_projects_usage_and_guards_metrics(tmp_path: Path) -> None:
    config = write_config(tmp_path, tokens=PROJECTS, admin_project="default")
    with serving(config) as server:
        wait_status(client(server, KEY_B), submit(client(server, KEY_B), [chat_line("b", "hello")]).id, ("completed",))
        with pytest.raises(urllib.error.HTTPError) as refused:
            scrape(server, KEY_B)
        assert refused.value.code == 401
        assert sample(scrape(server, TOKEN), "batch_inference_api_requests_total", project="team-b", model="tiny", outcome="completed") == 1
        since = int(time.time()) - 60
        everyone = usage(server, TOKEN, start_time=since, bucket_width="1h", group_by="project_id")
        assert [r["project_id"] for bucket in everyone["data"] for r in bucket["results"]] == ["team-b"]
        assert [r for bucket in usage(server, KEY_A1, start_time=since)["data"] for r in bucket["results"]] == []  # not team-a's


def test_a_1h_batch_created_after_a_large_24h_batch_finishes_first_and_nothing_is_lost(tmp_path: Path) -> None:
    config = write_config(tmp_path, slow_model(), tokens=PROJECTS, limits={"completion_windows": ["1h", "24h"]})
    with serving(config) as server:
        a, b = client(server, KEY_A1), client(server, KEY_B)
        large = submit(a, [chat_line(f"L{i}", f"question {i}") for i in range(400)], window="24h")
        wait_for(lambda: a.batches.retrieve(large.id).request_counts.completed >= 10, what="the large batch to start")
        urgent = submit(b, [chat_line(f"U{i}", f"question {i}") for i in range(80)], window="1h")
        # from the urgent batch's first answer to its last, the large one gets no new slot: it finishes
        # only what was in flight then (two shard tasks of 10), where turns would give it as many as the urgent one ran
        wait_for(lambda: b.batches.retrieve(urgent.id).request_counts.completed > 0, what="the urgent batch to start")
        large_then = a.batches.retrieve(large.id).request_counts.completed
        done = wait_status(b, urgent.id, ("completed",))
        large_now = a.batches.retrieve(large.id)
        assert large_now.status == "in_progress", "the 1h batch waited for the 24h one"
        assert large_now.request_counts.completed - large_then <= 30, (large_then, large_now.request_counts)
        estimate = (large_now.model_extra or {}).get("expected_finish_at")
        assert isinstance(estimate, int) and estimate < large_now.expires_at  # the pool's measured rate says it makes its window
        large_done = wait_status(a, large.id, ("completed",), timeout_s=240)
        assert done.completed_at <= large_done.completed_at
        out, err = delivered(b, done)
        assert len(out) == 80 and not err
        out, err = delivered(a, large_done)
        assert len(out) == 400 and not err


def test_a_batch_that_cannot_finish_in_its_window_is_accepted_and_says_when_it_would(tmp_path: Path) -> None:
    config = write_config(tmp_path, slow_model(), limits={"completion_windows": ["24h", "8s"]})
    with serving(config) as server:
        c = client(server)
        batch = submit(c, [chat_line(f"r{i}", f"question {i}") for i in range(2000)], window="8s")  # ~40 s of work
        assert batch.status == "validating"  # accepted, as OpenAI accepts it
        ended = wait_status(c, batch.id, ("expired", "completed"))
        assert ended.status == "expired"
        estimate = (ended.model_extra or {}).get("expected_finish_at")
        assert isinstance(estimate, int) and estimate > ended.expires_at
        out, err = delivered(c, ended)
        assert len(out) + len(err) == 2000 and any(x["error"]["code"] == "batch_expired" for x in err)
