"""The OpenAI Batch API file format, in and out (the format ``vllm run-batch``, OpenAI and most
gateways share): https://platform.openai.com/docs/guides/batch

In: each line ``{custom_id, method, url, body}`` becomes a native record at sharding
(``OpenAIBatchReader.convert``): ``id`` = ``custom_id``, ``messages`` (chat) or ``prompt``
(completions), the body's sampling fields under ``sampling`` (bounded per record by the
spec's ``infer.limits`` when the request is built), ``response_format``, and
``openai: {url, model}``. Problems that make the *file* wrong for this run (unsupported
body fields, another endpoint or method, another model, constrained output on an engine
that cannot constrain) are collected over the whole pass and raised as one error listing
each with the ``custom_id`` s that have it; a request's own bad values (no messages, wrong
roles, ``n`` > 1, ``max_tokens`` over the cap) become that request's error instead.

Out: one output line per answered request and one error line per failed one
(``output_line`` / ``error_line``), in OpenAI's batch output format.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from batch_inference.rows import ErrorKind

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
SAMPLING_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n")
BODY_FIELDS = {
    "chat": frozenset({"model", "messages", "response_format", *SAMPLING_FIELDS}),
    "completions": frozenset({"model", "prompt", *SAMPLING_FIELDS}),
}
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})
EXAMPLES = 5  # custom_ids named per problem


def looks_like_openai_batch(record: Any) -> bool:
    """True for an OpenAI Batch request line (``custom_id``, ``url`` and ``body`` present)."""
    return isinstance(record, dict) and {"custom_id", "url", "body"} <= record.keys()


class OpenAIBatchError(ValueError):
    """An OpenAI Batch file this run cannot take as it is; the message lists every problem."""


@dataclass
class OpenAIBatchReader:
    """Converts request lines to native records, collecting file-level problems (never raises per line).

    ``models``: the ``body.model`` values this run answers (None: any). ``constrains``:
    whether the run's engine can constrain generation (``response_format``).
    """

    models: frozenset[str] | None = None
    constrains: bool = False
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    endpoints: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def _problem(self, what: str, custom_id: Any) -> None:
        self.counts[what] += 1
        if len(self.problems[what]) < EXAMPLES:
            self.problems[what].append(repr(custom_id))

    def convert(self, line: dict[str, Any], pos: int) -> dict[str, Any]:
        """The native record for one request line (``pos``: its 0-based line number)."""
        cid = line.get("custom_id")
        if not isinstance(cid, str) or not cid:
            self._problem("custom_id must be a non-empty string", cid if cid is not None else f"line {pos + 1}")
            cid = f"line-{pos + 1}"
        extra = line.keys() - LINE_KEYS  # (set views: the common, clean line costs no sort)
        if extra:
            self._problem(f"unsupported line keys {sorted(extra)}", cid)
        if line.get("method", "POST") != "POST":
            self._problem(f"method {line.get('method')!r} (only POST)", cid)
        url = line.get("url")
        kind = ENDPOINTS.get(url) if isinstance(url, str) else None
        if kind is None:
            self._problem(f"url {url!r} (supported: {', '.join(ENDPOINTS)})", cid)
            kind = "chat"
        self.endpoints[str(url)] += 1
        body = line.get("body")
        if not isinstance(body, dict):
            self._problem("body must be an object", cid)
            body = {}
        unsupported = body.keys() - BODY_FIELDS[kind]
        for name in sorted(unsupported) if unsupported else ():
            self._problem(f"unsupported body field {name!r} for {url}", cid)
        model = body.get("model")
        if self.models is not None and model is not None and model not in self.models:
            self._problem(f"body.model {model!r} is not served by this run (accepted: {', '.join(sorted(self.models))}); "
                          f"to answer it, list it in the spec's openai_batch.model_aliases, or set "
                          f"openai_batch.check_model: false to answer every model", cid)
        record: dict[str, Any] = {"id": cid}
        if kind == "chat":
            if "messages" in body:
                record["messages"] = body["messages"]
            fmt = body.get("response_format")
            if fmt is not None:
                if not self.constrains and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
                    self._problem("response_format: this run's engine cannot constrain generation "
                                  "(vLLM's structured outputs can); refusing to run it unconstrained", cid)
                record["response_format"] = fmt
        elif "prompt" in body:
            if not isinstance(body["prompt"], str):
                self._problem("body.prompt must be one string (several prompts in one request are not supported)", cid)
            record["prompt"] = body["prompt"]
        sampling = {k: body[k] for k in SAMPLING_FIELDS if k in body}
        if sampling:
            record["sampling"] = sampling
        record["openai"] = {"url": url, "model": model}
        return record

    def error(self, source: str) -> str | None:
        """One message naming every problem (count and example custom_ids), or None."""
        if not self.problems:
            return None
        lines = [f"{source}: OpenAI Batch input cannot run as it is ({sum(self.counts.values())} problem(s)):"]
        for what, ids in self.problems.items():
            n = self.counts[what]
            lines.append(f"  {what}: {n} request(s), e.g. custom_id {', '.join(ids)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- out


def _hex(*parts: str, n: int = 24) -> str:
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=n // 2).hexdigest()


def output_line(row: dict[str, Any], *, run: str, model: str, created: int) -> dict[str, Any]:
    """An answered request: ``response.body`` is a chat.completion (or text_completion)."""
    cid = str(row["id"])
    openai = row.get("openai") or {}
    url = openai.get("url") or ("/v1/completions" if "prompt" in row and "messages" not in row else "/v1/chat/completions")
    usage = row.get("usage") or {}
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    completion_tokens = int(usage.get("completion_tokens") or 0)
    finish = row.get("finish_reason") if row.get("finish_reason") in ("stop", "length") else "stop"
    text = row.get("result") or ""
    if url == "/v1/completions":
        body_id, obj = f"cmpl-{_hex(run, cid)}", "text_completion"
        choices = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    else:
        body_id, obj = f"chatcmpl-{_hex(run, cid)}", "chat.completion"
        choices = [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None, "finish_reason": finish}]
    body = {
        "id": body_id, "object": obj, "created": created, "model": openai.get("model") or model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
    return {"id": f"batch_req_{_hex(run, 'req', cid)}", "custom_id": cid,
            "response": {"status_code": 200, "request_id": f"req_{_hex(run, 'id', cid)}", "body": body},
            "error": None}


def error_line(custom_id: str, *, run: str, code: str, message: str) -> dict[str, Any]:
    """A request that got no answer: ``response`` null, ``error`` ``{code, message}``."""
    return {"id": f"batch_req_{_hex(run, 'req', custom_id)}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def error_code(reason: str) -> str:
    """The error kind a reason is tagged with (``bad_messages: ...`` -> ``bad_messages``), else ``error``."""
    kind = ErrorKind.of(reason)
    return kind.value if kind is not None else "error"
