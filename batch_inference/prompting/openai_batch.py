"""The OpenAI Batch API file format, in and out (the format ``vllm run-batch``, OpenAI and most
gateways share): https://platform.openai.com/docs/guides/batch

In: each line ``{custom_id, method, url, body}`` is read as a typed ``BatchLine`` (pydantic,
shared by the sharding pass and the preflight) and becomes a native record at sharding
(``OpenAIBatchReader.convert``): ``id`` = ``custom_id``, ``messages`` (chat) or ``prompt``
(completions), the body's sampling fields under ``sampling`` (bounded per record by the
spec's ``infer.limits`` when the request is built), ``response_format``, and
``openai: {url, model}``. Metadata fields (``IGNORED_FIELDS``: ``user``, ``metadata``...)
and a falsy ``logprobs`` / ``top_logprobs`` are accepted and ignored. Problems that make the
*file* wrong for this run (unsupported body fields, ``logprobs: true``, another endpoint or
method, another model, constrained output on an engine that cannot constrain) are collected
over the whole pass and raised as one error listing each with the ``custom_id`` s that have
it; a request's own bad values (no messages, wrong roles, ``n`` > 1, ``max_tokens`` over the
cap) become that request's error instead. The API server refuses a line whose body it cannot
honour alone, before the pipeline reads the file, by the same check (``check_line``,
``request_error_line``).

Out: one output line per answered request and one error line per failed one
(``output_line`` / ``error_line``), in OpenAI's batch output format, each serialised by
``jsonl_line`` (raw U+0085 / U+2028 / U+2029 escaped).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batch_inference.prompting import embeddings
from batch_inference.prompting.embeddings import EmbeddingsBody, EmbeddingsLine
from batch_inference.rows import ErrorKind

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", embeddings.URL: "embeddings"}
SAMPLING_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n",
                   "presence_penalty", "frequency_penalty")
# Body fields that say something about the request, not how to answer it: accepted, ignored.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# Body fields accepted when they ask for nothing the pipeline does not give (falsy): logprobs
# are not carried from the engines to the output, so asking for them refuses the request.
OFF_ONLY_FIELDS = frozenset({"logprobs", "top_logprobs"})
EXAMPLES = 5  # custom_ids named per problem


class _Body(BaseModel):
    """The body fields this run reads. Their values are the request's own (checked when its
    request is built, within the spec's limits: a bad one is that request's error), so they
    are kept as given; any other field is kept too (``extra``) so the reader can name it."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    seed: Any = None
    stop: Any = None
    n: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None

    def sampling(self) -> dict[str, Any]:
        """The sampling fields the request gives (an explicit null included)."""
        given = self.model_fields_set
        return {k: getattr(self, k) for k in SAMPLING_FIELDS if k in given}


class ChatBody(_Body):
    messages: Any = None
    response_format: Any = None


class CompletionsBody(_Body):
    prompt: Annotated[str | None, Field(strict=True)] = None  # one string: several prompts per request are not supported


class _Line(BaseModel):
    model_config = ConfigDict(extra="allow")

    custom_id: Annotated[str, Field(min_length=1, strict=True)]
    method: Literal["POST"] = "POST"


class ChatLine(_Line):
    """A ``/v1/chat/completions`` request line."""

    url: Literal["/v1/chat/completions"]
    body: ChatBody

    def record(self) -> dict[str, Any]:
        """The native record: ``id``, ``messages``, ``response_format``, ``sampling``, ``openai``."""
        body = self.body
        record: dict[str, Any] = {"id": self.custom_id}
        if "messages" in body.model_fields_set:
            record["messages"] = body.messages
        if body.response_format is not None:
            record["response_format"] = body.response_format
        return _finish(record, self.url, body)


class CompletionsLine(_Line):
    """A ``/v1/completions`` request line."""

    url: Literal["/v1/completions"]
    body: CompletionsBody

    def record(self) -> dict[str, Any]:
        """The native record: ``id``, ``prompt``, ``sampling``, ``openai``."""
        record: dict[str, Any] = {"id": self.custom_id}
        if "prompt" in self.body.model_fields_set:
            record["prompt"] = self.body.prompt
        return _finish(record, self.url, self.body)


