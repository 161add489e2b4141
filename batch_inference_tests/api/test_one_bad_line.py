"""One bad request line never fails its batch, and nothing a client reads names the server's
storage: the official SDKs (and raw HTTP where the SDK would hide the bytes) against
`batch-inference api serve`."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
from anthropic import Anthropic

from batch_inference_tests.api.helpers import (TOKEN, Server, chat_line, client, delivered, serving, submit, wait_for,
                                               wait_status, write_config)

pytestmark = [pytest.mark.process, pytest.mark.slow]  # a server in a child process, its pipeline runs inside

LONG = {"kind": "simulated", "simulated": {"latency_a_s": 0.002, "latency_b_s": 0.0, "output_tokens": 6}}
# every word the simulated engine writes after its first (its verdict): a stop on all of them
# ends each answer at its second word, so which one ended it is known to the test
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
         "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def anthropic_client(server: Server) -> Anthropic:
    return Anthropic(base_url=server.url, api_key=TOKEN, max_retries=0)


def message_request(cid: str, content: str, **params: Any) -> dict[str, Any]:
    return {"custom_id": cid, "params": {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": content}], **params}}


def wait_ended(c: Anthropic, batch_id: str) -> Any:
    return wait_for(lambda: (b := c.messages.batches.retrieve(batch_id)).processing_status == "ended" and b, timeout_s=120,
                    what=f"message batch {batch_id} to end")


def raw_get(server: Server, path: str) -> str:
    """The body of ``GET path`` as the server sent it (no SDK parsing in between)."""
    req = urllib.request.Request(f"{server.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as response:
        return response.read().decode("utf-8")


def storage_forms(tmp_path: Path) -> list[str]:
    root = (tmp_path / "api-data").resolve()
    return [str(root), root.as_uri(), str(tmp_path.resolve())]


def assert_no_storage(text: str, tmp_path: Path) -> None:
    for form in storage_forms(tmp_path):
        assert form not in text, f"a response names the server's storage {form!r}: {text[:2000]}"


def test_one_anthropic_request_with_a_non_string_model_errors_alone(tmp_path: Path) -> None:
    """Issue 39 #7: one request of six with ``model: 123`` errored all six and the results came
    back empty; now five succeed and the sixth is errored naming its model."""
    requests = [message_request(f"q{i}", f"question {i}") for i in range(5)]
    requests.append({"custom_id": "bad-model", "params": {**message_request("x", "y")["params"], "model": 123}})
    with serving(write_config(tmp_path)) as server:
        c = anthropic_client(server)
        done = wait_ended(c, c.messages.batches.create(requests=requests).id)  # type: ignore[arg-type]
        assert done.request_counts.succeeded == 5 and done.request_counts.errored == 1, done.request_counts
        by_id = {r.custom_id: r.result for r in c.messages.batches.results(done.id)}
        assert sorted(by_id) == sorted(r["custom_id"] for r in requests)
        assert all(by_id[f"q{i}"].type == "succeeded" for i in range(5))
        bad = by_id["bad-model"]
        assert bad.type == "errored" and bad.error.error.type == "invalid_request_error"
        assert "params.model" in bad.error.error.message and "string" in bad.error.error.message
        assert_no_storage(raw_get(server, f"/v1/messages/batches/{done.id}") + raw_get(server, f"/v1/messages/batches/{done.id}/results"),
                          tmp_path)


def test_no_response_about_a_batch_with_bad_lines_names_the_storage(tmp_path: Path) -> None:
    """Issue 39 #7: a batch the pipeline refused as a file said where the server keeps its
    files (``errors.data[].message`` began with the input's absolute path)."""
    lines = [chat_line(f"q{i}", f"question {i}") for i in range(4)]
    lines.append({**chat_line("get", "x"), "method": "GET"})  # a file-level problem: the pipeline refuses the file
    with serving(write_config(tmp_path)) as server:
        c = client(server)
        failed = wait_status(c, submit(c, lines).id, ("completed", "failed"))
        assert failed.status == "failed" and failed.errors and failed.errors.data
        assert any("method 'GET'" in (e.message or "") for e in failed.errors.data), failed.errors
        # a batch with lines refused alone (another model, a body field it cannot honour, a non-string model)
        mixed = [chat_line(f"q{i}", f"question {i}") for i in range(4)]
        mixed += [chat_line("other", "x", model="gpt-4o"), chat_line("tools", "x", tools=[]), chat_line("int-model", "x", model=7)]
        done = wait_status(c, submit(c, mixed).id, ("completed", "failed"))
        assert done.status == "completed", done
        bodies = [raw_get(server, f"/v1/batches/{b}") for b in (failed.id, done.id)] + [raw_get(server, "/v1/batches")]
        bodies += [raw_get(server, f"/v1/files/{f}/content") for f in (done.output_file_id, done.error_file_id)]
        bodies += [raw_get(server, "/v1/files")]
        assert_no_storage("\n".join(bodies), tmp_path)


def test_fields_openai_accepts_are_honoured_ignored_or_refused_line_by_line(tmp_path: Path) -> None:
    """Issue 39 #8: ``presence_penalty``, ``user`` or ``logprobs: false`` on one line failed the
    whole batch (``in_progress`` then ``failed``, no output file)."""
    lines = [chat_line(f"q{i}", f"question {i}") for i in range(3)]
    lines += [
        chat_line("presence", "x", presence_penalty=0.5), chat_line("frequency", "x", frequency_penalty=-0.5),
        chat_line("user", "x", user="u-1", metadata={"k": "v"}, store=False, service_tier="auto"),
        chat_line("logprobs-off", "x", logprobs=False, top_logprobs=None), chat_line("seed-stop", "x", seed=3, stop=["zzz"]),
        chat_line("logprobs-on", "x", logprobs=True, top_logprobs=2),  # log probabilities are not carried: refused alone
        chat_line("tools", "x", tools=[{"type": "function", "function": {"name": "f"}}]),  # not supported: refused alone
        chat_line("two", "x", n=2),  # one choice a request: the line's own error
    ]
    with serving(write_config(tmp_path)) as server:
        c = client(server)
        done = wait_status(c, submit(c, lines).id, ("completed", "failed"))
        assert done.status == "completed" and done.errors is None, done
        out, err = delivered(c, done)
        assert {x["custom_id"] for x in out} == {"q0", "q1", "q2", "presence", "frequency", "user", "logprobs-off", "seed-stop"}
        errors = {x["custom_id"]: x for x in err}
        assert set(errors) == {"logprobs-on", "tools", "two"}
        for cid, param in (("logprobs-on", "logprobs"), ("tools", "tools")):
            line = errors[cid]  # OpenAI's shape of a request its endpoint answered 400
            assert line["error"] is None and line["response"]["status_code"] == 400, line
            error = line["response"]["body"]["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param and param in error["message"]
        assert errors["two"]["error"]["code"] == "bad_sampling" and "n" in errors["two"]["error"]["message"]


def test_a_repeated_custom_id_fails_the_batch_at_validation_naming_its_line(tmp_path: Path) -> None:
    """Issue 39 #9 / issue 40 #10: a repeated custom_id was answered twice (in the output and
    the error file, one request id); OpenAI refuses such a batch, naming the line."""
    lines = [chat_line("a", "x"), chat_line("b", "y"), chat_line("a", "z"), chat_line("c", "w")]
    with serving(write_config(tmp_path)) as server:
        c = client(server)
        done = wait_status(c, submit(c, lines).id, ("completed", "failed"))
        assert done.status == "failed" and done.output_file_id is None and done.error_file_id is None, done
        assert done.errors is not None
        dup = [e for e in done.errors.data if e.code == "duplicate_custom_id"]
        assert len(dup) == 1 and dup[0].line == 3 and "'a'" in (dup[0].message or "") and "line 1" in (dup[0].message or ""), done.errors
        assert_no_storage(raw_get(server, f"/v1/batches/{done.id}"), tmp_path)


def test_a_stop_sequence_that_ended_the_text_is_anthropics_stop_reason(tmp_path: Path) -> None:
    """Issue 39 #10: ``stop_reason`` was ``end_turn`` and ``stop_sequence`` null when one of the
    request's stop sequences ended the text."""
    model = {"tiny": {"engine": LONG, "shard_records": 10, "chunk_size": 5, "limits": {"stop": len(WORDS)}}}
    with serving(write_config(tmp_path, model)) as server:
        c = anthropic_client(server)
        requests = [message_request(f"s{i}", f"question {i}", stop_sequences=WORDS) for i in range(3)]
        requests.append(message_request("plain", "question"))
        done = wait_ended(c, c.messages.batches.create(requests=requests).id)  # type: ignore[arg-type]
        by_id = {r.custom_id: r.result for r in c.messages.batches.results(done.id)}
        for i in range(3):
            message = by_id[f"s{i}"].message
            verdict, matched = message.content[0].text, message.stop_sequence
            assert message.stop_reason == "stop_sequence" and matched in WORDS, message
            assert verdict in ("APPROVED ", "REJECTED "), message  # cut before the stop sequence, as Anthropic does
        assert by_id["plain"].message.stop_reason in ("end_turn", "max_tokens") and by_id["plain"].message.stop_sequence is None
        # the OpenAI side of the same stop: finish_reason "stop"
        oc = client(server)
        batch = wait_status(oc, submit(oc, [chat_line("s", "question", stop=WORDS)]).id, ("completed", "failed"))
        (line,), _ = delivered(oc, batch)
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] in WORDS, choice


def test_line_separators_in_answers_are_escaped_in_every_file_served(tmp_path: Path) -> None:
    """Issue 40 #10: a raw U+0085 / U+2028 / U+2029 in a line split it for ``str.splitlines()``
    (the OpenAI SDK's file content read line by line); escaped, the JSON parses the same.
    (custom_ids carry them into the output and the error file: the simulated answers cannot.)"""
    odd = ["nel\u0085x", "ls\u2028x", "ps\u2029x"]
    lines = [chat_line(cid, "x") for cid in odd] + [chat_line("bad\u0085\u2028\u2029model", "x", model="gpt-4o")]
    with serving(write_config(tmp_path)) as server:
        c = client(server)
        done = wait_status(c, submit(c, lines).id, ("completed", "failed"))
        assert done.status == "completed", done
        out, err = delivered(c, done)  # lines_of: the SDK's file content, str.splitlines(), json.loads each
        assert sorted(x["custom_id"] for x in out) == sorted(odd)
        assert [x["custom_id"] for x in err] == ["bad\u0085\u2028\u2029model"]
        raw = raw_get(server, f"/v1/files/{done.output_file_id}/content")
        assert "\\u0085" in raw and "\u0085" not in raw and "\u2028" not in raw and "\u2029" not in raw
