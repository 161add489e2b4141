"""Reading a batch's input once, at validation: which requests run, which are refused alone.

Each line is read as the typed ``RequestLine`` (``api.protocol``), its body mapped by the
batch's endpoint (``api.endpoints``) to the pipeline's request and checked by the pipeline's
own typed line (``openai_batch.check_line``): the one check of a line. What runs goes to
``input.jsonl`` (pipeline request lines of the batch's model), what is refused alone to
``rejected.jsonl`` (error lines, each as OpenAI's HTTP 400 of that request or a
``model_not_found``); what makes the file wrong (a line that is no JSON object, too many
lines, another url than the batch's endpoint, a method other than POST, a repeated
custom_id) fails the batch with the lines named, as OpenAI's validation does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError

from batch_inference.api.config import ApiConfig
from batch_inference.api.endpoints import ENDPOINTS, Refused
from batch_inference.api.protocol import BatchRecord, RequestLine
from batch_inference.api.store import Store
from batch_inference.prompting.embeddings import URL, endpoint_mismatch
from batch_inference.prompting.openai_batch import check_line, error_line, jsonl_line, request_error_line

MAX_PROBLEMS = 100


@dataclass
class Checked:
    """What validating a batch's requests found."""

    total: int = 0
    runnable: int = 0
    rejected: int = 0
    model: str | None = None
    problems: list[dict[str, Any]] = field(default_factory=list)

    def problem(self, code: str, message: str, line: int | None) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append({"code": code, "message": message, "param": None, "line": line})


def _line_problem(exc: ValidationError, n: int, raw: dict[str, Any]) -> tuple[str, str]:
    """The file-level problem of a line that is no request line (its first error)."""
    error = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(x) for x in error["loc"])
    if where == "method":
        return "invalid_method", f"line {n}: method {raw.get('method')!r} (only POST)"
    if where == "custom_id":
        return "missing_custom_id", f"line {n} has no custom_id (a non-empty string)"
    return "invalid_request", f"line {n}: {where}: {error['msg']}"


def split_requests(config: ApiConfig, store: Store, record: BatchRecord) -> Checked:
    """Write ``input.jsonl`` and ``rejected.jsonl`` of ``record``'s batch (module docstring). Blocking."""
    from batch_inference.api.anthropic import to_openai_line

    endpoint = ENDPOINTS[record.endpoint]
    batch_dir = store.batch_dir(record.id)
    configured = sorted(config.models)
    constrains = {name: m.engine.structured_output for name, m in config.models.items()}
    out = Checked()
    first_line: dict[str, int] = {}  # custom_id -> the line it was first seen on
    max_lines = config.limits.max_lines
    inp, rej = store.open_writer(f"{batch_dir}/input.jsonl"), store.open_writer(f"{batch_dir}/rejected.jsonl")

    def refuse(cid: str, message: str, param: str | None) -> None:
        rej.write(jsonl_line(request_error_line(cid, run=record.id, message=message, param=param)))
        out.rejected += 1

    try:
        for n, raw in enumerate(store.lines(record.source_url), start=1):
            if not raw.strip():
                continue
            out.total += 1
            if out.total > max_lines:
                out.problem("too_many_requests", f"the batch has more than {max_lines} requests (limits.max_lines)", n)
                break
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                out.problem("invalid_json_line", f"line {n} is not valid JSON: {exc}", n)
                continue
            if not isinstance(data, dict):
                out.problem("invalid_request", f"line {n} is not a JSON object", n)
                continue
            cid = data.get("custom_id")
            if isinstance(cid, str) and cid:
                if cid in first_line:
                    out.problem("duplicate_custom_id", f"line {n}: custom_id {cid!r} is a duplicate of line {first_line[cid]}'s: "
                                "each request's custom_id must be unique in a batch", n)
                    continue
                first_line[cid] = n
            if record.api == "anthropic":
                data, refused = to_openai_line(data)
                if refused is not None:
                    rej.write(jsonl_line(error_line(data["custom_id"], run=record.id, code="invalid_request", message=refused)))
                    out.rejected += 1
                    continue
            if data.get("url") != record.endpoint:
                out.problem("invalid_url", f"line {n}: url {data.get('url')!r} is not the batch's endpoint {record.endpoint!r}", n)
                continue
            if not isinstance(data.get("body"), dict):
                if isinstance(cid, str) and cid:
                    refuse(cid, "body must be an object", "body")
                else:
                    out.problem("missing_custom_id", f"line {n} has no custom_id", n)
                continue
            try:
                line = RequestLine.model_validate(data)
            except ValidationError as exc:
                out.problem(*_line_problem(exc, n, data), n)
                continue
            cid = line.custom_id
            model = line.body.get("model")
            if "model" in line.body and not isinstance(model, str):
                refuse(cid, f"body.model must be a string, got {type(model).__name__}", "model")
                continue
            mapped = endpoint.request(line.body)
            if isinstance(mapped, Refused):
                refuse(cid, mapped.message, mapped.param)
                continue
            if isinstance(model, str) and model not in config.models:
                message = f"model {model!r} is not configured on this server (configured: {', '.join(configured)})"
            elif isinstance(model, str) and (why := endpoint_mismatch(record.endpoint, config.models[model].engine, model)):
                message = why
            elif out.model is not None and isinstance(model, str) and model != out.model:
                message = f"model {model!r}: a batch runs one model, and this batch's is {out.model!r} (its first request's)"
            else:
                request = {"custom_id": cid, "method": "POST", "url": endpoint.pipeline_url, "body": mapped}
                name = model if isinstance(model, str) else out.model or (configured[0] if len(configured) == 1 else None)
                _, problems = check_line(request, constrains=constrains.get(name or "", False), embeds=endpoint.pipeline_url == URL)
                if problems:
                    refuse(cid, *reversed(problems[0]))
                    continue
                if out.model is None and isinstance(model, str):
                    out.model = model
                out.runnable += 1
                native = record.api == "openai" and mapped is line.body and endpoint.pipeline_url == endpoint.url
                inp.write((raw if native else orjson.dumps(request)) + b"\n")  # a line the pipeline reads as sent stays byte for byte
                continue
            rej.write(jsonl_line(error_line(cid, run=record.id, code="model_not_found", message=message)))
            out.rejected += 1
        if out.total == 0:
            out.problem("empty_file", "the input file has no requests", None)
        if out.model is None:
            out.model = next(iter(config.models)) if len(config.models) == 1 else None
            if out.model is None and out.runnable:
                out.problem("missing_model", "no request names a model, and the server serves several: "
                            f"name one of {', '.join(configured)} in body.model", None)
        inp.commit()
        rej.commit()
    except BaseException:
        inp.discard()
        rej.discard()
        raise
    return out