def _finish(record: dict[str, Any], url: str, body: _Body) -> dict[str, Any]:
    if sampling := body.sampling():
        record["sampling"] = sampling
    record["openai"] = {"url": url, "model": body.model}
    return record


# One request line of an OpenAI Batch input file: ``{custom_id, method, url, body}``, read by its url.
# (``/v1/embeddings``: ``prompting.embeddings``, which reads and answers those bodies.)
BatchLine = ChatLine | CompletionsLine | EmbeddingsLine
LINES: dict[str, type[BatchLine]] = {"/v1/chat/completions": ChatLine, "/v1/completions": CompletionsLine,
                                     embeddings.URL: EmbeddingsLine}
BODIES: dict[str, type[ChatBody] | type[CompletionsBody] | type[EmbeddingsBody]] = {
    "/v1/chat/completions": ChatBody, "/v1/completions": CompletionsBody, embeddings.URL: EmbeddingsBody}


def refused_fields(extra: dict[str, Any], url: str) -> list[tuple[str, str]]:
    """``(param, why)`` for each body field beyond the ones this pipeline reads that it cannot
    honour: any it does not know, and ``logprobs`` / ``top_logprobs`` asking for log
    probabilities. ``IGNORED_FIELDS`` and a falsy ``logprobs``/``top_logprobs`` pass."""
    refused = []
    for name in sorted(extra):
        value = extra[name]
        if name in IGNORED_FIELDS or (name in OFF_ONLY_FIELDS and value in (None, False, 0)):
            continue
        if name in OFF_ONLY_FIELDS:
            refused.append((name, f"{name}: {orjson.dumps(value).decode()}: log probabilities are not returned by this server "
                                  f"(send {name}: {'false' if name == 'logprobs' else 0} or leave it out)"))
        else:
            refused.append((name, f"unsupported body field {name!r} for {url}"))
    return refused


def looks_like_openai_batch(record: Any) -> bool:
    """True for an OpenAI Batch request line (``custom_id``, ``url`` and ``body`` present)."""
    return isinstance(record, dict) and {"custom_id", "url", "body"} <= record.keys()


class OpenAIBatchError(ValueError):
    """An OpenAI Batch file this run cannot take as it is; the message lists every problem."""


def _custom_id(raw: dict[str, Any]) -> str | None:
    cid = raw.get("custom_id")
    return cid if isinstance(cid, str) and cid else None


def record_id(raw: dict[str, Any], line: int) -> str:
    """The one id rule for a request line (``line``: 0-based): its ``custom_id``, or
    ``line-N`` (N 1-based) for a line without a usable one, whose file is refused anyway."""
    return _custom_id(raw) or f"line-{line + 1}"


def _example(raw: dict[str, Any], pos: int) -> str:
    """How a problem names a line: its custom_id, or its line number when it has none."""
    return _custom_id(raw) or f"line {pos + 1}"


def _what(error: Any, raw: dict[str, Any]) -> str:
    """A validation error of a line as the problem the reader lists."""
    loc = tuple(str(x) for x in error["loc"])
    if loc == ("custom_id",):
        return "custom_id must be a non-empty string"
    if loc == ("method",):
        return f"method {raw.get('method')!r} (only POST)"
    if loc == ("body",):
        return "body must be an object"
    if loc == ("body", "prompt"):
        return "body.prompt must be one string (several prompts in one request are not supported)"
    return f"{'.'.join(loc)}: {error['msg']}"


