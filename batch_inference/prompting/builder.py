"""Record -> request: the one place a record's prompt, sampling and response format are decided.

A ``Request`` is what an engine runs: a ``Prompt`` (text, or chat messages the engine
renders with its model's chat template) and the ``SamplingParams`` for this attempt. A
record that cannot become one raises ``RequestError`` (or the template's
``MissingFieldError``) naming the record; the task writes that as the record's error, and
``RequestError.kind`` says which (``bad_messages``, ``bad_sampling``, ``bad_request``).
All three are permanent: retrying the same record cannot fix it.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson
from pydantic import ValidationError

from batch_inference.engines.base import ChatPrompt, Prompt, ResponseFormat, SamplingParams
from batch_inference.judges.templates import PromptTemplate
from batch_inference.prompting.config import InferConfig, ResponseFormatConfig
from batch_inference.rows import ErrorKind

ROLES = ("system", "developer", "user", "assistant")
SAMPLING_KEYS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "min_tokens", "n",
                 "presence_penalty", "frequency_penalty")
_SAMPLING_KEY_SET = frozenset(SAMPLING_KEYS)
REQUEST_ERROR_KINDS = (ErrorKind.BAD_MESSAGES, ErrorKind.BAD_SAMPLING, ErrorKind.BAD_REQUEST)

_SEED_MODULUS = 2**31 - 1  # fits every engine's seed type (torch, numpy, vLLM)


def derive_seed(base: int | None, record_id: str, attempt: int) -> int:
    """A per-record, per-attempt seed: stable across runs, processes and batch mixes."""
    key = f"{0 if base is None else base}\x1f{record_id}\x1f{attempt}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % _SEED_MODULUS


def _penalty(x: Any) -> bool:
    """OpenAI's range for presence_penalty and frequency_penalty."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and -2 <= x <= 2


def sampling_checks(limits: Any) -> dict[str, tuple[Callable[[Any], bool], str]]:
    """Each per-record sampling key's check and the bound its error names, within ``limits``
    (built once per builder: a record's overrides are checked against it)."""
    return {
        "max_tokens": (lambda x: isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= limits.max_tokens,
                       f"an integer in [1, limits.max_tokens {limits.max_tokens}]"),
        "min_tokens": (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0, "an integer >= 0"),
        "temperature": (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= limits.temperature,
                        f"a number in [0, limits.temperature {limits.temperature:g}]"),
        "top_p": (lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x <= 1, "a number in (0, 1]"),
        "seed": (lambda x: x is None or (isinstance(x, int) and not isinstance(x, bool)), "an integer"),
        "stop": (lambda x: x is None or isinstance(x, str) or (isinstance(x, list) and all(isinstance(s, str) for s in x)),
                 "a string or a list of strings"),
        "presence_penalty": (_penalty, "a number in [-2, 2]"),
        "frequency_penalty": (_penalty, "a number in [-2, 2]"),
    }


class RequestError(ValueError):
    """A record that cannot become a request; ``str()`` is ``"<kind>: record '<id>': <why>"``."""

    def __init__(self, kind: ErrorKind, record_id: Any, why: str) -> None:
        self.kind = kind
        self.record_id = record_id
        self.why = why
        super().__init__(kind.tag(f"record {record_id!r}: {why}"))


@dataclass(frozen=True)
class Request:
    """One engine request: the prompt and this attempt's sampling."""

    prompt: Prompt
    params: SamplingParams
    # False for a sampled request (temperature > 0) whose seed was derived from no base seed
    # (neither the spec nor the record set one): repeatable, but nobody asked for the same
    # sample twice, so the cross-run result cache (pool.result_cache) never answers it.
    explicit_seed: bool = True


