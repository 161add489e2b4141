"""`/v1/completions` and `/v1/responses` batches with the official `openai` SDK, unchanged, and
the endpoint registry a new endpoint joins with one file and one line (issue 43 #2, issue 42 #3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from openai.types import Completion
from openai.types.responses import Response

from batch_inference.api.endpoints import ENDPOINTS, Refused
from batch_inference_tests.api.helpers import client, delivered, jsonl, serving, wait_status, write_config

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"], "additionalProperties": False}


def _line(cid: str, url: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "tiny", **body}}


def _submit(c: OpenAI, lines: list[dict[str, Any]], endpoint: str) -> Any:
    f = c.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    return wait_status(c, c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h").id,  # type: ignore[arg-type]
                       ("completed", "failed"))


def _refused(err: dict[str, Any]) -> dict[str, Any]:
    """The 400 body of a line refused alone (OpenAI's shape)."""
    assert err["error"] is None and err["response"]["status_code"] == 400, err
    error: dict[str, Any] = err["response"]["body"]["error"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.process
@pytest.mark.slow
def test_completions_and_responses_batches_with_the_sdk(tmp_path: Path) -> None:
    completions = [_line(f"c{i}", "/v1/completions", prompt=f"Once upon a time {i}", max_tokens=6, temperature=0.5,
                         top_p=0.9, stop=["zzz"], seed=i, n=1) for i in range(4)]
    completions += [
        _line("c-defaults-off", "/v1/completions", prompt="x", echo=False, best_of=1, suffix=None, logprobs=None),
        _line("c-echo", "/v1/completions", prompt="x", echo=True),  # the engine cannot echo: that line alone
        _line("c-list", "/v1/completions", prompt=["a", "b"]),  # several prompts a request: that line alone
        _line("c-other-model", "/v1/completions", prompt="x", model="gpt-4o"),
    ]
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "input_text", "text": "question "}, {"type": "input_text", "text": "two"}]}]
    responses = [_line(f"r{i}", "/v1/responses", input=f"question {i}", max_output_tokens=6) for i in range(3)]
    responses += [
        _line("r-messages", "/v1/responses", input=messages, instructions="answer in one word", temperature=0.2,
              tools=[], store=False, metadata={"k": "v"}),
        _line("r-cut", "/v1/responses", input="question", max_output_tokens=2),
        _line("r-schema", "/v1/responses", input="x", text={"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}),
        _line("r-previous", "/v1/responses", input="x", previous_response_id="resp_1"),
        _line("r-image", "/v1/responses", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
    ]
    engine = {"kind": "simulated", "simulated": {"latency_a_s": 0.0, "latency_b_s": 0.0, "output_tokens": 4}}
    config = write_config(tmp_path, {"tiny": {"engine": engine, "shard_records": 4, "chunk_size": 2}})
    with serving(config) as server:
        c = client(server)
        done = _submit(c, completions, "/v1/completions")
        assert done.status == "completed" and done.endpoint == "/v1/completions", done
        out, err = delivered(c, done)
        assert {x["custom_id"] for x in out} == {"c0", "c1", "c2", "c3", "c-defaults-off"}
        for line in out:
            body = Completion.model_validate(line["response"]["body"])  # the SDK's own type reads it
            assert body.object == "text_completion" and body.model == "tiny" and isinstance(body.choices[0].text, str)
            assert body.usage is not None and body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens > 0
        errors = {x["custom_id"]: x for x in err}
        assert set(errors) == {"c-echo", "c-list", "c-other-model"}
        assert _refused(errors["c-echo"])["param"] == "echo"
        assert _refused(errors["c-list"])["param"] == "prompt"
        assert errors["c-other-model"]["error"]["code"] == "model_not_found"

        done = _submit(c, responses, "/v1/responses")
        assert done.status == "completed" and done.endpoint == "/v1/responses", done
        out, err = delivered(c, done)
        assert {x["custom_id"] for x in out} == {"r0", "r1", "r2", "r-messages", "r-cut"}
        bodies = {x["custom_id"]: x["response"]["body"] for x in out}
        for cid, raw in bodies.items():
            body = Response.model_validate(raw)
            assert body.object == "response" and body.model == "tiny" and body.id.startswith("resp_")
            assert body.output[0].type == "message" and body.output[0].content[0].type == "output_text"  # type: ignore[union-attr]
            assert body.output_text == body.output[0].content[0].text  # type: ignore[union-attr]
            assert body.usage is not None and body.usage.input_tokens > 0
            assert body.usage.total_tokens == body.usage.input_tokens + body.usage.output_tokens
        assert bodies["r0"]["status"] == "completed" and bodies["r0"]["usage"]["output_tokens"] == 4
        assert bodies["r-cut"]["status"] == "incomplete" and bodies["r-cut"]["incomplete_details"] == {"reason": "max_output_tokens"}
        assert bodies["r-cut"]["usage"]["output_tokens"] == 2
        # instructions and the developer message are system text: more prompt tokens than the bare question
        assert bodies["r-messages"]["usage"]["input_tokens"] > bodies["r0"]["usage"]["input_tokens"]
        assert done.usage.input_tokens == sum(b["usage"]["input_tokens"] for b in bodies.values())
        errors = {x["custom_id"]: x for x in err}
        assert set(errors) == {"r-schema", "r-previous", "r-image"}
        assert _refused(errors["r-schema"])["param"] == "response_format"  # this engine cannot constrain: that line alone
        assert _refused(errors["r-previous"])["param"] == "previous_response_id"
        assert "input_image" in _refused(errors["r-image"])["message"]


@pytest.mark.process
@pytest.mark.slow
def test_a_line_whose_url_is_not_the_batchs_endpoint_fails_the_batch_naming_it(tmp_path: Path) -> None:
    """As OpenAI validates a batch: every line's url is the batch's endpoint, else the batch fails
    (``invalid_url``, the line named) before anything runs."""
    lines = [_line("r0", "/v1/responses", input="x"), _line("chat", "/v1/chat/completions", messages=[{"role": "user", "content": "x"}])]
    with serving(write_config(tmp_path)) as server:
        c = client(server)
        failed = _submit(c, lines, "/v1/responses")
        assert failed.status == "failed" and failed.output_file_id is None and failed.errors is not None
        assert [(e.code, e.line) for e in failed.errors.data] == [("invalid_url", 2)]
        assert "'/v1/responses'" in (failed.errors.data[0].message or "")


def test_responses_bodies_map_to_the_pipelines_chat_request() -> None:
    """text.format json_schema becomes the chat request's response_format (structured output where
    the engine constrains); instructions a system message before the input."""
    responses = ENDPOINTS["/v1/responses"]
    assert responses.pipeline_url == "/v1/chat/completions"
    chat = responses.request({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 9, "top_p": 0.5,
                              "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}}})
    assert chat == {"model": "m", "max_tokens": 9, "top_p": 0.5,
                    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}}
    assert responses.request({"input": "x", "text": {"format": {"type": "json_object"}}})["response_format"] == {"type": "json_object"}  # type: ignore[index]
    assert "response_format" not in responses.request({"input": "x", "text": {"format": {"type": "text"}}})  # type: ignore[operator]
    for body, param in (({}, "input"), ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"), ({"input": "x", "text": {"verbosity": "low"}}, "text"),
                        ({"input": [{"role": "tool", "content": "x"}]}, "input"), ({"input": 5}, "input"),
                        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": SCHEMA}}}, "text")):
        refused = responses.request(body)
        assert isinstance(refused, Refused) and refused.param == param, (body, refused)
    # an output message of an earlier turn, given back as input, is an assistant turn
    earlier = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "4", "annotations": []}]}
    assert responses.request({"input": [{"role": "user", "content": "2+2?"}, earlier, {"role": "user", "content": "and 3+3?"}]}) == {
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]}


def test_every_endpoint_is_one_registry_entry_with_its_own_url() -> None:
    assert set(ENDPOINTS) == {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings"}
    assert all(url == e.url for url, e in ENDPOINTS.items())