def check_line(raw: dict[str, Any], *, models: frozenset[str] | None = None, constrains: bool = False,
               embeds: bool = False) -> tuple[BatchLine | None, list[tuple[str | None, str]]]:
    """A request line read as its typed ``BatchLine``, and ``(param, why)`` for each thing in it
    this pipeline cannot honour (None: it is no request line this pipeline reads at all).

    The one check of a line: the sharding pass (``OpenAIBatchReader``) collects the problems
    over a file, and the API server refuses a line that has one alone, as OpenAI answers such
    a request with a 400, before the pipeline reads the file."""
    url = raw.get("url")
    model = LINES.get(url) if isinstance(url, str) else None
    if model is None:
        return None, [("url", f"url {url!r} (supported: {', '.join(ENDPOINTS)})")]
    try:
        line = model.model_validate(raw)
    except ValidationError as exc:
        return None, [(_param(error), _what(error, raw)) for error in exc.errors(include_url=False, include_input=False)]
    problems: list[tuple[str | None, str]] = []
    if line.model_extra:
        problems.append((None, f"unsupported line keys {sorted(line.model_extra)}"))
    body = line.body
    problems += refused_fields(body.model_extra or {}, line.url)
    if models is not None and body.model is not None and body.model not in models:
        problems.append(("model", f"body.model {body.model!r} is not served by this run (accepted: {', '.join(sorted(models))}); "
                                  f"to answer it, list it in the spec's openai_batch.model_aliases, or set "
                                  f"openai_batch.check_model: false to answer every model"))
    if isinstance(line, EmbeddingsLine) != embeds:
        problems.append(("url", f"url {line.url!r}: this run {'embeds (infer.task: embed): only /v1/embeddings' if embeds else 'generates text: /v1/embeddings needs infer.task: embed'}"))
    if isinstance(line, EmbeddingsLine) and (refusal := line.refusal()) is not None:
        problems.append((refusal.param, str(refusal)))
    if isinstance(body, ChatBody) and body.response_format is not None and not constrains:
        fmt = body.response_format
        if not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            problems.append(("response_format", "response_format: this run's engine cannot constrain generation "
                                                "(vLLM's structured outputs can); refusing to run it unconstrained"))
    return line, problems


def _param(error: Any) -> str | None:
    """The request parameter a validation error is about (``body.x`` -> ``x``)."""
    loc = [str(x) for x in error["loc"]]
    return loc[1] if loc[:1] == ["body"] and len(loc) > 1 else loc[0] if loc else None


@dataclass
class OpenAIBatchReader:
    """Reads request lines as typed ``BatchLine`` s and converts them to native records,
    collecting file-level problems (never raises per line).

    ``models``: the ``body.model`` values this run answers (None: any). ``constrains``:
    whether the run's engine can constrain generation (``response_format``).
    """

    models: frozenset[str] | None = None
    constrains: bool = False
    embeds: bool = False  # the run embeds (infer.task: embed): its lines are /v1/embeddings, and only those
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    endpoints: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    units: dict[str, str] = field(default_factory=dict)  # what a problem's count counts, when not requests

    def _problem(self, what: str, custom_id: Any) -> None:
        self.counts[what] += 1
        if len(self.problems[what]) < EXAMPLES:
            self.problems[what].append(f"custom_id {custom_id!r}")

    def file_problem(self, what: str, count: int, examples: list[str], *, unit: str = "request(s)") -> None:
        """A problem the pass found over the whole file rather than in one line it read (lines
        that are no JSON object, duplicate ids): ``count`` of them, named by ``examples``."""
        self.counts[what] += count
        self.problems[what].extend(examples[: EXAMPLES - len(self.problems[what])])
        self.units[what] = unit

    def line(self, raw: dict[str, Any], pos: int) -> BatchLine | None:
        """The typed line (``pos``: its 0-based line number), its problems collected; None when
        it is not a request line this run can read (its problems say why)."""
        self.endpoints[str(raw.get("url"))] += 1
        line, problems = check_line(raw, models=self.models, constrains=self.constrains, embeds=self.embeds)
        for _, why in problems:
            self._problem(why, line.custom_id if line is not None else _example(raw, pos))
        return line

    def convert(self, raw: dict[str, Any], pos: int) -> dict[str, Any]:
        """The native record for one request line. A line with problems refuses the whole file
        (``error``), so its record keeps only its id (``record_id``)."""
        line = self.line(raw, pos)
        return line.record() if line is not None else {"id": record_id(raw, pos)}

    def error(self, source: str) -> str | None:
        """One message naming every problem (its count and the first lines that have it), or None."""
        if not self.problems:
            return None
        lines = [f"{source}: OpenAI Batch input cannot run as it is ({sum(self.counts.values())} problem(s)):"]
        for what, examples in self.problems.items():
            shown = f", e.g. {', '.join(examples)}" if examples else ""
            lines.append(f"  {what}: {self.counts[what]} {self.units.get(what, 'request(s)')}{shown}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- out


def _hex(*parts: str, n: int = 24) -> str:
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=n // 2).hexdigest()


def output_line(row: dict[str, Any], *, run: str, model: str, created: int, judged: bool = False) -> dict[str, Any]:
    """An answered request: ``response.body`` is a chat.completion (or text_completion, or an
    embeddings list: ``prompting.embeddings.response_body``).

    ``judged``: the answer was approved by a judge of the user's (the API server's per-model
    ``judge``), so the line also says which attempt was approved, beyond OpenAI's fields:
    ``judge: {attempt, round, verdict}`` (``attempt`` counted from 1 over every round and
    in-place retry; ``round`` null when the in-place retry path approved it)."""
    cid = str(row["id"])
    openai = row.get("openai") or {}
    url = openai.get("url") or ("/v1/completions" if "prompt" in row and "messages" not in row else "/v1/chat/completions")
    if url == embeddings.URL:
        return _line(cid, run, embeddings.response_body(row, model=model))
    usage = row.get("usage") or {}
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    completion_tokens = int(usage.get("completion_tokens") or 0)
    finish = row.get("finish_reason") if row.get("finish_reason") in ("stop", "length") else "stop"
    text = row.get("result") or ""
    if url == "/v1/completions":
        body_id, obj = f"cmpl-{_hex(run, cid)}", "text_completion"
        choices: list[dict[str, Any]] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    else:
        body_id, obj = f"chatcmpl-{_hex(run, cid)}", "chat.completion"
        choices = [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None, "finish_reason": finish}]
    if finish == "stop" and isinstance(row.get("stop_sequence"), str):
        choices[0]["stop_reason"] = row["stop_sequence"]  # which stop string ended it, as vLLM's server says
    body = {
        "id": body_id, "object": obj, "created": created, "model": openai.get("model") or model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }
    line = _line(cid, run, body)
    if judged:
        line["judge"] = {"attempt": int(row.get("attempts") or 1), "round": row.get("round"), "verdict": row.get("verdict")}
    return line