def _content(value: Any, record_id: Any, where: str) -> str:
    """Message content: a string, or OpenAI text parts (``[{type: text, text}]``) joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(ErrorKind.BAD_MESSAGES, record_id, f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(ErrorKind.BAD_MESSAGES, record_id, f"{where}.content must be a string or a list of text parts, got {type(value).__name__}")


def parse_messages(value: Any, record_id: Any, *, system: str | None = None) -> ChatPrompt:
    """OpenAI-style ``[{role, content}, ...]`` as a ChatPrompt (``developer`` counts as ``system``).

    ``system`` is prepended when the messages have no system turn of their own.
    """
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else type(value).__name__
        raise RequestError(ErrorKind.BAD_MESSAGES, record_id, f"'messages' must be a non-empty list of {{role, content}}, got {got}")
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RequestError(ErrorKind.BAD_MESSAGES, record_id, f"{where} must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise RequestError(ErrorKind.BAD_MESSAGES, record_id, f"{where}.role {role!r} is not one of {', '.join(ROLES)}")
        if "content" not in msg or msg["content"] is None:
            raise RequestError(ErrorKind.BAD_MESSAGES, record_id, f"{where} has no content")
        extra = sorted(set(msg) - {"role", "content", "name"})
        if extra:
            raise RequestError(ErrorKind.BAD_MESSAGES, record_id, f"{where}: unsupported message keys {extra} (tool calls are not supported)")
        turns.append(("system" if role == "developer" else role, _content(msg["content"], record_id, where)))
    if system is not None and turns[0][0] != "system":
        turns.insert(0, ("system", system))
    return ChatPrompt(tuple(turns))


class RequestBuilder:
    """Builds each record's ``Request`` from an ``InferConfig`` (templates parsed once)."""

    def __init__(self, config: InferConfig) -> None:
        self.config = config
        self.template = PromptTemplate(config.template, nulls=config.null_fields) if config.template is not None else None
        self.turns = [(m.role, PromptTemplate(m.content, nulls=config.null_fields)) for m in config.messages or ()]
        self.base = config.sampling.to_params()
        self.base_seed = config.sampling.seed
        self.response_format = config.response_format.to_format() if config.response_format else None
        self._checks = sampling_checks(config.limits)

    @property
    def chat(self) -> bool | None:
        """True when every prompt is chat, False when every prompt is text, None when records decide."""
        return {"template": False, "messages": True, "record": None}[self.config.source]

    def prompt(self, record: dict[str, Any]) -> Prompt:
        """The record's prompt; raises ``MissingFieldError`` or ``RequestError``."""
        rid = record.get("id")
        if self.template is not None:
            return self.template.render(record)
        if self.turns:
            messages = [{"role": role, "content": t.render(record)} for role, t in self.turns]
            return parse_messages(messages, rid, system=self.config.system)
        if "messages" in record:
            return parse_messages(record["messages"], rid, system=self.config.system)
        if isinstance(record.get("prompt"), str):
            return record["prompt"]
        raise RequestError(ErrorKind.BAD_REQUEST, rid, "has neither 'messages' (chat) nor a string 'prompt', and infer has no template")

    def params(self, record: dict[str, Any], attempt: int) -> SamplingParams:
        """This attempt's sampling: the spec's, the record's overrides within limits, a derived seed.

        One ``SamplingParams`` per record and attempt, built once from the checked overrides:
        the engine converts that one to its own."""
        return self._params(record, attempt)[0]

    def _params(self, record: dict[str, Any], attempt: int) -> tuple[SamplingParams, int | None]:
        """``params`` and the base seed it was derived from (None: no one set one)."""
        rid = record.get("id")
        updates: dict[str, Any] = {}
        base_seed = self.base_seed
        overrides = record.get(self.config.sampling_field) if self.config.sampling_field else None
        if overrides is not None:
            updates, base_seed = self._override(overrides, rid)
        fmt = self._response_format(record.get("response_format"), rid) if "response_format" in record else self.response_format
        adapter = self._adapter(record, rid)
        try:
            params = replace(self.base, **updates, seed=derive_seed(base_seed, str(rid), attempt), response_format=fmt, adapter=adapter)
        except ValueError as exc:  # e.g. min_tokens > max_tokens
            raise RequestError(ErrorKind.BAD_SAMPLING, rid, f"{self.config.sampling_field}: {exc}") from None
        return params, base_seed

    def build(self, record: dict[str, Any], attempt: int) -> Request:
        prompt = self.prompt(record)
        if self.config.task == "embed":  # no sampling: the vector depends on the prompt alone
            return Request(prompt, SamplingParams(embed=True, dimensions=self._dimensions(record), seed=None))
        params, base_seed = self._params(record, attempt)
        return Request(prompt, params, explicit_seed=base_seed is not None or params.temperature == 0)

    # -- per-record overrides -----------------------------------------------------------

    def _override(self, value: Any, rid: Any) -> tuple[dict[str, Any], int | None]:
        """The record's checked sampling fields (as ``SamplingParams`` fields) and its base seed."""
        field = self.config.sampling_field
        limits = self.config.limits
        if not isinstance(value, dict):
            raise RequestError(ErrorKind.BAD_SAMPLING, rid, f"{field!r} must be an object, got {type(value).__name__}")
        if unknown := sorted(value.keys() - _SAMPLING_KEY_SET):
            raise RequestError(ErrorKind.BAD_SAMPLING, rid, f"{field}: unsupported keys {unknown} (supported: {', '.join(SAMPLING_KEYS)})")
        v = dict(value)
        n = v.pop("n", 1)
        if n != 1:
            raise RequestError(ErrorKind.BAD_SAMPLING, rid, f"{field}.n is {n!r}: one completion per request is supported (n = 1)")
        if "max_completion_tokens" in v:
            if "max_tokens" in v and v["max_tokens"] != v["max_completion_tokens"]:
                raise RequestError(ErrorKind.BAD_SAMPLING, rid, f"{field}: max_tokens and max_completion_tokens disagree")
            v["max_tokens"] = v.pop("max_completion_tokens")
        for key, (ok, bound) in self._checks.items():
            if key in v and not ok(v[key]):
                raise RequestError(ErrorKind.BAD_SAMPLING, rid, f"{field}.{key} is {v[key]!r}: must be {bound}")
        stop = v.get("stop", self.base.stop)
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and len(stop) > limits.stop:
            raise RequestError(ErrorKind.BAD_SAMPLING, rid, f"{field}.stop has {len(stop)} strings > limits.stop {limits.stop}")
        seed = v.pop("seed", self.base_seed)
        return {k: (tuple(stop) if k == "stop" and stop is not None else v[k]) for k in v}, seed

    def _dimensions(self, record: dict[str, Any]) -> int | None:
        """An embedding's ``dimensions``: the record's own (an OpenAI embeddings body's), else the spec's."""
        if "dimensions" not in record or record["dimensions"] is None:
            return self.config.dimensions
        value = record["dimensions"]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RequestError(ErrorKind.BAD_REQUEST, record.get("id"), f"dimensions {value!r}: must be an integer >= 1")
        return value

    def _adapter(self, record: dict[str, Any], rid: Any) -> str | None:
        """The record's own adapter (null: the base model) among the spec's, else the spec's."""
        field = self.config.adapter_field
        if not field or field not in record:
            return self.config.adapter
        value = record[field]
        if value is None:
            return None
        if not isinstance(value, str) or value not in self.config.adapters:
            allowed = ", ".join(self.config.adapters) or "none (the engine has no lora adapters)"
            raise RequestError(ErrorKind.BAD_REQUEST, rid, f"{field} {value!r} is not one of the spec's adapters: {allowed}")
        return value

    def _response_format(self, value: Any, rid: Any) -> ResponseFormat | None:
        if value is None:
            return self.response_format
        fmt = response_format(value)
        if isinstance(fmt, str):
            raise RequestError(ErrorKind.BAD_REQUEST, rid, fmt)
        return fmt


def response_format(value: Any) -> ResponseFormat | None | str:
    """A record's ``response_format`` as the engine's ``ResponseFormat``, or why it is invalid.

    Records of a run mostly share one format: each distinct one (by its canonical JSON) is
    validated and its schema serialised once per process, not once per record and attempt."""
    try:
        key = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # not JSON (no record read from a file holds one): validated uncached
        return _validated_format(value)
    return _cached_format(key)


@functools.lru_cache(maxsize=1024)
def _cached_format(key: bytes) -> ResponseFormat | None | str:
    return _validated_format(orjson.loads(key))


def _validated_format(value: Any) -> ResponseFormat | None | str:
    try:
        return ResponseFormatConfig.model_validate(value).to_format()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        return f"response_format{'.' + where if where else ''}: {first['msg']}"