def _line(cid: str, run: str, body: dict[str, Any]) -> dict[str, Any]:
    """An answered request's output line around its response ``body``."""
    return {"id": f"batch_req_{_hex(run, 'req', cid)}", "custom_id": cid,
            "response": {"status_code": 200, "request_id": f"req_{_hex(run, 'id', cid)}", "body": body},
            "error": None}


def request_error_line(custom_id: str, *, run: str, message: str, param: str | None = None) -> dict[str, Any]:
    """A request refused alone as OpenAI refuses it: ``response`` the HTTP 400 its endpoint
    would answer (``body.error``: ``{message, type: invalid_request_error, param, code}``), ``error`` null."""
    return {"id": f"batch_req_{_hex(run, 'req', custom_id)}", "custom_id": custom_id,
            "response": {"status_code": 400, "request_id": f"req_{_hex(run, 'id', custom_id)}",
                         "body": {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}},
            "error": None}


# Line separators that JSON allows raw in strings but Python's str.splitlines() (and
# JavaScript before ES2019) split on: NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR as UTF-8.
_SPLITTERS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def jsonl_line(obj: Any) -> bytes:
    """One JSONL line of a file this project serves in OpenAI's or Anthropic's format: orjson's
    bytes with U+0085, U+2028 and U+2029 escaped as ``\\uXXXX`` (as OpenAI's JSON writes them),
    so a reader splitting on every line break still gets one object a line. The escapes are
    valid JSON and parse to the same string; they can only occur inside strings."""
    return escape_line_breaks(orjson.dumps(obj)) + b"\n"


def escape_line_breaks(data: bytes) -> bytes:
    """``data`` (UTF-8 JSON) with its raw U+0085 / U+2028 / U+2029 escaped (``jsonl_line``)."""
    for raw, escaped in _SPLITTERS:
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def error_line(custom_id: str, *, run: str, code: str, message: str) -> dict[str, Any]:
    """A request that got no answer: ``response`` null, ``error`` ``{code, message}``."""
    return {"id": f"batch_req_{_hex(run, 'req', custom_id)}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def error_code(reason: str) -> str:
    """The error kind a reason is tagged with (``bad_messages: ...`` -> ``bad_messages``), else ``error``."""
    kind = ErrorKind.of(reason)
    return kind.value if kind is not None else "error"
